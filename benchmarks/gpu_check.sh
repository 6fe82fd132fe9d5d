#!/usr/bin/env bash
# The one command that checks dtk on a GPU node, in under 8 minutes:
#
#   bash benchmarks/gpu_check.sh [RUN_ROOT]
#
# Blocks, in order (each a function below; the figures come from benchmarks/gpu_check.py):
#   device       the GPU, its entry in dtk.plan.accelerators (H200 NVL told apart from SXM)
#   throughput   python -m dtk.submit on one GPU: FSDP2 + bf16 + torch.compile per block on a
#                ~1.04B-parameter built-in transformer, with its final (async) checkpoint:
#                tokens/s, TFLOP/s, MFU (FLOPs convention printed), peak memory against
#                python -m dtk.plan's prediction, checkpoint blocking time and save throughput
#   syncs        host-device syncs per step of dtk's loop (CUDA's sync debug mode)
#   equivalence  a small model trained 12 steps in fp32 as ddp, fsdp and tp=1 on one GPU: the
#                losses agree; with more GPUs, fsdp and tp across all of them as well
#
# First a preflight (dtk's dependencies, a C compiler and Python.h for Triton, the GPU, a tiny
# compiled kernel on it): each missing piece one `error:` line, exit 2, nothing run. Knobs (environment): MICRO (sequences
# per forward, default 4), ACCUM (default 2), STEPS (default 40; the first 10 are warm-up),
# AC (none, selective, full), PEAK_TFLOPS (the dense peak, for a GPU not in dtk's accelerator
# table: passed as cluster.peak_tflops). Needs about 35 GiB of GPU memory with the defaults.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}

fail() { echo "error: $*" >&2; exit 2; }

