"""The checks a what-if model (the plan.* keys) gets instead of the built-in transformer's.

With plan.params and its friends set, the budget plans a model that is not the config's
`model` group: the degrees are checked against the what-if's own dimensions (plan.heads,
plan.hidden, plan.layers, ...) wherever a typed command or a searched candidate is
checked, never against the built-in transformer's that the config happens to hold.

What each degree needs of the what-if:
- tp > 1: depth, width and heads (plan.layers, plan.hidden, plan.heads), and tp divides the
  heads, the width, the feed-forward width (8/3 x hidden rounded up to 16) and, when
  given, the vocabulary (the embedding and the output head are split by rows);
- pp > 1: a depth (plan.layers), and at most one stage per block.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from dtk.common.errors import UserError
from dtk.config.schema import Config
from dtk.plan.shape import ModelShape, ffn_hidden_size, whatif_shape

WHATIF_KEYS = ("params", "layers", "hidden", "seq_len", "heads", "vocab_size")
"""plan.* keys that describe a model (the bytes-per-element keys do not make a what-if)."""


def whatif_keys(cfg: Config) -> dict[str, Any]:
    """The plan.* model keys that are set; empty for a job that plans its own model."""
    return {k: v for k, v in dataclasses.asdict(cfg.plan).items() if k in WHATIF_KEYS and v is not None}


def whatif_of(cfg: Config) -> ModelShape | None:
    """The what-if model's shape, or None when no plan.* model key is set."""
    keys = whatif_keys(cfg)
    return whatif_shape(dict(dataclasses.asdict(cfg.plan), **keys)) if keys else None


def _needs(shape: ModelShape, what: str, keys: tuple[str, ...]) -> None:
    missing = [f"plan.{k}" for k in keys if not getattr(shape, k)]
    if missing:
        raise UserError(f"{what} of a what-if model needs {', '.join(missing)} (the model's shape to split);"
                        " give them, or plan without it")


def check_whatif(degrees: Any, shape: ModelShape, *, virtual_stages: int) -> None:
    """The degrees against a what-if model's dimensions; UserError with the arithmetic."""
    tp, pp = degrees.tp, degrees.pp
    if tp > 1:
        _needs(shape, f"scheme.tp={tp}", ("layers", "hidden", "heads"))
        assert shape.heads is not None and shape.hidden is not None  # _needs checked them
        sizes: dict[str, int] = {"plan.heads": shape.heads, "plan.hidden": shape.hidden,
                                 "the feed-forward width (8/3 x plan.hidden, rounded up to 16)":
                                     ffn_hidden_size(shape.hidden, 0)}
        if shape.vocab:
            sizes["plan.vocab_size"] = shape.vocab
        common = math.gcd(*sizes.values())
        for key, size in sizes.items():
            if size % tp:
                ok = [d for d in range(1, min(common, 64) + 1) if common % d == 0]
                raise UserError(f"scheme.tp={tp} does not divide {key}={size} ({size} / {tp} = {size / tp:.2f});"
                                f" tensor parallelism splits it evenly: try scheme.tp in {ok}")
    if pp > 1:
        _needs(shape, f"scheme.pp={pp}", ("layers",))
        stages = pp * virtual_stages
        if stages > shape.layers:
            raise UserError(f"scheme.pp x scheme.pp_virtual_stages = {pp} x {virtual_stages} = {stages} pipeline"
                            f" stages, but plan.layers={shape.layers}: each stage needs at least one block;"
                            f" use at most {shape.layers} stages")
