"""A user's `_target_` model counted on the meta device, in a subprocess with a time limit.

The login-node path imports no torch: `count_user_model` starts
`python -m dtk.plan.count_model`, which builds the model on the meta device (no memory, no
initialisation) and prints each parameter's name, shape, pipeline unit, whether the unit is
a block, the dimension the model's tp_plan splits and whether it is a matmul weight, as
JSON. Activations of a user model are not estimated (its forward is its own): the budget
says so, and `plan.hidden` / `plan.seq_len` give a transformer-shaped estimate instead.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from dtk.config.convert import model_config, model_to_dict
from dtk.config.schema import ModelConfig
from dtk.errors import UserError
from dtk.plan.shape import ModelShape, shape_from_counted, tp_dim_for

COUNT_TIMEOUT_S = 60
EXIT_USER_ERROR = 2  # the subprocess found a mistake in the model's keys; its last stderr line says which


class NotCounted(UserError):
    """The model could not be built on the meta device (or not in time): `python -m dtk.plan`
    says so as an error; dtk.submit submits without the memory check, and says so."""


def count_user_model(model: ModelConfig, timeout_s: float = COUNT_TIMEOUT_S) -> ModelShape:
    target = model._target_
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "dtk.plan.count_model"], input=json.dumps(model_to_dict(model)),
            capture_output=True, text=True, timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        raise NotCounted(
            f"model._target_={target}: building it on the meta device to count its parameters took over"
            f" {timeout_s:.0f} s; set plan.params (and plan.layers) to plan without building it"
        ) from None
    last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    if proc.returncode == EXIT_USER_ERROR and last.startswith("error: "):
        # The keys do not fit the model: the workers would fail the same way, after the queue.
        raise UserError(last.removeprefix("error: "))
    if proc.returncode != 0:
        raise NotCounted(f"model._target_={target}: cannot count its parameters on the meta device: {last}")
    return shape_from_counted(json.loads(proc.stdout))


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
    try:
        record = count(model_config(json.loads(sys.stdin.read())))
    except UserError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
