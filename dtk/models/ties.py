"""Tied parameters: one tensor reached under several names (a language model whose output
head is its token embedding: `lm_head.weight = wte.weight`).

Steps that give modules new parameters one module at a time split a tie into independent
copies: `Module.to_empty()` (materialization) and tensor parallelism's
`parallelize_module` (each module's weight becomes its own DTensor). dtk finds the ties on
the meta model, by identity, before such a step (`tied_groups`) and makes the later names
point at the first one's parameter again after it (`retie`): a tied model keeps one
parameter, one gradient, one optimizer state.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from dtk.common.errors import UserError

ELSEWHERE = "dtk_tied_elsewhere"
"""Attribute of a pipeline stage module: {a name it holds: the first name of that tie, held
by another stage} (dtk.parallel.stage_ties). Its copy is initialised, saved and loaded under
the first name."""


def tied_groups(module: nn.Module) -> list[tuple[str, ...]]:
    """The names of each parameter that `module` reaches under more than one name, in
    `named_parameters` order (the first name is the one `named_parameters()` reports)."""
    by_id: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [tuple(names) for names in by_id.values() if len(names) > 1]


def checkpoint_keys(module: nn.Module, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None:
    """The state dicts of `module` (get_state_dict's, flattened) as the checkpoint holds them,
    in place: a tie once, under its first name; a pipeline stage's copy of a weight whose
    first name is another stage's, under that first name (both stages write the same values,
    which DCP writes once)."""
    for alias in tied_aliases(module):
        model_sd.pop(alias, None)
    for name, first in elsewhere(module).items():
        model_sd[first] = model_sd.pop(name)
        _rename_optim(optim_sd, name, first)


def module_keys(module: nn.Module, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None:
    """The inverse of `checkpoint_keys`, in place: what set_state_dict of `module` expects."""
    for name, first in elsewhere(module).items():
        model_sd[name] = model_sd.pop(first)
        _rename_optim(optim_sd, first, name)
    model_sd |= {alias: model_sd[first] for alias, first in tied_aliases(module).items()}


def elsewhere(module: nn.Module) -> dict[str, str]:
    return dict(getattr(getattr(module, "module", module), ELSEWHERE, {}))  # DDP wraps a stage


def _rename_optim(optim_sd: dict[str, Any], old: str, new: str) -> None:
    for key in list(optim_sd):
        for kind in ("state.", "param_groups."):
            if key.startswith(f"{kind}{old}."):
                optim_sd[f"{kind}{new}.{key[len(kind) + len(old) + 1:]}"] = optim_sd.pop(key)


def tied_aliases(module: nn.Module) -> dict[str, str]:
    """Each later name of a tied parameter -> its first name, as state-dict keys (no
    `module.` or `_orig_mod.` prefix): a checkpoint holds the tensor once, under its first
    name (dtk.checkpoint.sharded), and a load hands it to the other names too."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    aliases = {}
    for names in tied_groups(module):
        first, *later = (next(iter(_get_fqns(module, n))) for n in names)
        aliases.update(dict.fromkeys(later, first))
    return aliases


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    owner_name, _, leaf = name.rpartition(".")
    return (module.get_submodule(owner_name) if owner_name else module), leaf


def retie(module: nn.Module, groups: list[tuple[str, ...]]) -> None:
    """Point every name of each group at the parameter of its first name. A name this module
    no longer holds (its module is None or gone: another pipeline stage's) is skipped. Two
    copies that are not laid out alike (a DTensor sharded one way and one another way) cannot
    be one tensor: UserError."""
    for names in groups:
        held = [n for n in names if holds(module, n)]
        if len(held) < 2:
            continue
        keep = module.get_parameter(held[0])
        for name in held[1:]:
            owner, leaf = _owner(module, name)
            other = owner._parameters[leaf]
            if other is keep:
                continue
            assert other is not None, "a held name has a parameter"
            if _layout(other) != _layout(keep):
                raise UserError(
                    f"model.tp_plan lays out the tied weights {held[0]} and {name} differently"
                    f" ({_layout(keep)} and {_layout(other)}), so they cannot stay one tensor; shard both"
                    " over the vocabulary: the embedding rowwise and the output head colwise_output (docs/byo.md)"
                )
            owner._parameters[leaf] = keep


def holds(module: nn.Module, name: str) -> bool:
    try:
        owner, leaf = _owner(module, name)
    except AttributeError:  # a module on the path is None or gone
        return False
    return owner._parameters.get(leaf) is not None


def _layout(param: nn.Parameter) -> str:
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        return f"{tuple(param.shape)} {list(param.placements)} on mesh {param.device_mesh.mesh.tolist()}"
    return f"{tuple(param.shape)} whole"