# Preflight, in seconds: every piece the runs below need, each missing one an `error:` line
# of its own (all of them, not the first only), then exit 2 with nothing run or written.
MISSING=()
missing() { MISSING+=("$*"); }
preflight() {
    if ! command -v "$PYTHON" >/dev/null 2>&1; then
        missing "gpu_check needs Python: PYTHON=$PYTHON is not on PATH"
        return 0
    fi
    # dtk's own dependencies and Python.h (benchmarks/gpu_preflight.py), with the Python that runs dtk.
    local line said
    said=$(timeout 60 "$PYTHON" benchmarks/gpu_preflight.py 2>/dev/null) \
        || said="gpu_check needs dtk's dependencies to import: $PYTHON benchmarks/gpu_preflight.py failed (exit code $?)"
    while IFS= read -r line; do
        if [ -n "$line" ]; then missing "$line"; fi
    done <<< "$said"
    # torch.compile's GPU kernels are built by Triton, which compiles a small C launcher
    # with $CC (else clang or gcc) against the Python headers checked above.
    if [ -n "${CC:-}" ]; then
        command -v "$CC" >/dev/null 2>&1 || missing "gpu_check needs a C compiler for Triton (torch.compile): CC=$CC is not on PATH"
    elif ! command -v clang >/dev/null 2>&1 && ! command -v gcc >/dev/null 2>&1; then
        missing "gpu_check needs a C compiler for Triton (torch.compile): neither gcc nor clang is on PATH (install gcc, or set CC)"
    fi
    # The GPU, as the driver and as torch see it, then a tiny compiled kernel on it.
    if ! command -v nvidia-smi >/dev/null 2>&1; then
        missing "gpu_check needs an NVIDIA GPU: nvidia-smi is not on PATH (no GPU or no driver on this machine)"
        return 0
    fi
    local listed
    listed=$(nvidia-smi -L 2>/dev/null || true)  # captured, not piped into grep -q: pipefail and SIGPIPE
    if [[ $listed != *GPU* ]]; then
        missing "gpu_check needs an NVIDIA GPU: nvidia-smi lists none"
        return 0
    fi
    if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
        missing "gpu_check needs a CUDA build of torch that sees the GPU: torch.cuda.is_available() is False"
        return 0
    fi
    [ ${#MISSING[@]} -eq 0 ] || return 0  # a compile cannot work without the pieces above
    said=$(timeout 120 "$PYTHON" -c "
import torch
f = torch.compile(lambda x: torch.nn.functional.gelu(x) * 2 + 1)
x = torch.randn(64, device='cuda')
assert torch.allclose(f(x), torch.nn.functional.gelu(x) * 2 + 1, atol=1e-5)
" 2>&1) || missing "gpu_check needs torch.compile to work on the GPU: a tiny compiled kernel failed ($(printf '%s' "$said" | grep -v '^ ' | tail -1))"
}
preflight
if [ ${#MISSING[@]} -gt 0 ]; then
    for line in "${MISSING[@]}"; do echo "error: $line" >&2; done
    exit 2
fi

ROOT=${1:-$(mktemp -d /tmp/dtk-gpu-check.XXXXXX)}
MICRO=${MICRO:-4}
ACCUM=${ACCUM:-2}
STEPS=${STEPS:-40}
AC=${AC:-none}
NUM_GPUS=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
START=$(date +%s)
DEADLINE=$((START + 470))  # 8 minutes less a margin for the last block's report
left() { echo $((DEADLINE - $(date +%s))); }
report() { "$PYTHON" benchmarks/gpu_check.py "$@"; }

block_device() {
    echo "== device"
    report device
}

block_throughput() {
    echo "== throughput (one GPU, fsdp + bf16 + compile, ~1.04B parameters)"
    # dim 2048, 18 blocks, 16 heads, vocab 32000: 0.91B in the blocks + 0.13B embeddings/head.
    local job=(+scheme=fsdp tasks_per_node=1 dist.backend=nccl dist.device=cuda
        scheme.compile=true scheme.param_dtype=bfloat16 scheme.reduce_dtype=float32 scheme.activation_checkpoint="$AC"
        model.dim=2048 model.num_layers=18 model.num_heads=16 model.vocab_size=32000 model.seq_len=2048
        train.global_batch=$((MICRO * ACCUM)) train.micro_batch="$MICRO" train.steps="$STEPS" train.log_every=10
        optim.warmup_steps=5 checkpoint.every=0 data.num_samples=1024 run.root="$ROOT" run.name=throughput
        fault.max_restarts=0
        ${PEAK_TFLOPS:+cluster.peak_tflops=$PEAK_TFLOPS})
    "$PYTHON" -m dtk.plan --json "${job[@]}" > "$ROOT/throughput-plan.json" 2>/dev/null || rm -f "$ROOT/throughput-plan.json"
    local t0; t0=$(date +%s)
    timeout 300 "$PYTHON" -m dtk.submit "${job[@]}" > "$ROOT/throughput.log" 2>&1 \
        || fail "the throughput run failed or ran past 300 s; see $ROOT/throughput.log and $ROOT/throughput/logs"
    echo "wall time       $(( $(date +%s) - t0 )) s (start, compile, $STEPS steps, final checkpoint)"
    report throughput "$ROOT/throughput" "$ROOT/throughput-plan.json"
}

block_syncs() {
    echo "== host syncs"
    timeout 120 "$PYTHON" benchmarks/gpu_check.py syncs || fail "the host-sync check failed or ran past 120 s"
}

small_run() {  # NAME WORKERS OVERRIDES...: a 12-step fp32 run of a small model (TF32 off: schemes compare exactly)
    local name=$1 workers=$2; shift 2
    timeout "$(( $(left) > 30 ? $(left) : 30 ))" "$PYTHON" -m dtk.submit tasks_per_node="$workers" dist.device=cuda \
        scheme.param_dtype=float32 scheme.matmul_precision=highest model.dim=256 model.num_layers=4 model.num_heads=8 model.vocab_size=4096 \
        model.seq_len=256 train.global_batch=16 train.micro_batch=2 train.steps=12 train.log_every=4 \
        optim.warmup_steps=2 checkpoint.every=0 data.num_samples=512 fault.max_restarts=0 "$@" run.root="$ROOT" \
        run.name="$name" \
        > "$ROOT/$name.log" 2>&1 || fail "the $name run failed; see $ROOT/$name.log"
}

block_equivalence() {
    echo "== equivalence (losses per step against ddp on one GPU)"
    small_run ddp_1 1 +scheme=ddp
    small_run fsdp_1 1 +scheme=fsdp
    small_run tp1_1 1 +scheme=tp scheme.tp=1
    local runs=("$ROOT/fsdp_1" "$ROOT/tp1_1")
    # Across the node's GPUs: the largest power of two up to 8 that they hold, which divides
    # the batch (16 = 8 ranks x 2), the heads (8) and the vocabulary.
    local n=1
    while [ $((n * 2)) -le "$NUM_GPUS" ] && [ $((n * 2)) -le 8 ]; do n=$((n * 2)); done
    if [ "$n" -gt 1 ]; then
        small_run "fsdp_$n" "$n" +scheme=fsdp
        small_run "tp_$n" "$n" +scheme=tp scheme.tp="$n"
        runs+=("$ROOT/fsdp_$n" "$ROOT/tp_$n")
    fi
    report equivalence "$ROOT/ddp_1" "${runs[@]}" || fail "losses differ between schemes (above)"
}

echo "gpu_check: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1) x $NUM_GPUS; run root $ROOT"
block_device
block_throughput
block_syncs
block_equivalence
echo "gpu_check: done in $(( $(date +%s) - START )) s"
