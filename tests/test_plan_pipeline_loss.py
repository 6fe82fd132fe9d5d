"""The pipeline's last stage, budgeted per micro-batch in flight (dtk.plan.activations):
the function the runtime change that computes the loss per micro-batch switches on
(PIPELINE_LOSS_PER_MICRO_BATCH), next to the budget the runtime has today."""

from __future__ import annotations

from dtk.plan.activations import (
    LOSS_BYTES,
    Dims,
    head_bytes,
    last_stage_head_bytes,
    last_stage_working_bytes,
    logits_bytes,
)

D = Dims(b=1, s=8192, h=16384, f=53248, heads=128, vocab=128256, a=2, tp=8, sp=True, fused_norm=True)


def test_today_the_last_stage_keeps_every_micro_batchs_logits():
    for n in (1, 8, 32):
        got = last_stage_head_bytes(D, ends=1, num_micro=n, pp=8, per_micro_batch=False)
        assert got == head_bytes(D) + n * logits_bytes(D)
    # without a pipeline one micro-batch's, whichever way
    assert (last_stage_head_bytes(D, ends=1, num_micro=32, pp=1, per_micro_batch=True)
            == last_stage_head_bytes(D, ends=1, num_micro=32, pp=1, per_micro_batch=False)
            == head_bytes(D) + logits_bytes(D))


def test_per_micro_batch_one_micro_batchs_logits_and_log_softmax_split_over_tp():
    log_softmax = LOSS_BYTES * D.b * D.s * D.vocab
    norms = head_bytes(D) - log_softmax
    one = last_stage_head_bytes(D, ends=1, num_micro=32, pp=8, per_micro_batch=True)
    assert one == norms + (logits_bytes(D) + log_softmax) // 8
    assert last_stage_head_bytes(D, ends=1, num_micro=2, pp=8, per_micro_batch=True) == one  # not per micro-batch
    # the norms of at most pp micro-batches in flight
    assert last_stage_head_bytes(D, ends=20, num_micro=32, pp=8, per_micro_batch=True) == 8 * norms + one - norms
    # 32 micro-batches of Llama 3.1 405B's logits on the last of 8 stages: 72 GB today, 1.1 GB per micro-batch
    today = last_stage_head_bytes(D, ends=1, num_micro=32, pp=8, per_micro_batch=False)
    assert today > 60 * one
    assert last_stage_working_bytes(D, "full", pp=8, per_micro_batch=True) < last_stage_working_bytes(
        D, "full", pp=8, per_micro_batch=False)
