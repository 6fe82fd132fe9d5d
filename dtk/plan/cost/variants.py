"""The schemes side by side: each of ddp, zero, zero2, fsdp, hsdp, tp, pp, hybrid as its
file in conf/scheme/ defines it, at any node count, without composing the config again.

A scheme file's degrees may follow the job's size (`dp_replicate: ${nodes}`), so a
scheme is resolved per node count here: the file's values, with `${nodes}` and
`${tasks_per_node}` filled in, over the schema's defaults. The job's own choices that are
not about the scheme's layout (activation checkpointing, dtypes, compile) carry over, so
that every row compares layouts of the same training job.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from dtk.common.errors import UserError
from dtk.config.convert import typed
from dtk.config.schema import ModelConfig, SchemeConfig
from dtk.plan.degrees import Axis, CarvedAxis, Degrees, check_scheme, micro_batch_size, resolve_degrees

SCHEME_KEYS = ("ddp", "zero", "zero2", "fsdp", "hsdp", "tp", "pp", "hybrid")
CARRIED = ("activation_checkpoint", "param_dtype", "reduce_dtype", "compile")
"""Scheme keys that describe the training job rather than the layout: kept from the job's scheme."""
INTERPOLATIONS = ("${nodes}", "${tasks_per_node}")


@dataclass(frozen=True)
class Variant:
    key: str
    scheme: dict[str, Any]
    degrees: Degrees
    nodes: int
    tasks_per_node: int
    micro_batch: int
    num_micro: int

    @property
    def overrides(self) -> list[str]:
        """What to type to get this scheme (besides the node count)."""
        return [f"+scheme={self.key}"]


@functools.lru_cache(maxsize=16)
def scheme_file(conf_dirs: tuple[str, ...], name: str) -> dict[str, Any]:
    """The raw values of scheme/NAME.yaml, from the first config folder that has it (the
    user's folders come before dtk's own, as when composing); interpolations unresolved."""
    import yaml

    path = next((Path(d) / "scheme" / f"{name}.yaml" for d in conf_dirs
                 if (Path(d) / "scheme" / f"{name}.yaml").is_file()), None)
    if path is None:
        raise UserError(f"+scheme={name}: no scheme/{name}.yaml in {', '.join(conf_dirs)}")
    raw = yaml.safe_load(path.read_text()) or {}
    raw.pop("defaults", None)
    return raw


def _fill(value: Any, nodes: int, tasks_per_node: int, key: str) -> Any:
    if not isinstance(value, str) or "${" not in value:
        return value
    if value == "${nodes}":
        return nodes
    if value == "${tasks_per_node}":
        return tasks_per_node
    raise UserError(f"scheme.{key}={value}: the planner resolves only {', '.join(INTERPOLATIONS)} in scheme files")


def follows_size(conf_dirs: tuple[str, ...], name: str) -> dict[str, str]:
    """Keys of a scheme file whose value is an interpolation of the job's size."""
    try:
        raw = scheme_file(conf_dirs, name)
    except UserError:
        return {}
    return {k: v for k, v in raw.items() if isinstance(v, str) and v in INTERPOLATIONS}


