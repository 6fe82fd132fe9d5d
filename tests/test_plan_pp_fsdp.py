"""The budget under pipeline parallel + FSDP, without torch: whether a unit reshards after
forward is one rule (dtk.plan.layout.reshards_after_forward: unset, false with pp > 1),
a stage's gathered parameters and unsharded gradients are resident for the step, and its
all-gather and reduce-scatter are counted once per step, not once per micro-batch.
tests/test_pipeline_fsdp.py counts the real collectives on 4 gloo ranks."""

from __future__ import annotations

import dataclasses

import pytest

from dtk.config.schema import SchemeConfig, TransformerConfig
from dtk.plan.cost.comm import fsdp_collectives, traffic
from dtk.plan.cost.memory import Job, precision_for, rank_bytes
from dtk.plan.cost.predict import comparable
from dtk.plan.degrees import Degrees
from dtk.plan.layout import rank_layout, reshards_after_forward
from dtk.plan.shape import builtin_shape

SHAPE = builtin_shape(TransformerConfig(vocab_size=256, dim=64, num_layers=8, num_heads=4, seq_len=64))
PP2 = Degrees(dp_replicate=1, pp=2, dp_shard=4, tp=1)
PP1 = Degrees(dp_replicate=1, pp=1, dp_shard=8, tp=1)


def job(degrees: Degrees, num_micro: int = 4, **keys) -> Job:
    scheme = SchemeConfig(data_parallel="fsdp", **keys)
    return Job(scheme, degrees, micro_batch=1, num_micro=num_micro, device="cuda",
               precision=precision_for(scheme, "cuda"))


def stage_numel(j: Job) -> int:
    """Rank 0's stage, unsharded (what FSDP gathers)."""
    return sum(h.unsharded_numel for h in rank_layout(SHAPE, j.scheme, j.degrees, 0, ()).held)


def fsdp_traffic(j: Job) -> int:
    [axis] = [a for a in traffic(SHAPE, j, tasks_per_node=8) if a.axis == "dp_shard"]
    return axis.bytes_per_step


@pytest.mark.parametrize("setting, pp, reshards", [
    (None, 1, True), (None, 2, False), (True, 2, True), (False, 1, False), (False, 2, False), (True, 1, True),
])
def test_reshard_after_forward_unset_is_false_under_a_pipeline(setting, pp, reshards):
    d = dataclasses.replace(PP2, pp=pp)
    assert reshards_after_forward(SchemeConfig(reshard_after_forward=setting), d) is reshards


def test_a_stage_stays_gathered_with_its_unsharded_gradients_through_the_step():
    j = job(PP2)
    p, stage = j.precision, stage_numel(j)
    b = rank_bytes(SHAPE, j, 0)
    assert b.detail["fsdp_gather"] == b.gathered_kept == stage * p.gathered_bytes  # bfloat16: 2 bytes
    # float32 accumulation, in place of the sharded gradients the step has not made yet
    assert b.detail["fsdp_unsharded_grads"] == stage * p.reduce_bytes - b.grads > 0
    assert comparable(b, "cpu") == b.params + b.grads + b.optimizer + b.activations_saved + b.gathered_kept
    # torch's pipeline leaves every unit gathered after its backward until the step's end:
    # resharding after forward saves no memory at the peak there
    always = rank_bytes(SHAPE, job(PP2, reshard_after_forward=True), 0)
    assert always.detail["fsdp_gather"] == always.gathered_kept == b.detail["fsdp_gather"]
    # without a pipeline: the root, the last block and two in flight; gradients reduced per block
    flat = rank_bytes(SHAPE, job(PP1), 0)
    assert 0 < flat.detail["fsdp_gather"] < stage_numel(job(PP1)) * p.gathered_bytes
    assert flat.gathered_kept == 0 and "fsdp_unsharded_grads" not in flat.detail


def test_a_stage_is_gathered_and_reduced_once_per_pipeline_step():
    j = job(PP2, num_micro=4)
    p, ring = j.precision, (PP2.dp_shard - 1) / PP2.dp_shard
    once = ring * stage_numel(j) * (p.gathered_bytes + p.reduce_bytes)
    assert fsdp_collectives(j.scheme, PP2, 4)[:2] == (1, 1)
    assert fsdp_traffic(j) == round(once)
    assert fsdp_traffic(job(PP2, num_micro=16)) == fsdp_traffic(j)  # whatever the micro-batches
    # resharding after forward: gathered in each micro-batch's forward and backward, reduced once
    always = job(PP2, num_micro=4, reshard_after_forward=True)
    assert fsdp_collectives(always.scheme, PP2, 4)[:2] == (8, 1)
    assert fsdp_traffic(always) == round(ring * stage_numel(j) * (8 * p.gathered_bytes + p.reduce_bytes))
    # without a pipeline each micro-batch gathers twice and reduces
    flat = job(PP1, num_micro=4)
    assert fsdp_collectives(flat.scheme, PP1, 4)[:2] == (8, 4)
    assert fsdp_traffic(flat) == 4 * fsdp_traffic(job(PP1, num_micro=1))
