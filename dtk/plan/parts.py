"""The model's parallelism keys against its modules, on the login node: a `model.tp_plan`
pattern, a `model.wrap_classes` name or a `model.split_points` path that names nothing is
an error before the queue, not a worker's crash after it (or, for `wrap_classes`, a run
that silently shards nothing). No torch: the modules come from the ModelShape (the
built-in transformer's from its keys, a user model's from dtk.plan.count_model), and they
are matched the way dtk.parallel.units matches them on the workers.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from dtk.common.errors import UserError
from dtk.config.schema import ModelConfig
from dtk.plan.degrees import Degrees
from dtk.plan.shape import ModelShape

# The built-in factories' keyword arguments, for the login node, which imports neither
# torch nor transformers: (required, optional). tests/test_model_parts.py holds them against
# the factories' signatures. The transformer's keys are also its schema's (checked while composing).
BUILTIN_ARGUMENTS = {
    "dtk.models.transformer.build": (
        (), ("vocab_size", "dim", "num_layers", "num_heads", "ffn_hidden", "seq_len", "norm_eps", "dropout",
             "tie_embeddings", "num_experts", "top_k", "aux_loss_weight", "capacity_factor"),
    ),
    "dtk.models.hf.build": (
        ("seq_len",), ("config", "init_from", "vocab_size", "attn_implementation", "config_overrides"),
    ),
}


def check_builtin_arguments(model: ModelConfig) -> None:
    """A built-in factory's keys against its arguments, before anything imports it."""
    if model._target_ not in BUILTIN_ARGUMENTS:
        return
    required, optional = BUILTIN_ARGUMENTS[model._target_]
    unknown = sorted(set(model.kwargs) - {*required, *optional})
    missing = [k for k in required if model.kwargs.get(k) is None]
    if unknown:
        raise UserError(f"model.{unknown[0]}: {model._target_} takes no such key; it takes"
                        f" {', '.join((*required, *optional))}")
    if missing:
        raise UserError(f"model.{missing[0]}: {model._target_} needs it; set model.{missing[0]}=VALUE")


def _listed(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def check_parts(shape: ModelShape, *, wrap_classes: tuple[str, ...], tp_plan: dict[str, str],
                split_points: tuple[str, ...], degrees: Degrees, pp_virtual_stages: int, target: str) -> None:
    """Raise UserError where the keys name what the model does not have. `wrap_classes` and
    `tp_plan` are the ones the workers use (the yaml's, else the model's own)."""
    modules = shape.modules
    if not modules:  # not counted module by module (a what-if shape): nothing to hold the keys against
        return
    classes = sorted({name for _, name, _ in modules})
    for name in wrap_classes:
        if not any(name in (short, qualified) for path, short, qualified in modules if path):
            raise UserError(
                f"model.wrap_classes: {name} is no class of a module of {target} (FSDP and activation"
                f" checkpointing would find no block); its classes: {_listed(classes, 12)}"
            )
    paths = [path for path, _, _ in modules if path]
    if degrees.tp > 1:
        if not tp_plan:
            raise UserError(
                f"scheme.tp={degrees.tp}: {target} has no tensor-parallel plan; give model.tp_plan (module path"
                " pattern -> style, docs/schemes.md) in the model's yaml, or use a scheme without tp (ddp, fsdp)"
            )
        for pattern in tp_plan:
            if not any(fnmatchcase(p, pattern) for p in paths):
                raise UserError(
                    f"model.tp_plan: the pattern {pattern} matches no module of {target}; module paths:"
                    f" {_listed(paths)}"
                )
    units = [u for u, _ in shape.units]
    missing = [p for p in split_points if p not in units]
    if missing:
        raise UserError(
            f"model.split_points: {', '.join(missing)} is no pipeline unit of {target}; its units: {_listed(units)}"
        )
    starts = [units.index(p) for p in split_points]
    if starts and (starts != sorted(set(starts)) or starts[0] == 0):
        raise UserError(f"model.split_points={list(split_points)}: give them in forward order, each once, after the"
                        f" first unit ({units[0]})")
    stages = degrees.pp * pp_virtual_stages
    blocks = sum(1 for _, block in shape.units if block)
    if stages > 1 and not split_points and blocks < stages:
        raise UserError(
            f"scheme.pp x scheme.pp_virtual_stages = {stages} pipeline stages, but {target} has {blocks} repeated"
            " blocks (items of a ModuleList, ModuleDict or Sequential); each stage needs one: use fewer stages,"
            " or give model.split_points"
        )
