"""The pipeline's last stage and receive buffers, budgeted per micro-batch in flight
(dtk.plan.cost.activations), as dtk.parallel.pipeline runs them since it computes the loss per
micro-batch inside the schedule and frees each receive buffer after its backward
(tests/test_pipeline_memory.py); the budget of the runtime before it is kept beside."""

from __future__ import annotations

import dataclasses

from dtk.config.schema import SchemeConfig
from dtk.plan.cost.activations import (
    LOSS_BYTES,
    LOSS_CHUNK_ELEMENTS,
    Dims,
    chunked_loss,
    head_bytes,
    last_stage_head_bytes,
    last_stage_working_bytes,
    logits_bytes,
    recv_buffer_bytes,
)
from dtk.plan.cost.memory import Job, precision_for, rank_bytes, scheme_config
from dtk.plan.degrees import Degrees
from dtk.plan.shape import whatif_shape

D = Dims(b=1, s=8192, h=16384, f=53248, heads=128, vocab=128256, a=2, tp=8, sp=True, fused_norm=True)
LOG_SOFTMAX = LOSS_BYTES * D.b * D.s * D.vocab


def test_the_last_stage_keeps_its_micro_batches_in_flight_and_one_micro_batchs_logits_split_over_tp():
    norms = head_bytes(D) - LOG_SOFTMAX
    one = last_stage_head_bytes(D, ends=1, num_micro=32, pp=8, per_micro_batch=True)  # 1F1B: one in flight
    assert one == norms + LOG_SOFTMAX // 8 + logits_bytes(D) // 8
    assert last_stage_head_bytes(D, ends=1, num_micro=2, pp=8, per_micro_batch=True) == one  # not per micro-batch
    # GPipe: every micro-batch's forward before any backward, each keeps its norm and log-softmax
    assert (last_stage_head_bytes(D, ends=32, num_micro=32, pp=8, per_micro_batch=True)
            == 32 * (norms + LOG_SOFTMAX // 8) + logits_bytes(D) // 8)
    # the runtime before: every micro-batch's logits whole until the step ended; 72 GB here against 1.1 GB
    before = last_stage_head_bytes(D, ends=1, num_micro=32, pp=8, per_micro_batch=False)
    assert before == head_bytes(D) + 32 * logits_bytes(D) and before > 60 * one
    assert last_stage_working_bytes(D, "full", pp=8, per_micro_batch=True) < last_stage_working_bytes(
        D, "full", pp=8, per_micro_batch=False)
    # without a pipeline one micro-batch's logits, whichever way, split over tp too: the
    # workers' loss is vocabulary-parallel there as well (dtk.parallel.parallelize)
    for per_micro_batch in (True, False):
        assert last_stage_head_bytes(D, ends=1, num_micro=32, pp=1, per_micro_batch=per_micro_batch) == one
        assert (last_stage_working_bytes(D, "full", pp=1, per_micro_batch=per_micro_batch)
                == last_stage_working_bytes(D, "full", pp=8, per_micro_batch=True))
    # fp32 logits without tp: the whole log-softmax is kept
    whole = dataclasses.replace(D, tp=1, sp=False, a=4)
    assert last_stage_head_bytes(whole, ends=1, num_micro=1, pp=1, per_micro_batch=True) == head_bytes(
        whole) + logits_bytes(whole)


def test_plain_bf16_logits_are_reduced_chunk_by_chunk_as_the_loss_does():
    from dtk.train import loss

    assert LOSS_CHUNK_ELEMENTS == loss.LOSS_CHUNK_ELEMENTS  # the budget's copy of the runtime's chunk
    plain = dataclasses.replace(D, tp=1, sp=False)  # bf16 logits, 1 x 8192 x 128256: larger than a chunk
    assert chunked_loss(plain) and not chunked_loss(D) and not chunked_loss(dataclasses.replace(plain, a=4))
    # no fp32 log-softmax kept; backward holds the logits' gradient in bf16 and one chunk in fp32
    assert last_stage_head_bytes(plain, ends=1, num_micro=1, pp=1, per_micro_batch=True) == (
        head_bytes(plain) - LOSS_BYTES * plain.b * plain.s * plain.vocab + logits_bytes(plain))
    assert last_stage_working_bytes(plain, "none", pp=1, per_micro_batch=True) == (
        logits_bytes(plain) + 3 * LOSS_BYTES * LOSS_CHUNK_ELEMENTS)


def test_receive_buffers_of_the_micro_batches_in_flight():
    # a middle stage of 1F1B holding 3 micro-batches in flight: 3 inputs, 1 gradient at a time
    assert recv_buffer_bytes(10, chunks=3, stages=1, first=False, last=False, num_micro=32) == 40
    assert recv_buffer_bytes(10, chunks=1, stages=1, first=False, last=True, num_micro=32) == 10  # the last stage
    assert recv_buffer_bytes(10, chunks=8, stages=1, first=True, last=False, num_micro=32) == 10  # the first stage


def test_a_pipeline_ranks_budget_no_longer_grows_with_the_micro_batch_count():
    shape = whatif_shape({"layers": 32, "hidden": 4096, "heads": 32, "seq_len": 4096, "vocab_size": 128256})
    scheme = scheme_config(dict(dataclasses.asdict(SchemeConfig()), data_parallel="fsdp", pp_schedule="1f1b"))
    degrees = Degrees(dp_replicate=1, pp=4, dp_shard=2, tp=1)

    def rank(r: int, num_micro: int):
        job = Job(scheme, degrees, micro_batch=1, num_micro=num_micro, device="cuda",
                  precision=precision_for(scheme, "cuda"))
        return rank_bytes(shape, job, r)

    last = degrees.world - 1  # a rank of the last stage
    for r in (0, 2, last):
        few, many = rank(r, 8), rank(r, 32)
        assert (few.activations, few.detail.get("pipeline_recv")) == (many.activations, many.detail.get("pipeline_recv"))


def test_a_tied_weight_split_over_stages_is_budgeted_twice_as_the_stages_keep_two_copies():
    """dtk.parallel.stage_ties: the last stage holds, steps and all-reduces its own copy of the
    output head tied to the first stage's token embedding; the budget counts that copy on
    the last stage's ranks: as much as the untied model's own head there."""
    from dtk.config.compose import compose
    from dtk.config.convert import builtin_transformer
    from dtk.plan.shape import builtin_shape

    def budget(tie: str, degrees: Degrees, data_parallel: str):
        model = builtin_transformer(compose(["model.dim=256", "model.num_layers=4", "model.num_heads=4",
                                             f"model.tie_embeddings={tie}"]).model)
        scheme = scheme_config(dict(dataclasses.asdict(SchemeConfig()), data_parallel=data_parallel,
                                    pp_schedule="1f1b"))
        job = Job(scheme, degrees, micro_batch=1, num_micro=4, device="cpu", precision=precision_for(scheme, "cpu"))
        return [rank_bytes(builtin_shape(model), job, r) for r in range(degrees.world)]

    for degrees, dp in ((Degrees(dp_replicate=1, pp=2, dp_shard=1, tp=1), "ddp"),
                        (Degrees(dp_replicate=1, pp=2, dp_shard=2, tp=2), "fsdp")):
        tied, untied = budget("true", degrees, dp), budget("false", degrees, dp)
        for t, u in zip(tied, untied, strict=True):
            assert (t.params, t.grads, t.optimizer) == (u.params, u.grads, u.optimizer)
    # without a pipeline the tied weight is one tensor: less than the untied model
    one = Degrees(dp_replicate=1, pp=1, dp_shard=1, tp=1)
    assert budget("true", one, "ddp")[0].params < budget("false", one, "ddp")[0].params
