"""Distributed pieces on 2 real gloo ranks, in seconds: the tensor-parallel styles and loss,
ZeroOptimizer, clip_grad_norm_, StopFlag.agreed and the checkpoint's Comm, each against
its one-process equivalent (tests/multirank_checks.py). One spawn runs them all."""

from __future__ import annotations

import signal

import pytest

from multirank import run_on_ranks
from multirank_checks import all_checks

pytestmark = pytest.mark.dist
WORLD = 2


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_on_ranks(all_checks, WORLD, tmp_path_factory.mktemp("multirank"))


def per_rank(results: list[dict], name: str) -> list[dict]:
    for rank, r in enumerate(results):
        assert "error" not in r[name], f"rank {rank}:\n{r[name]['error']}"
    return [r[name] for r in results]


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_styles_match_the_plain_model(results, sequence_parallel):
    for r in per_rank(results, "tp"):
        got = r[sequence_parallel]
        assert got["sharded_parameters"] == 4  # embed, up, down, head: the norm stays replicated
        assert got["output"] < 1e-6
        assert got["grads"] and max(got["grads"].values()) < 1e-6, got["grads"]


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_the_tensor_parallel_loss_never_gathers_the_logits(results, sequence_parallel):
    for r in per_rank(results, "loss_parallel"):
        got = r[sequence_parallel]
        batch, seq, vocab = got["full_logits"]
        assert got["local_logits"] == (batch, seq, vocab // WORLD)  # each rank holds 1/tp of the logits
        assert got["loss"] < 1e-6 and got["summed"] < 1e-5
        assert got["grads"] and max(got["grads"].values()) < 1e-6, got["grads"]


def test_a_bf16_pipeline_sends_bf16_and_runs_its_backward_outside_autocast(results):
    first, last = per_rank(results, "pp_autocast")
    assert set(first["sent"]) == {"torch.bfloat16"} and len(first["sent"]) >= 2  # shape inference, 2 micro-batches
    assert first["autocast_in_backward"] == [False]
    assert last["loss"] == pytest.approx(last["reference"], rel=2e-2)  # bf16 rounding at the boundary
    # Each stage's forward and backward of each of the 2 micro-batches is a heartbeat tick.
    assert first["ticks"] == last["ticks"] == 4


def test_zero_optimizer_matches_one_optimizer_over_all_parameters(results):
    ranks = per_rank(results, "zero")
    for r in ranks:
        assert r["max_difference"] == 0.0 and r["grads_cleared"]
        assert r["broadcasts_per_step"] == WORLD  # one flat bucket per owner, not one per parameter
    # The state is split: each rank steps only its share, together all of it.
    assert sum(r["owned_elements"] for r in ranks) == 15 + 7 + 4 + 3
    assert all(0 < r["local_state"] < 4 for r in ranks)


def test_clip_grad_norm_matches_torch_on_the_unsharded_gradients(results):
    for r in per_rank(results, "clip"):
        assert r["norm"][0] == pytest.approx(r["norm"][1], rel=1e-6)
        assert r["pp_norm"][0] == pytest.approx(r["pp_norm"][1], rel=1e-6)
        assert r["clipped"] < 1e-6 and r["pp_clipped"] < 1e-6


def test_a_signal_on_one_rank_is_agreed_by_all(results):
    ranks = per_rank(results, "stop_flag")
    assert [r["before"] for r in ranks] == [0, 0]
    assert [r["after"] for r in ranks] == [ranks[0]["expected"]] * WORLD
    assert [r["own"] for r in ranks] == [0, ranks[0]["expected"]]  # only rank 1 was signalled
    assert [r["seconds"] for r in ranks] == [1.5, 1.5]  # every rank the same, so their next vote agrees
    assert ranks[0]["alone"] == (int(signal.SIGTERM), 0.25)


def test_checkpoint_comm_matches_the_one_process_comm(results):
    ranks = per_rank(results, "comm")
    for rank, r in enumerate(ranks):
        assert r["rank"] == (rank, WORLD)
        assert r["broadcast"] == {"from": 0}
        assert r["all_gather"] == [0, 10]
        assert r["any"] == (True, False)
        assert r["alone"] == ({"from": rank}, [rank * 10], True, False)


def test_every_group_dtk_makes_has_the_worlds_timeout(results):
    for r in per_rank(results, "group_timeouts"):
        assert r["plain"] != 77.0  # torch's own default for a new group: the fix is needed
        assert r["num_groups"] == 6  # five axes and the flattened data-parallel group
        assert r["timeouts"] == [77.0] * 8
