"""The model as the memory planner sees it: its parameter tensors and its shape, no torch.

Three sources give the same record:

- the built-in transformer, from its config keys alone: every tensor with its exact
  shape, the unit it belongs to (an FSDP / pipeline unit) and the dimension tensor
  parallelism splits (from `model.tp_plan`, matched the way `dtk.parallel.tp` matches it);
- a user's `_target_` model, counted on the meta device in a subprocess
  (`dtk.plan.count_model`), which reports the same fields;
- what-if keys (`plan.params`, `plan.layers`, `plan.hidden`, ...) for capacity planning
  without a model: tensors are then stand-ins with the right totals (`exact=False`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from dtk.common.errors import UserError
from dtk.config.convert import builtin_transformer
from dtk.config.schema import ModelConfig, TransformerConfig

BUILTIN_TARGET = TransformerConfig._target_

# Tensor-parallel style -> dimension of a Linear weight it splits (None: whole on every rank).
# An Embedding under `rowwise` is split by rows (dim 0), see dtk/parallel/tp.py.
TP_WEIGHT_DIM = {"colwise": 0, "rowwise": 1, "colwise_output": 0}


@dataclass(frozen=True)
class ParamTensor:
    name: str
    shape: tuple[int, ...]
    unit: str
    """Pipeline unit that holds it (`tok_embeddings`, `layers.3`): see units.pipeline_units."""
    block: bool
    """The unit is a repeated block: an FSDP unit of its own and an activation-checkpoint unit."""
    tp_dim: int | None = None
    """Dimension tensor parallelism splits; None: whole on every tensor-parallel rank."""
    matmul: bool = False
    """Weight of a matmul: autocast keeps a low-precision copy of it through the step."""
    embedding: bool = False
    """Weight of an Embedding: split by rows under tensor parallelism, but its gradient comes
    back whole (DTensor's embedding backward), unless FSDP reduce-scatters it."""
    active: float = 1.0
    """Share of the tensor one token computes with: top_k / num_experts for a mixture of
    experts' stacked expert weights (FLOPs count it; memory counts the whole tensor)."""
    expert: bool = False
    """Stacked expert weights (model=moe): split over ep by their first dimension."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ModelShape:
    tensors: tuple[ParamTensor, ...]
    units: tuple[tuple[str, bool], ...]
    """Pipeline units in forward order, as (path, is_block)."""
    source: str
    """Where the numbers come from, for the report."""
    exact: bool = True
    """Tensors are the model's own; False for what-if stand-ins."""
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    seq_len: int | None = None
    vocab: int | None = None
    ffn_hidden: int | None = None
    modules: tuple[tuple[str, str, str], ...] = ()
    """(path, class name, module.qualname) of every module; empty for what-if stand-ins."""
    wrap_classes: tuple[str, ...] | None = None
    """The wrap classes the workers use, when counted (the yaml's, else the model's own
    dtk_wrap_classes); None: the yaml's."""
    tp_plan: dict[str, str] | None = None
    """The tensor-parallel plan the workers use, when counted (the yaml's, else the model's
    own dtk_tp_plan); None: the yaml's."""

    @property
    def params(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def active_params(self) -> float:
        """Parameters one token computes with (a mixture of experts: top_k of its experts)."""
        return sum(t.numel * t.active for t in self.tensors)

    @functools.cached_property
    def layouts(self) -> dict:
        """dtk.plan.layout.rank_layout's answers for this shape, by what they depend on: the
        plan search asks the same layout for every micro batch and recompute choice."""
        return {}

    @functools.cached_property
    def block_units(self) -> frozenset[str]:
        """Units that are repeated blocks (asked per tensor by the budget: a set, not a scan)."""
        return frozenset(unit for unit, is_block in self.units if is_block)

    @property
    def has_activation_shape(self) -> bool:
        """Enough to estimate activations: depth, width and sequence length."""
        return bool(self.layers and self.hidden and self.seq_len)


def ffn_hidden_size(dim: int, ffn_hidden: int) -> int:
    """The built-in transformer's SwiGLU width (the same rule as dtk.models.transformer)."""
    return ffn_hidden if ffn_hidden > 0 else 16 * math.ceil(8 * dim / 3 / 16)


def builtin_config(model: ModelConfig) -> TransformerConfig | None:
    """The built-in transformer's typed keys; None for any other model."""
    return builtin_transformer(model) if model._target_ == BUILTIN_TARGET else None


def is_builtin(model: ModelConfig) -> bool:
    return builtin_config(model) is not None


def tp_dim_for(module_path: str, *, embedding: bool, tp_plan: Mapping[str, str]) -> int | None:
    """Which weight dimension the first matching tp_plan pattern splits (as apply_tp applies them)."""
    for pattern, style in tp_plan.items():
        if fnmatchcase(module_path, pattern) and style in TP_WEIGHT_DIM:
            return 0 if embedding else TP_WEIGHT_DIM[style]
    return None


# The classes of dtk.models.transformer.Transformer's modules, by the last part of their
# path: (class name, module.qualname), as dtk.parallel.units.class_matches reads them.
# tests/test_model_parts.py holds this against a model built on the meta device.
_TORCH = "torch.nn.modules"
_BUILTIN_CLASSES = {
    "": ("Transformer", "dtk.models.transformer.Transformer"),
    "tok_embeddings": ("Embedding", f"{_TORCH}.sparse.Embedding"),
    "pos_embeddings": ("Embedding", f"{_TORCH}.sparse.Embedding"),
    "layers": ("ModuleDict", f"{_TORCH}.container.ModuleDict"),
    "block": ("Block", "dtk.models.transformer.Block"),
    "attn_norm": ("RMSNorm", "dtk.models.transformer.RMSNorm"),
    "mlp_norm": ("RMSNorm", "dtk.models.transformer.RMSNorm"),
    "norm": ("RMSNorm", "dtk.models.transformer.RMSNorm"),
    "attn": ("Attention", "dtk.models.transformer.Attention"),
    "mlp": ("FeedForward", "dtk.models.transformer.FeedForward"),
    "moe": ("MoE", "dtk.models.moe.MoE"),
    "experts": ("Experts", "dtk.models.moe.Experts"),
    "linear": ("Linear", f"{_TORCH}.linear.Linear"),
    "Dropout": ("Dropout", f"{_TORCH}.dropout.Dropout"),
    "Identity": ("Identity", f"{_TORCH}.linear.Identity"),
}


def builtin_modules(model: TransformerConfig) -> tuple[tuple[str, str, str], ...]:
    """(path, class name, module.qualname) of every module of the built-in transformer, in
    named_modules order."""
    def row(path: str, kind: str) -> tuple[str, str, str]:
        return (path, *_BUILTIN_CLASSES[kind])

    rows = [row("", ""), row("tok_embeddings", "tok_embeddings"), row("pos_embeddings", "pos_embeddings"),
            row("layers", "layers")]
    for i in range(model.num_layers):
        unit = f"layers.{i}"
        rows += [row(unit, "block"), row(f"{unit}.attn_norm", "attn_norm"), row(f"{unit}.attn", "attn")]
        rows += [row(f"{unit}.attn.{w}", "linear") for w in ("wq", "wk", "wv", "wo")]
        if model.num_experts:
            rows += [row(f"{unit}.mlp_norm", "mlp_norm"), row(f"{unit}.mlp", "moe"),
                     row(f"{unit}.mlp.router", "linear"), row(f"{unit}.mlp.experts", "experts")]
        else:
            rows += [row(f"{unit}.mlp_norm", "mlp_norm"), row(f"{unit}.mlp", "mlp")]
            rows += [row(f"{unit}.mlp.{w}", "linear") for w in ("w1", "w3", "w2")]
        rows.append(row(f"{unit}.drop", "Dropout" if model.dropout > 0 else "Identity"))
    rows += [row("norm", "norm"), row("output", "linear")]
    return tuple(rows)


def builtin_shape(model: TransformerConfig) -> ModelShape:
    """Every parameter of dtk.models.transformer.Transformer, in named_parameters order."""
    vocab, dim, layers, heads, seq = model.vocab_size, model.dim, model.num_layers, model.num_heads, model.seq_len
    hidden = ffn_hidden_size(dim, model.ffn_hidden)
    tp_plan = dict(model.tp_plan)
    tensors: list[ParamTensor] = []

    def add(module: str, shape: tuple[int, ...], unit: str, block: bool, *, embedding=False, matmul=False):
        tensors.append(
            ParamTensor(f"{module}.weight", shape, unit, block,
                        tp_dim_for(module, embedding=embedding, tp_plan=tp_plan), matmul, embedding)
        )

    # Tied, the embedding is also the output head's matmul weight.
    add("tok_embeddings", (vocab, dim), "tok_embeddings", False, embedding=True, matmul=model.tie_embeddings)
    add("pos_embeddings", (seq, dim), "pos_embeddings", False, embedding=True)
    for i in range(layers):
        unit = f"layers.{i}"
        add(f"{unit}.attn_norm", (dim,), unit, True)
        for name in ("wq", "wk", "wv", "wo"):
            add(f"{unit}.attn.{name}", (dim, dim), unit, True, matmul=True)
        add(f"{unit}.mlp_norm", (dim,), unit, True)
        if model.num_experts:
            tensors.extend(_moe_tensors(model, unit, hidden))
            continue
        add(f"{unit}.mlp.w1", (hidden, dim), unit, True, matmul=True)
        add(f"{unit}.mlp.w3", (hidden, dim), unit, True, matmul=True)
        add(f"{unit}.mlp.w2", (dim, hidden), unit, True, matmul=True)
    add("norm", (dim,), "norm", False)
    if not model.tie_embeddings:  # tied: the head's weight is tok_embeddings.weight, counted once
        add("output", (vocab, dim), "output", False, matmul=True)
    units = (
        ("tok_embeddings", False),
        ("pos_embeddings", False),
        *((f"layers.{i}", True) for i in range(layers)),
        ("norm", False),
        ("output", False),
    )
    return ModelShape(
        tensors=tuple(tensors), units=units, source="model (built-in transformer)", exact=True,
        layers=layers, hidden=dim, heads=heads, seq_len=seq, vocab=vocab, ffn_hidden=hidden,
        modules=builtin_modules(model),
    )


def _moe_tensors(model: TransformerConfig, unit: str, hidden: int) -> list[ParamTensor]:
    """A mixture of experts' router and stacked experts (dtk.models.moe): each token computes
    with top_k of the num_experts experts."""
    experts, dim = model.num_experts, model.dim
    share = model.top_k / experts
    router = ParamTensor(f"{unit}.mlp.router.weight", (experts, dim), unit, True, matmul=True)
    return [router, *(ParamTensor(f"{unit}.mlp.experts.{w}", shape, unit, True, matmul=True, active=share, expert=True)
                      for w, shape in (("w1", (experts, hidden, dim)), ("w3", (experts, hidden, dim)),
                                       ("w2", (experts, dim, hidden))))]


def whatif_shape(plan: dict[str, Any]) -> ModelShape:
    """Stand-in tensors for `plan.params` (and `plan.layers` / `plan.hidden` when given).

    With a depth, the parameters are split into `layers` equal blocks, after setting aside
    the embedding and output head (2 x vocab x hidden) when vocab and width are known; the
    blocks are the FSDP, pipeline and tensor-parallel units. Without a depth, the model is one
    unit: totals are right, but per-layer figures (gather buffers, tp, pp) are not available."""
    params = plan.get("params")
    layers, hidden = plan.get("layers"), plan.get("hidden")
    seq, heads, vocab = plan.get("seq_len"), plan.get("heads"), plan.get("vocab_size")
    for key, value in (("params", params), ("layers", layers), ("hidden", hidden), ("seq_len", seq),
                       ("heads", heads), ("vocab_size", vocab)):
        if value is not None and not value > 0:
            raise UserError(f"plan.{key}={value}: expected a positive number")
    if params is None:
        if not (layers and hidden):
            raise UserError("plan.* what-if keys need plan.params, or plan.layers and plan.hidden to estimate it")
        # A SwiGLU transformer block: 4 h^2 attention + 3 h f feed-forward, f ~ 8/3 h.
        params = layers * (4 * hidden * hidden + 3 * hidden * ffn_hidden_size(hidden, 0)) + 2 * (vocab or 0) * hidden
    params = int(params)
    ends = 2 * vocab * hidden if (vocab and hidden) else 0
    tensors: tuple[ParamTensor, ...]
    units: tuple[tuple[str, bool], ...]
    if not layers:
        tensors = (ParamTensor("model", (params,), "model", True, 0, True),)
        units = (("model", True),)
    else:
        if ends >= params:
            ends = 0
        per_block = (params - ends) // layers
        rest = params - ends - per_block * layers  # rounding, kept so the total is exact
        tensors_l = [ParamTensor(f"layers.{i}", (per_block + (rest if i == 0 else 0),), f"layers.{i}", True, 0, True)
                     for i in range(layers)]
        units_l = [(f"layers.{i}", True) for i in range(layers)]
        if ends:
            tensors_l = [ParamTensor("embeddings", (ends // 2,), "embeddings", False, 0),
                         *tensors_l, ParamTensor("output", (ends - ends // 2,), "output", False, 0, True)]
            units_l = [("embeddings", False), *units_l, ("output", False)]
        tensors, units = tuple(tensors_l), tuple(units_l)
    return ModelShape(
        tensors=tensors, units=units, source="what-if (plan.params)", exact=False,
        layers=layers, hidden=hidden, heads=heads, seq_len=seq, vocab=vocab,
        ffn_hidden=ffn_hidden_size(hidden, 0) if hidden else None,
    )


def shape_from_counted(record: dict[str, Any]) -> ModelShape:
    """A ModelShape from the JSON that dtk.plan.count_model prints for a user model."""
    tensors = tuple(
        ParamTensor(t["name"], tuple(t["shape"]), t["unit"], t["block"], t["tp_dim"], t["matmul"], t["embedding"])
        for t in record["tensors"]
    )
    return ModelShape(
        tensors=tensors, units=tuple((u, b) for u, b in record["units"]), source=record["source"], exact=True,
        layers=record.get("layers"), hidden=record.get("hidden"), heads=record.get("heads"),
        seq_len=record.get("seq_len"), vocab=record.get("vocab"), ffn_hidden=record.get("ffn_hidden"),
        modules=tuple(tuple(m) for m in record.get("modules", ())),
        wrap_classes=tuple(record["wrap_classes"]) if record.get("wrap_classes") else None,
        tp_plan=dict(record["tp_plan"]) if record.get("tp_plan") else None,
    )
