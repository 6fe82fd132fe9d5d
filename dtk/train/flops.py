"""Model FLOPs per token, achieved TFLOP/s and MFU.

MFU (model FLOPs utilisation) = the FLOPs the model needs per second at the measured
throughput / the device's dense peak for the dtype the matmuls run in. It counts the
model's arithmetic, not what the hardware did (activation recomputation is not credited),
so schemes and recipes compare on the same footing.

Per token, a training step (forward + backward) costs 6 FLOPs per matmul weight (2 in
forward, 4 in backward) plus attention's QK^T and AV, 12 * layers * dim * seq (the full
square, the convention of the PaLM paper and of torch's FLOP counter). The built-in
transformer gets that formula; a user model is counted once by `torch.utils.flop_counter`
on a meta-device copy (shapes only, no memory, no data), one sequence forward and backward.
"""

from __future__ import annotations

import torch

from dtk.config.convert import builtin_transformer
from dtk.config.schema import ModelConfig, TransformerConfig
from dtk.plan.shape import ffn_hidden_size

BUILTIN_TARGET = TransformerConfig._target_


def transformer_flops_per_token(*, vocab_size: int, dim: int, num_layers: int, ffn_hidden: int, seq_len: int,
                                num_experts: int = 0, top_k: int = 1) -> float:
    hidden = ffn_hidden_size(dim, ffn_hidden)
    # q, k, v, o projections and the three SwiGLU matrices per block, and the output head;
    # the embeddings are lookups, the norms elementwise. A mixture of experts: the router,
    # and the SwiGLU matrices of the top_k experts a token goes to (active, not total).
    mlp = 3 * dim * hidden * (top_k if num_experts else 1) + dim * num_experts
    matmul_weights = num_layers * (4 * dim * dim + mlp) + vocab_size * dim
    return float(6 * matmul_weights + 12 * num_layers * dim * seq_len)


def counted_flops_per_token(build, seq_len: int, vocab_size: int) -> float:
    """FLOPs of one forward and backward of one sequence, counted on the meta device, per token."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = build()
        tokens = torch.randint(0, vocab_size, (1, seq_len))
    counter = FlopCounterMode(display=False)
    with counter:
        out = model(tokens)
        out.float().sum().backward()
    return counter.get_total_flops() / seq_len


def flops_per_token(model_cfg: ModelConfig) -> float | None:
    """Analytic for the built-in transformer; counted for a user model that takes token ids
    of shape (batch, model.seq_len). None when neither applies (the report then shows
    throughput without MFU)."""
    transformer = builtin_transformer(model_cfg)
    if transformer is not None and model_cfg._target_ == BUILTIN_TARGET:
        return transformer_flops_per_token(
            vocab_size=transformer.vocab_size, dim=transformer.dim, num_layers=transformer.num_layers,
            ffn_hidden=transformer.ffn_hidden, seq_len=transformer.seq_len,
            num_experts=transformer.num_experts, top_k=transformer.top_k,
        )
    seq_len, vocab = model_cfg.seq_len, model_cfg.vocab_size
    if not seq_len or not vocab:
        return None
    from dtk.models.build import build_model

    try:
        with torch.random.fork_rng(devices=[]):  # build_model seeds the global generator
            return counted_flops_per_token(lambda: build_model(model_cfg, device="meta", seed=0), seq_len, vocab)
    except Exception:  # a model the counter cannot trace on meta: throughput still logged, no MFU
        return None


def achieved(*, tokens_per_s: float, flops_per_token: float, num_devices: int, peak_tflops: float | None) -> dict[str, float]:
    """Per-device achieved TFLOP/s, and MFU where the peak is known."""
    tflops = tokens_per_s * flops_per_token / num_devices / 1e12
    out = {"tflops": round(tflops, 4)}
    if peak_tflops:
        out["mfu"] = round(tflops / peak_tflops, 5)
    return out


def matmul_dtype_name(dtype: torch.dtype) -> str:
    """The peak's dtype column for matmuls in `dtype` (float32 on tensor cores when TF32 is allowed)."""
    if dtype == torch.bfloat16:
        return "bfloat16"
    if dtype == torch.float16:
        return "float16"
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "float32"


def peak_tflops(
    *, override: float | None, accelerator: str | None, device: torch.device, dtype: torch.dtype
) -> tuple[float | None, str]:
    """Dense peak TFLOP/s of one device for matmuls in `dtype`, and where it comes from:
    cluster.peak_tflops, else the accelerator table's row of cluster.accelerator, else of
    the GPU's name. None on the CPU or for a GPU the table does not know (the run then logs
    TFLOP/s without MFU)."""
    from dtk.plan.accelerators import ACCELERATORS, accelerator_of, lookup

    if override:
        return float(override), "cluster.peak_tflops"
    if device.type != "cuda":
        return None, "no peak on the CPU"
    column = matmul_dtype_name(dtype)
    if accelerator:
        row = lookup(accelerator)
        return row.peak_tflops(column), f"cluster.accelerator={row.name} dense {column}"
    device_name = torch.cuda.get_device_name(device)
    name = accelerator_of(device_name)
    if name is None:
        return None, f"{device_name} is not in the accelerator table; set cluster.accelerator or cluster.peak_tflops"
    return ACCELERATORS[name].peak_tflops(column), f"{name} dense {column}"
