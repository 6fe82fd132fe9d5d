"""Tensor parallelism with DTensor, driven by the model config's `tp_plan`.

A plan maps module path patterns (shell style, `layers.*.attn.wq`) to a style:

    style              what the module does                      sequence_parallel=true adds
    colwise            Linear split by output features; output   (input must already be
                       stays split (feeds a rowwise)              gathered: see sequence_gather)
    rowwise            Linear split by input features, or an      output reduce-scattered along
                       Embedding split by rows; output summed     the sequence instead of summed
                       to a full (replicated) tensor
    colwise_output     the output head: split by output          input gathered from sequence
                       features, logits gathered to full          shards first
    sequence_parallel  nothing (a norm on replicated input)      the norm runs on its sequence
                                                                 shard only
    sequence_gather    nothing                                   the module's input is gathered
                                                                 from sequence shards once (an
                                                                 attention or MLP block)

Activations between modules are plain local tensors (use_local_output), so the model's
own code runs unchanged on its shard: an attention module sees n_heads / tp heads.
"""

from __future__ import annotations

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

from dtk.parallel.units import pattern_matches

TP_STYLES = ("colwise", "rowwise", "colwise_output", "sequence_parallel", "sequence_gather")
SEQ_DIM = 1  # activations are (batch, sequence, features)


def make_style(style: str, module: nn.Module, *, sequence_parallel: bool) -> ParallelStyle | None:
    """The torch ParallelStyle of one module, or None when the style is a no-op here."""
    seq = Shard(SEQ_DIM)
    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        # Token ids (or positions) reach an Embedding whole on every rank.
        input_layouts = Replicate() if isinstance(module, nn.Embedding) else Shard(-1)
        return RowwiseParallel(input_layouts=input_layouts, output_layouts=seq if sequence_parallel else Replicate())
    if style == "colwise_output":
        return ColwiseParallel(input_layouts=seq if sequence_parallel else Replicate(), output_layouts=Replicate())
    if style == "sequence_parallel":
        return SequenceParallel(sequence_dim=SEQ_DIM) if sequence_parallel else None
    if style == "sequence_gather":
        if not sequence_parallel:
            return None
        return PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
    raise ValueError(f"tensor-parallel style {style!r}: expected one of {', '.join(TP_STYLES)}")


def check_tp_plan(model: nn.Module, tp_plan: dict[str, str]) -> None:
    """Fail early, on the whole model, when a pattern names nothing or a style is unknown."""
    if not tp_plan:
        raise ValueError("scheme.tp > 1 needs model.tp_plan (module path pattern → style); this model has none")
    for pattern, style in tp_plan.items():
        if style not in TP_STYLES:
            raise ValueError(f"model.tp_plan[{pattern!r}]={style}: expected one of {', '.join(TP_STYLES)}")
        if not pattern_matches(model, pattern):
            raise ValueError(f"model.tp_plan pattern {pattern!r} matches no module of the model")


def apply_tp(module: nn.Module, *, mesh: DeviceMesh, tp_plan: dict[str, str], sequence_parallel: bool) -> None:
    """Shard the matched modules of `module` (a whole model or one pipeline stage) in place."""
    for pattern, style in tp_plan.items():
        for _, target in pattern_matches(module, pattern):
            parallel_style = make_style(style, target, sequence_parallel=sequence_parallel)
            if parallel_style is not None:
                parallelize_module(target, mesh, parallel_style)
