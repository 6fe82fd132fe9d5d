"""Tensor parallelism with DTensor, driven by the model config's `tp_plan`.

A plan maps module path patterns (shell style, `layers.*.attn.wq`) to a style:

    style              what the module does                      sequence_parallel=true adds
    colwise            Linear split by output features; output   (input must already be
                       stays split (feeds a rowwise)              gathered: see sequence_gather)
    rowwise            Linear split by input features, or an      output reduce-scattered along
                       Embedding split by rows; output summed     the sequence instead of summed
                       to a full (replicated) tensor
    colwise_output     the output head: split by output          input gathered from sequence
                       features; the logits stay split over       shards first
                       the vocabulary when the loss computes
                       on shards (loss_parallel), else gathered
    sequence_parallel  nothing (a norm on replicated input)      the norm runs on its sequence
                                                                 shard only
    sequence_gather    nothing                                   the module's input is gathered
                                                                 from sequence shards once (an
                                                                 attention or MLP block)

Activations between modules are plain local tensors (use_local_output), so the model's
own code runs unchanged on its shard: an attention module sees num_heads / tp heads.

The logits are the largest activation of a language model (batch x sequence x vocabulary).
With `loss_parallel` they leave the head as a DTensor sharded over the vocabulary, and the
cross-entropy runs on the shards (torch's loss_parallel: each rank exchanges only its
per-token maxima and sums), so no rank ever holds the full logits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from dtk.common.errors import UserError
from dtk.config.choices import TpStyle
from dtk.parallel.units import pattern_matches

SEQ_DIM = 1  # activations are (batch, sequence, features)
SEQ = Shard(SEQ_DIM)


def _colwise(module: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> ParallelStyle | None:
    return ColwiseParallel()


def _rowwise(module: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> ParallelStyle | None:
    # Token ids (or positions) reach an Embedding whole on every rank.
    input_layouts = Replicate() if isinstance(module, nn.Embedding) else Shard(-1)
    return RowwiseParallel(input_layouts=input_layouts, output_layouts=SEQ if sequence_parallel else Replicate())


def _colwise_output(module: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> ParallelStyle | None:
    input_layouts = SEQ if sequence_parallel else Replicate()
    if loss_parallel:  # a DTensor sharded over the vocabulary, for the loss to compute on
        return ColwiseParallel(input_layouts=input_layouts, output_layouts=Shard(-1), use_local_output=False)
    return ColwiseParallel(input_layouts=input_layouts, output_layouts=Replicate())


def _sequence_parallel(module: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> ParallelStyle | None:
    return SequenceParallel(sequence_dim=SEQ_DIM) if sequence_parallel else None


def _sequence_gather(module: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> ParallelStyle | None:
    if not sequence_parallel:
        return None
    return PrepareModuleInput(input_layouts=(SEQ,), desired_input_layouts=(Replicate(),))


# What each style of the schema (dtk/config/choices.py) is in torch; a test checks that
# every TpStyle member is here.
STYLES: dict[TpStyle, Callable[[nn.Module, bool, bool], ParallelStyle | None]] = {
    TpStyle.colwise: _colwise,
    TpStyle.rowwise: _rowwise,
    TpStyle.colwise_output: _colwise_output,
    TpStyle.sequence_parallel: _sequence_parallel,
    TpStyle.sequence_gather: _sequence_gather,
}


def make_style(style: TpStyle, module: nn.Module, *, sequence_parallel: bool, loss_parallel: bool) -> ParallelStyle | None:
    """The torch ParallelStyle of one module, or None when the style is a no-op here."""
    return STYLES[style](module, sequence_parallel, loss_parallel)


def check_tp_plan(model: nn.Module, tp_plan: Mapping[str, str]) -> None:
    """Fail early, on the whole model, when a pattern names nothing (the styles themselves
    were checked while composing)."""
    if not tp_plan:
        raise UserError("scheme.tp > 1 needs model.tp_plan (module path pattern -> style, docs/schemes.md);"
                        " this model has none: give one in the model's yaml, or use a scheme without tp")
    for pattern, style in tp_plan.items():
        if style not in TpStyle.values():
            raise UserError(
                f"model.tp_plan: the model's own plan gives {pattern} the style {str(style).removeprefix('unsupported:')},"
                f" which dtk has no equivalent of; give model.tp_plan in the model's yaml (styles: {', '.join(TpStyle.values())})"
            )
        if not pattern_matches(model, pattern):
            raise UserError(f"model.tp_plan pattern {pattern!r} matches no module of the model")


def apply_tp(
    module: nn.Module, *, mesh: DeviceMesh, tp_plan: Mapping[str, str], sequence_parallel: bool, loss_parallel: bool
) -> None:
    """Shard the matched modules of `module` (a whole model or one pipeline stage) in place;
    `loss_parallel`: the output head's logits stay sharded (see the module doc)."""
    for pattern, style in tp_plan.items():
        for _, target in pattern_matches(module, pattern):
            parallel_style = make_style(TpStyle(style), target, sequence_parallel=sequence_parallel,
                                        loss_parallel=loss_parallel)
            if parallel_style is not None:
                parallelize_module(target, mesh, parallel_style)
