"""Hugging Face causal language models (Llama, Qwen2, Mistral and their kin) by config alone.

    model=hf model.config=DIR       a local config.json: the architecture, random weights
    model=hf model.init_from=DIR    config.json and safetensors weights (one file, or shards
                                    with model.safetensors.index.json)

The model is transformers' own class (`AutoModelForCausalLM.from_config`), built on the
meta device like every dtk model, with transformers' parameter names, so a checkpoint
exports to a folder `from_pretrained` loads. Three things make it a dtk model:

- its forward returns the logits tensor (a forward hook takes `.logits` from the output),
  so next-token training, evaluation and tensor parallelism treat it like the built-in
  transformer;
- `reset_parameter(name, full, generator)` fills one full tensor at a time: from the
  safetensors file that holds it (memory-mapped, so no rank ever reads the whole model),
  or, for random weights, with transformers' own `_init_weights` applied to a copy of the
  owning module whose tensors are CPU tensors, under a seed drawn from (train.seed, name);
  every scheme starts from the same values;
- `dtk_wrap_classes` and `dtk_tp_plan` say how to parallelize it, read from the model: its
  decoder-layer class (`_no_split_modules`) and its tensor-parallel plan (`_tp_plan`, or the
  config's `base_model_tp_plan`), in dtk's style names. The yaml's `wrap_classes` and
  `tp_plan`, when given, replace them.

`tie_word_embeddings` needs nothing here: transformers ties `lm_head.weight` to the input
embedding when it builds the model, and dtk keeps ties found by identity through the meta
build (dtk.models.ties).

Pipeline parallelism is not offered: transformers' forward does not skip the modules a
stage does not hold.

Context parallelism (scheme.cp, dtk.parallel.cp): the root and every attention module carry
an attribute `cp`; once dtk sets it, the forward gets the full sequence's `position_ids` of
this rank's tokens (RoPE at the true positions) and attention runs through CP_ATTENTION,
transformers' attention interface for the cp layout's attention over gathered keys and
values (grouped-query heads included); its mask interface makes no mask (the layout masks
by positions).
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dtk.common.errors import UserError
from dtk.config.schema import HfModelConfig

# transformers' tensor-parallel style names -> dtk's (dtk.parallel.tp). Others have no
# equivalent here; a model using them needs model.tp_plan in its yaml.
HF_TP_STYLES = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "embedding_rowwise": "rowwise",
    "colwise_rep": "colwise_output",
    "colwise_gather_output": "colwise_output",
}
SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def hf_config(*, config: str | None, init_from: str | None, overrides: dict[str, Any] | None = None):
    """transformers' config from a local folder (no network): `config`, else `init_from`."""
    from transformers import AutoConfig

    folder = config or init_from
    key = "model.config" if config else "model.init_from"
    if not folder:
        raise UserError("model=hf needs model.config=DIR (a config.json) or model.init_from=DIR (config.json + safetensors)")
    if not (Path(folder).expanduser() / "config.json").is_file():
        raise UserError(f"{key}={folder}: no config.json in that folder; give a local folder holding a model's config.json")
    cfg = AutoConfig.from_pretrained(str(Path(folder).expanduser()), local_files_only=True, **(overrides or {}))
    cfg.use_cache = False  # training: no key/value cache
    return cfg


class SafetensorsWeights:
    """The tensors of a folder of safetensors files, read one at a time by name."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder).expanduser()
        index = self.folder / SAFETENSORS_INDEX
        if index.is_file():
            self.files = {name: self.folder / file for name, file in json.loads(index.read_text())["weight_map"].items()}
        elif (self.folder / SAFETENSORS).is_file():
            from safetensors import safe_open

            with safe_open(str(self.folder / SAFETENSORS), framework="pt") as f:
                self.files = {name: self.folder / SAFETENSORS for name in f.keys()}  # noqa: SIM118 (not a dict)
        else:
            raise UserError(
                f"model.init_from={folder}: no {SAFETENSORS} or {SAFETENSORS_INDEX} in that folder;"
                " give a folder saved by save_pretrained (or python -m dtk.checkpoint export --format hf)"
            )

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.files[name]), framework="pt", device="cpu") as f:
            return f.get_tensor(name)


def _shell(module: nn.Module, tensors: dict[str, torch.Tensor]) -> nn.Module:
    """A copy of `module` without children whose own parameters and buffers are `tensors`."""
    shell = copy.copy(module)
    shell._modules = {}
    # A parameter that is None (a Linear without bias) stays None: _init_weights asks for it.
    shell._parameters = {k: None if v is None else nn.Parameter(tensors[k], requires_grad=False) for k, v in module._parameters.items()}
    shell._buffers = {k: None if v is None else tensors[k] for k, v in module._buffers.items()}
    return shell


def _hf_init(model: nn.Module, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
    """transformers' own initialisation of the tensor `name`, into the CPU tensor `full`."""
    from transformers import PreTrainedModel, initialization

    assert isinstance(model, PreTrainedModel), "model=hf builds a transformers model"

    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    own = {**owner._parameters, **owner._buffers}
    tensors = {k: (full if k == leaf else torch.empty(v.shape, dtype=v.dtype)) for k, v in own.items() if v is not None}
    shell = _shell(owner, tensors)
    with torch.random.fork_rng(devices=[]), torch.no_grad(), initialization.guard_torch_init_functions():
        torch.manual_seed(generator.initial_seed())
        model._init_weights(shell)