def resolve_scheme(
    defaults: dict[str, Any], raw: dict[str, Any], *, nodes: int, tasks_per_node: int,
    carried: dict[str, Any], extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    scheme = dict(defaults)
    scheme.update({k: v for k, v in carried.items() if k in CARRIED})
    scheme.update({k: _fill(v, nodes, tasks_per_node, k) for k, v in raw.items()})
    scheme.update(extra or {})
    return scheme


SIZE_KEYS = (*Axis.values(), *CarvedAxis.values())
"""The degree keys, one per mesh axis (dtk.plan.degrees.Axis, and the carved CarvedAxis)."""
FAST_KEYS = ("data_parallel", "shard_optimizer", "reshard_after_forward", "sequence_parallel", "cpu_offload",
             "activation_checkpoint", "pp_schedule", "pp_virtual_stages", "pp_microbatches")
"""Keys the planner's search varies: set on a typed copy when their value has the field's
type (an Enum member's value, a bool, an int), typed by OmegaConf otherwise."""
_DEFAULT = SchemeConfig()


@functools.lru_cache(maxsize=256)
def _typed_layout(items: tuple[tuple[str, Any], ...]) -> SchemeConfig:
    return typed(SchemeConfig, dict(items), prefix="scheme.")


_NOT_FAST = object()


def _fast(key: str, value: Any) -> Any:
    """`value` as the field's type, or _NOT_FAST when it is not plainly one (OmegaConf decides).
    A field whose default is None (reshard_after_forward: unset) takes None or a bool."""
    default = getattr(_DEFAULT, key)
    if isinstance(default, Enum):
        try:
            return type(default)(value)
        except ValueError:
            return _NOT_FAST
    if default is None:
        return value if value is None or type(value) is bool else _NOT_FAST
    return value if type(value) is type(default) else _NOT_FAST


def checked_scheme(scheme: dict[str, Any]) -> SchemeConfig:
    """`scheme` typed by SchemeConfig. Typing is slow (OmegaConf), and the planner tries a
    scheme at hundreds of sizes and layouts, which differ only in integer degrees and a few
    closed-set or boolean options: the rest is typed once and those set on a copy."""
    fast = {k: scheme[k] for k in SIZE_KEYS if k in scheme and type(scheme[k]) is int}
    for k in FAST_KEYS:
        if k in scheme and (v := _fast(k, scheme[k])) is not _NOT_FAST:
            fast[k] = v
    rest = tuple(sorted((k, v) for k, v in scheme.items() if k not in fast))
    return dataclasses.replace(_typed_layout(rest), **fast)


def make_variant(
    key: str, scheme: dict[str, Any], *, nodes: int, tasks_per_node: int, global_batch: int,
    micro_batch: int | None, model: ModelConfig, blocks: int,
) -> Variant:
    """Degrees and batch split of `scheme` at a size; UserError (with the reason) when the
    scheme cannot run there. The scheme is a dict here (resolved from its file, not
    composed); it is typed by SchemeConfig for the checks, its values checked as a
    composed one's."""
    world = nodes * tasks_per_node
    checked = checked_scheme(scheme)
    degrees = resolve_degrees(checked, world)
    if global_batch % degrees.dp:
        raise UserError(f"train.global_batch={global_batch} does not split over the data-parallel size {degrees.dp}")
    micro = micro_batch_size(checked, micro_batch=micro_batch, global_batch=global_batch, degrees=degrees)
    if micro < 1 or global_batch % (micro * degrees.dp):
        raise UserError(f"train.global_batch={global_batch} is not a multiple of micro batch {micro} x dp {degrees.dp}")
    num_micro = global_batch // (micro * degrees.dp)
    check_scheme(checked, degrees, model, num_microbatches=num_micro, eval_every=0)
    stages = degrees.pp * scheme["pp_virtual_stages"]
    if degrees.pp > 1 and stages > blocks:
        raise UserError(f"{stages} pipeline stages, but the model has {blocks} block(s) to split")
    return Variant(key, scheme, degrees, nodes, tasks_per_node, micro, num_micro)


def standard_scheme(
    key: str, conf_dirs: tuple[str, ...], defaults: dict[str, Any], carried: dict[str, Any], *, nodes: int,
    tasks_per_node: int,
) -> dict[str, Any]:
    """One of SCHEME_KEYS, from its file, at a size."""
    raw = scheme_file(conf_dirs, key)
    return resolve_scheme(defaults, raw, nodes=nodes, tasks_per_node=tasks_per_node, carried=carried)


def chosen_at(
    chosen: dict[str, Any], conf_dirs: tuple[str, ...], *, current_nodes: int, current_tpn: int, nodes: int, tasks_per_node: int,
) -> dict[str, Any]:
    """The job's own scheme at another size: keys that its file ties to `${nodes}` (or
    `${tasks_per_node}`) follow, unless the command line set them to something else."""
    scheme = dict(chosen)
    for key, expr in follows_size(conf_dirs, chosen["name"]).items():
        current = current_nodes if expr == "${nodes}" else current_tpn
        if chosen.get(key) == current:
            scheme[key] = nodes if expr == "${nodes}" else tasks_per_node
    return scheme


def scheme_key(scheme: dict[str, Any]) -> str:
    """Which of SCHEME_KEYS a composed scheme is (its name; fsdp that keeps gathered
    parameters is zero2, as +scheme=zero2 is)."""
    name = scheme["name"]
    if name == "fsdp" and scheme["reshard_after_forward"] is False:
        return "zero2"
    return name
