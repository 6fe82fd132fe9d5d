"""Activation memory of the built-in transformer (and of models with its shape), per rank.

Counted from what autograd really keeps, op by op, for one micro-batch of b samples of
s tokens, width h, feed-forward width f, H heads, vocabulary V, activations of a bytes
(4 in fp32, 2 in bf16). Per block:

    checkpointing  kept for backward                                       elements
    none           2 norms: input, x*rstd, output (CPU; the fused CUDA      10 bsh + 4 bsf
                   kernel keeps input and output: 2 each), q k v and the    (CUDA: 8 bsh + 4 bsf)
                   attention output (4 bsh), w1, w3, silu and product (4 bsf)  + 2 bs rstd + H b s lse (fp32)
    selective      block input, matmul outputs q k v wo w2 (5 bsh), w1 w3   7 bsh + 2 bsf + lse
                   (2 bsf), attention output (bsh); norms and silu recomputed
    full           block input                                               bsh

Outside the blocks: the final norm (3 bsh), log-softmax of the logits (bsV, fp32), the
logits the training loop holds until backward ends (bsV in a bytes), token positions; under
tp the last two are split over the vocabulary (the loss is vocabulary-parallel there).
Tensor parallelism divides the head and feed-forward parts by tp; sequence parallelism
also the norms and residual stream, and adds the gathered block inputs.
Context parallelism (scheme.cp) gives a rank s = seq_len / cp tokens of each sample, and
its attention keeps the keys and values of the other cp - 1 ranks' tokens (2 (cp - 1) bsh / tp).

Pipelines keep several micro-batches in flight on a rank: GPipe all n of them, 1F1B
min(n, pp - stage), interleaved 1F1B its warm-up plus one (per chunk of stages), as
torch.distributed.pipelining schedules them. A non-first stage's input lives in a receive
buffer from its receive to its backward (counted under buffers, recv_buffer_bytes); a
non-last stage keeps each in-flight output for its backward; the last stage computes each
micro-batch's loss inside the schedule, vocabulary-parallel under tp, and keeps the loss's
log-softmax of the micro-batches in flight there (last_stage_head_bytes).

Backward adds a working set: the loss gradient (bsV, fp32, twice) and, with
checkpointing, one block recomputed at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtk.plan.shape import ModelShape

LOSS_BYTES = 4  # log-softmax and the loss run in fp32 (dtk.train.loss.TokenCrossEntropy)


@dataclass(frozen=True)
class Dims:
    b: int
    s: int
    h: int
    f: int
    heads: int
    vocab: int
    a: int
    """Bytes per activation element."""
    tp: int = 1
    sp: bool = False
    fused_norm: bool = False
    """CUDA's fused rms_norm keeps input and rstd only (CPU decomposes it and keeps x*rstd too)."""
    cp: int = 1
    """Context parallelism: `s` is this rank's tokens (seq_len / cp); attention keeps the keys
    and values gathered from the other cp - 1 ranks for its backward (dtk.parallel.cp)."""

    @property
    def bsh(self) -> int:
        return self.b * self.s * self.h

    @property
    def bsf(self) -> int:
        return self.b * self.s * self.f


