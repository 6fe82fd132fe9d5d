"""Parallel degrees: `dp_replicate × dp_shard × tp × pp = world size`, one of them may be -1."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dtk.errors import UserError

AXES = ("dp_replicate", "dp_shard", "tp", "pp")


@dataclass(frozen=True)
class Degrees:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int

    @property
    def dp(self) -> int:
        """Data-parallel size: ranks that see different samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp


def resolve_degrees(scheme: dict[str, Any], world: int) -> Degrees:
    """Infer the one `-1` degree and check that the product is the world size."""
    values = {axis: scheme[axis] for axis in AXES}
    inferred = [axis for axis, v in values.items() if v == -1]
    for axis, v in values.items():
        if v != -1 and (not isinstance(v, int) or v < 1):
            raise UserError(f"scheme.{axis}={v}: expected a positive integer or -1 (inferred)")
    if len(inferred) > 1:
        raise UserError(
            f"scheme degrees {', '.join(f'{a}=-1' for a in inferred)}: at most one degree may be -1 (inferred)"
        )
    known = 1
    for v in values.values():
        if v != -1:
            known *= v
    formula = " × ".join(f"{a}={values[a]}" for a in AXES)
    if inferred:
        if world % known:
            raise UserError(
                f"{formula}: the fixed degrees multiply to {known}, which does not divide world size {world}"
                f" (nodes × tasks_per_node)"
            )
        values[inferred[0]] = world // known
    elif known != world:
        raise UserError(
            f"{formula} = {known}, but the world size (nodes × tasks_per_node) is {world};"
            " make the product equal, or set one degree to -1"
        )
    return Degrees(**values)
