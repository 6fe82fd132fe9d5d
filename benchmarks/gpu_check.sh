#!/usr/bin/env bash
# One GPU, the real path: python -m dtk.submit with an NCCL world of 1, FSDP2 (fully_shard
# on a one-rank mesh) + bf16 parameters (fp32 reduction and master weights) + torch.compile
# per block, on a ~1.04B-parameter configuration of the built-in transformer.
# Prints tokens/s, achieved TFLOP/s and MFU as the run's metrics.jsonl logged them (the code
# path of every run: dtk.train.flops), and peak memory.
#
#   bash benchmarks/gpu_check.sh [RUN_ROOT]
#
# Knobs (environment): MICRO (sequences per forward, default 4), ACCUM (micro-batches per
# step, default 2), STEPS (default 40; the first 10 are warm-up and compile), AC (none,
# selective or full; default none), PEAK_TFLOPS (the GPU's dense bf16 peak, when its name
# is not in dtk's accelerator table: passed as cluster.peak_tflops). Needs about 35 GiB of
# GPU memory with the defaults and finishes in well under 6 minutes on an H100 (the final
# checkpoint, 12.5 GB, included).
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}

fail() { echo "error: $*" >&2; exit 2; }

command -v nvidia-smi >/dev/null 2>&1 || fail "gpu_check needs an NVIDIA GPU: nvidia-smi is not on PATH (no GPU or no driver on this machine)"
nvidia-smi -L 2>/dev/null | grep -q "GPU" || fail "gpu_check needs an NVIDIA GPU: nvidia-smi lists none"
"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || fail "gpu_check needs a CUDA build of torch that sees the GPU: torch.cuda.is_available() is False"

ROOT=${1:-$(mktemp -d /tmp/dtk-gpu-check.XXXXXX)}
MICRO=${MICRO:-4}
ACCUM=${ACCUM:-2}
STEPS=${STEPS:-40}
AC=${AC:-none}
SEQ=2048
# dim 2048, 18 blocks, 16 heads, vocab 32000: 0.91B in the blocks + 0.13B embeddings/head.
MODEL=(model.dim=2048 model.num_layers=18 model.num_heads=16 model.vocab_size=32000 model.seq_len=$SEQ)

echo "gpu_check: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1); run root $ROOT"
start=$(date +%s)
timeout 340 "$PYTHON" -m dtk.submit \
    +scheme=fsdp tasks_per_node=1 dist.backend=nccl dist.device=cuda \
    scheme.compile=true scheme.param_dtype=bfloat16 scheme.reduce_dtype=float32 \
    scheme.activation_checkpoint="$AC" \
    "${MODEL[@]}" \
    train.global_batch=$((MICRO * ACCUM)) train.micro_batch="$MICRO" train.steps="$STEPS" train.log_every=10 \
    optim.warmup_steps=5 checkpoint.every=0 data.num_samples=1024 \
    ${PEAK_TFLOPS:+cluster.peak_tflops=$PEAK_TFLOPS} \
    run.root="$ROOT" run.name=gpu-check \
    || fail "the training run failed or ran past 340 s; its logs are in $ROOT/gpu-check/logs"
echo "gpu_check: wall time $(( $(date +%s) - start )) s"

RUN="$ROOT/gpu-check" SEQ=$SEQ "$PYTHON" - <<'EOF'
import json, os, statistics, sys
from pathlib import Path

import torch

sys.path.insert(0, os.getcwd())
from dtk.models.transformer import ffn_hidden_size

run = Path(os.environ["RUN"])
records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
summary = json.loads((run / "summary.json").read_text())
warm = [r for r in records if r["step"] > 10] or records[len(records) // 2 :]
tokens_per_s = statistics.median(r["tokens_per_s"] for r in warm)

dim, layers, vocab, seq = 2048, 18, 32000, int(os.environ["SEQ"])
hidden = ffn_hidden_size(dim, 0)
params = layers * (4 * dim * dim + 3 * dim * hidden + 2 * dim) + 2 * vocab * dim + seq * dim + dim
# TFLOP/s and MFU as the worker logged them (dtk.train.flops: the analytic FLOPs per token,
# the dense peak of the matmul dtype from cluster.peak_tflops or the accelerator table).
flops_per_token = summary["flops_per_token"]
tflops = statistics.median(r["tflops"] for r in warm)
mfus = [r["mfu"] for r in warm if "mfu" in r]
name = torch.cuda.get_device_name(0)
print(f"device          {name}")
print(f"model           {params / 1e9:.2f}B parameters, seq {seq}, {flops_per_token / 1e9:.2f} GFLOP per token")
print(f"steps           {len(records)} (median over steps {warm[0]['step']}-{warm[-1]['step']})")
print(f"tokens/s        {tokens_per_s:,.0f}")
print(f"TFLOP/s         {tflops:.1f}")
if mfus:
    print(f"MFU             {100 * statistics.median(mfus):.1f}% of {summary['peak_tflops']:.1f} TFLOP/s dense peak")
else:
    print("MFU             unknown: this GPU is not in dtk's accelerator table; set PEAK_TFLOPS")
print(f"peak memory     {summary.get('peak_memory_gib')} GiB (torch.cuda.max_memory_allocated)")
print(f"final loss      {summary.get('final_loss')}")
EOF