def block_bytes(d: Dims, ac: str) -> int:
    """Bytes one block keeps for backward, for one micro-batch."""
    t = d.tp
    seq = t if d.sp else 1  # sequence-parallel regions hold 1/tp of the sequence
    lse = 4 * d.b * (d.heads // t if d.heads else 0) * d.s
    if ac == "full":
        return d.a * d.bsh // seq
    # saved for attention's backward: its log-sum-exp (fp32) and, under context parallelism,
    # the keys and values gathered from the other cp - 1 ranks
    lse += d.a * 2 * (d.cp - 1) * d.bsh // t
    if ac == "selective":
        # block input, q k v and attention output, the wo and w2 matmul outputs (partial sums
        # of full size under tp), w1 and w3 outputs
        kept = d.bsh // seq + 4 * d.bsh // t + 2 * d.bsh + 2 * d.bsf // t
        if t > 1:  # collective outputs are kept too
            kept += (2 * d.bsh // t + 2 * d.bsh) if d.sp else 2 * d.bsh
        return d.a * kept + lse
    norm = 2 if d.fused_norm else 3
    kept = 2 * norm * d.bsh // seq + 4 * d.bsh // t + 4 * d.bsf // t
    if d.sp:
        kept += 2 * d.bsh  # the gathered inputs of attention and MLP
    return d.a * kept + 4 * 2 * d.b * d.s // seq + lse


def head_bytes(d: Dims) -> int:
    """The final norm and the loss of one micro-batch (not the logits, see logits_bytes)."""
    norm = 2 if d.fused_norm else 3
    seq = d.tp if d.sp else 1
    gathered = d.bsh if d.sp else 0  # the output head gathers its input from sequence shards
    return d.a * (norm * d.bsh // seq + gathered) + 4 * d.b * d.s // seq + LOSS_BYTES * d.b * d.s * d.vocab


def logits_bytes(d: Dims) -> int:
    return d.a * d.b * d.s * d.vocab


def embed_bytes(d: Dims) -> int:
    """Token positions (int64) made in each forward."""
    return 8 * d.s


PIPELINE_LOSS_PER_MICRO_BATCH = True
"""Whether a pipeline's last stage computes the loss of each micro-batch inside the schedule
and keeps no logits once its backward is done, the loss vocabulary-parallel over tp: what
dtk.parallel.pipeline does (tests/test_pipeline_memory.py). False budgets the runtime
before it, whose schedule returned every micro-batch's logits to a loss at the step's end."""
PIPELINE_RECV_IN_FLIGHT = True
"""Whether a pipeline stage's receive buffers live from their receive to their backward
(dtk.parallel.pipeline's FreeingStage), so a rank holds those of its micro-batches in
flight; False: one of each per micro-batch for the whole step, as before it."""


LOSS_CHUNK_ELEMENTS = 2**26
"""dtk.train.loss.LOSS_CHUNK_ELEMENTS (tests/test_plan_pipeline_loss.py holds them equal):
plain low-precision logits larger than this are cast to fp32 and reduced this many elements
at a time, each chunk recomputed in backward, so no whole fp32 log-softmax is kept."""


def chunked_loss(d: Dims) -> bool:
    """Whether the loss casts the logits chunk by chunk (dtk.train.loss.TokenCrossEntropy):
    plain (not vocabulary-sharded) logits in a low-precision dtype, larger than one chunk."""
    return d.tp == 1 and d.a < LOSS_BYTES and d.b * d.s * d.vocab > LOSS_CHUNK_ELEMENTS


def log_softmax_bytes(d: Dims) -> int:
    """The loss's fp32 log-softmax of one micro-batch, kept for backward: split over tp (the
    loss is vocabulary-parallel, torch's loss_parallel, dtk.parallel.parallelize), none when
    the loss is chunked (recomputed chunk by chunk in backward)."""
    return 0 if chunked_loss(d) else LOSS_BYTES * d.b * d.s * d.vocab // d.tp


def last_stage_head_bytes(d: Dims, *, ends: int, num_micro: int, pp: int, per_micro_batch: bool) -> int:
    """What the model's last stage keeps outside its blocks for the `ends` micro-batches in
    flight there (1 under 1F1B and without a pipeline, all of them under GPipe): their final
    norm and the loss's fp32 log-softmax (log_softmax_bytes), and one micro-batch's logits.
    Under tp the head's logits stay sharded over the vocabulary and the loss runs on the
    shards, with or without a pipeline: both are split over tp. The pipeline runtime before
    the loss per micro-batch (per_micro_batch false) gathered every micro-batch's logits
    until the step ended."""
    norms = head_bytes(d) - LOSS_BYTES * d.b * d.s * d.vocab
    if pp > 1 and not per_micro_batch:
        return ends * head_bytes(d) + num_micro * logits_bytes(d)
    return ends * (norms + log_softmax_bytes(d)) + logits_bytes(d) // d.tp


def recv_buffer_bytes(per: int, *, chunks: int, stages: int, first: bool, last: bool, num_micro: int) -> int:
    """Receive buffers of a pipeline rank holding `stages` stages, `chunks` (stage x
    micro-batch) in flight at its peak, `per` bytes each: the input of each chunk in flight
    of a stage that is not the model's first, and the gradient from the next stage of each
    stage that is not the model's last, one at a time (received right before its backward).
    Without PIPELINE_RECV_IN_FLIGHT, both for every micro-batch."""
    inputs, grads = stages - (1 if first else 0), stages - (1 if last else 0)
    if not PIPELINE_RECV_IN_FLIGHT:
        return num_micro * per * (inputs + grads)
    return per * (-(-chunks * inputs // stages) + grads)


def last_stage_working_bytes(d: Dims, ac: str, *, pp: int, per_micro_batch: bool) -> int:
    """Backward's largest transient on the last stage: the loss gradient, or one block
    recomputed. The loss gradient is the fp32 gradient of the log-softmax and of the logits'
    fp32 cast; vocabulary-parallel under tp (except under the pipeline runtime before the loss
    per micro-batch), three fp32 shards; a chunked loss holds the logits' gradient in their
    dtype and one chunk's fp32 cast, log-softmax and gradient."""
    if chunked_loss(d):
        loss = d.a * d.b * d.s * d.vocab + 3 * LOSS_BYTES * LOSS_CHUNK_ELEMENTS
    elif d.tp > 1 and (pp == 1 or per_micro_batch):
        # torch's loss_parallel backward (_nll_loss_and_log_softmax_backward) holds three fp32
        # shards at once: the one-hot gradient, exp of the log-softmax and their sum (measured
        # on CPU gloo ranks, docs/benchmarks.md)
        loss = 3 * LOSS_BYTES * d.b * d.s * d.vocab // d.tp
    else:
        loss = 2 * LOSS_BYTES * d.b * d.s * d.vocab
    recompute = block_bytes(d, "none") - block_bytes(d, ac) if ac != "none" else 0
    return max(loss, recompute)


def in_flight(schedule: str, *, pp: int, pp_index: int, num_micro: int, virtual: int) -> int:
    """Forward chunks a pipeline rank holds at its peak (one chunk = one stage x one micro-batch)."""
    if pp == 1:
        return 1
    if schedule == "gpipe":
        return num_micro
    if schedule == "1f1b":
        return min(num_micro, pp - pp_index)
    rounds = max(1, num_micro // pp)
    per_round = num_micro // rounds
    warmup = min((virtual - 1) * per_round + 2 * (pp - 1 - pp_index), num_micro * virtual)
    return min(num_micro * virtual, warmup + 1)


@dataclass(frozen=True)
class Activations:
    saved: int
    """Kept for backward at the rank's peak, plus the logits the loop holds: what a step measures."""
    working: int
    """Backward's largest transient on top of it."""

    @property
    def total(self) -> int:
        return self.saved + self.working


def rank_activations(
    shape: ModelShape, d: Dims, ac: str, *, blocks_per_part: list[int], first: bool, last: bool,
    schedule: str = "1f1b", pp: int = 1, pp_index: int = 0, num_micro: int = 1, virtual: int = 1,
) -> Activations:
    """Activations of one rank holding `blocks_per_part` blocks in each of its model parts."""
    per_block = block_bytes(d, ac)
    chunks = in_flight(schedule, pp=pp, pp_index=pp_index, num_micro=num_micro, virtual=virtual)
    blocks = sum(blocks_per_part) / max(1, len(blocks_per_part))  # per chunk, on average
    per_chunk = blocks * per_block
    if pp > 1:
        # A stage's input arrives in a receive buffer allocated once (buffers); a stage's
        # output waits in the stage for its backward unless it is the model's output.
        edge = d.a * d.bsh // (d.tp if d.sp else 1)
        if not (first and virtual == 1):
            per_chunk -= edge
        if not (last and virtual == 1):
            per_chunk += edge
    saved = int(chunks * per_chunk)
    ends = max(1, chunks // virtual)  # chunks of the first / last stage in flight
    if first:
        saved += ends * embed_bytes(d)
    if last:
        saved += last_stage_head_bytes(d, ends=ends, num_micro=num_micro, pp=pp,
                                       per_micro_batch=PIPELINE_LOSS_PER_MICRO_BATCH)
    working = last_stage_working_bytes(d, ac, pp=pp, per_micro_batch=PIPELINE_LOSS_PER_MICRO_BATCH)
    return Activations(saved=saved, working=working if last else 0)