def _reset_parameter(model: nn.Module, weights: SafetensorsWeights | None, name: str, full: torch.Tensor,
                     generator: torch.Generator) -> None:
    """dtk's per-tensor initialisation hook (see dtk.models.build.materialize)."""
    if weights is not None and name in weights:
        value = weights.get(name)
        if tuple(value.shape) != tuple(full.shape):
            raise UserError(
                f"model.init_from={weights.folder}: {name} has shape {tuple(value.shape)} there, the model"
                f" built from its config.json has {tuple(full.shape)}"
            )
        full.copy_(value)
        return
    is_buffer = any(n == name for n, _ in model.named_buffers())
    if weights is not None and not is_buffer:
        raise UserError(f"model.init_from={weights.folder}: no tensor {name} in its safetensors files")
    _hf_init(model, name, full, generator)


def parallel_defaults(model: nn.Module) -> tuple[tuple[str, ...], dict[str, str]]:
    """(wrap classes, tensor-parallel plan in dtk's styles) read from a transformers model."""
    wrap = tuple(sorted(getattr(model, "_no_split_modules", None) or ()))
    plan = dict(getattr(model, "_tp_plan", None) or {})
    if not plan:
        base = getattr(model.config, "base_model_tp_plan", None) or {}
        prefix = getattr(model, "base_model_prefix", "model")
        plan = {f"{prefix}.{k}": v for k, v in base.items()}
        if base and isinstance(getattr(model, "lm_head", None), nn.Linear):
            plan["lm_head"] = "colwise_output"
    converted = {}
    for pattern, style in plan.items():
        converted[pattern] = HF_TP_STYLES.get(style, f"unsupported:{style}")
    return wrap, converted


def _logits(_module: nn.Module, _args: Any, output: Any) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output[0]


CP_ATTENTION = "dtk_cp"
"""The attention implementation of a model under context parallelism (module doc)."""


def _cp_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Any, scaling: float | None = None, dropout: float = 0.0, **_: Any):
    """transformers' attention interface: (batch, seq, heads, head_dim) output and no weights."""
    if dropout:
        raise UserError(f"attention_dropout={dropout} (config.json) with scheme.cp: context-parallel attention has"
                        " no dropout yet; set attention_dropout to 0 or use scheme.cp=1")
    out = module.cp.attention(query, key, value, scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*_: Any, **__: Any) -> None:
    return None


@functools.cache
def _register_cp_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(CP_ATTENTION, _cp_attention)
    AttentionMaskInterface.register(CP_ATTENTION, _no_mask)


def _cp_inputs(model: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook: under context parallelism, this rank's positions and CP_ATTENTION."""
    layout = model.cp
    if layout is None:
        return None
    _register_cp_attention()
    if model.config._attn_implementation != CP_ATTENTION:
        model.config._attn_implementation = CP_ATTENTION
    tokens = args[0] if args else kwargs["input_ids"]
    return args, {**kwargs, "position_ids": layout.positions(tokens.shape[1], tokens.device)}


def build(
    *,
    config: str | None = None,
    init_from: str | None = None,
    seq_len: int,
    vocab_size: int | None = None,
    attn_implementation: str = HfModelConfig.attn_implementation,  # the schema's default, for direct callers
    config_overrides: dict[str, Any] | None = None,
) -> nn.Module:
    """The factory of conf/model/hf.yaml: a transformers causal LM under the current device
    (meta when dtk builds it for a job). `seq_len` is the data's sample length, `vocab_size`
    the data's number of token ids (at most the model's)."""
    from transformers import AutoModelForCausalLM

    cfg = hf_config(config=config, init_from=init_from, overrides=config_overrides)
    if vocab_size is not None and vocab_size > cfg.vocab_size:
        raise UserError(
            f"model.vocab_size={vocab_size}: the data's token ids must fit the model's vocabulary of"
            f" {cfg.vocab_size} (config.json); use model.vocab_size <= {cfg.vocab_size}"
        )
    if seq_len > getattr(cfg, "max_position_embeddings", seq_len):
        raise UserError(
            f"model.seq_len={seq_len} is longer than the model's max_position_embeddings={cfg.max_position_embeddings};"
            f" use model.seq_len <= {cfg.max_position_embeddings}"
        )
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation, dtype=torch.float32)
    weights = SafetensorsWeights(init_from) if init_from else None
    model.reset_parameter = functools.partial(_reset_parameter, model, weights)
    model.dtk_wrap_classes, model.dtk_tp_plan = parallel_defaults(model)
    model.register_forward_hook(_logits)
    for module in model.modules():  # context parallelism (module doc): dtk.parallel.cp sets them
        if module is model or type(module).__name__.endswith("Attention"):
            module.cp = None
    model.register_forward_pre_hook(_cp_inputs, with_kwargs=True)
    return model
