"""A model counted on the meta device: each parameter's name, shape, pipeline unit, whether
the unit is a block, the dimension the model's tp_plan splits and whether it is a matmul
weight. The planner (dtk.plan.count_model) runs this as `python -m dtk.parallel.count` in a
subprocess for a user's model, so the login node imports no torch; a worker calls it with
the model it built (`real_shape`). It lives here, after the planner's layer, because it
builds the model (dtk.models) and splits it into units as parallelize does (units.py).

The record (or the one line of a mistake in the model's keys) travels in a file whose path
the caller hands over with the model's keys on stdin, never on stdout: a model's constructor may print ("number of
parameters: 0.41M"), and what it prints is the user's, relayed by the planner to its
stderr."""

from __future__ import annotations

import json
import sys
from typing import Any

from dtk.common.errors import UserError
from dtk.config.convert import model_config
from dtk.config.schema import Config, ModelConfig
from dtk.plan.count_model import EXIT_USER_ERROR
from dtk.plan.shape import ModelShape, builtin_config, builtin_shape, shape_from_counted, tp_dim_for


def real_shape(cfg: Config, meta_model: Any = None) -> ModelShape:
    """The shape of the model the workers train: the built-in transformer from its config
    (no torch), any other model counted on the meta device in this process (`meta_model`,
    a build on meta not yet parallelized, saves building it again)."""
    transformer = builtin_config(cfg.model)
    if transformer is not None:
        return builtin_shape(transformer)
    return shape_from_counted(count(cfg.model, model=meta_model))


def count(model_cfg: ModelConfig, model: Any = None) -> dict[str, Any]:
    """The record count_user_model reads; runs in the subprocess (imports torch), or in a
    worker with the model it built on meta (`model`, not yet parallelized)."""
    from torch import nn

    from dtk.models.build import ParallelSpec, build_model
    from dtk.parallel.units import pipeline_units

    if model is None:
        try:
            model = build_model(model_cfg, device="meta", seed=0)
        except TypeError as exc:  # the factory's own keys misused (a key of the wrong type, ...)
            raise UserError(f"model._target_={model_cfg._target_}: building it failed: TypeError: {exc}") from None
    units = pipeline_units(model)
    blocks = dict(units)
    spec = ParallelSpec.from_config(model_cfg).with_model_defaults(model)  # what the workers use
    tp_plan = dict(spec.tp_plan)
    modules = dict(model.named_modules())
    tensors = []
    for name, p in model.named_parameters():
        unit = next((u for u, _ in units if name == u or name.startswith(f"{u}.")), "")
        module_path = name.rpartition(".")[0]
        module = modules.get(module_path)
        embedding = isinstance(module, nn.Embedding)
        tp_dim = tp_dim_for(module_path, embedding=embedding, tp_plan=tp_plan) if name.endswith("weight") else None
        tensors.append({
            "name": name, "shape": list(p.shape), "unit": unit, "block": blocks.get(unit, False),
            "tp_dim": tp_dim, "matmul": isinstance(module, nn.Linear) and name.endswith("weight"),
            "embedding": embedding,
        })
    return {
        "tensors": tensors,
        "units": [[u, b] for u, b in units],
        "source": f"model {model_cfg._target_} (counted on the meta device)",
        "layers": sum(1 for _, b in units if b) or None,
        "modules": [[path, type(m).__name__, f"{type(m).__module__}.{type(m).__qualname__}"]
                    for path, m in modules.items()],
        "wrap_classes": list(spec.wrap_classes),
        "tp_plan": {k: str(v) for k, v in tp_plan.items()},
    }


def main() -> int:
    """Fed on stdin with {"model": the model's keys, "result": a file path}: writes
    {"record": ...} to that file, or {"error": LINE} (exit EXIT_USER_ERROR) for a mistake in
    the model's keys. What the model prints goes wherever the caller sends stdout."""
    given = json.loads(sys.stdin.read())
    try:
        result: dict[str, Any] = {"record": count(model_config(given["model"]))}
        code = 0
    except UserError as exc:
        result, code = {"error": " ".join(str(exc).split())}, EXIT_USER_ERROR
    sys.stdout.flush()
    with open(given["result"], "w") as f:  # written last, whole: the caller reads it after the exit
        json.dump(result, f)
    return code


if __name__ == "__main__":
    sys.exit(main())
