"""The in-memory snapshot tier on the lab cluster: a node fails while the run trains with
checkpoint.memory_every. With a spare, the replacement node's rank gets its state from the
replica its partner on the surviving node holds (`tier: peer`), at most memory_every steps
are redone and the losses equal the uninterrupted run's. Without a spare the run shrinks to
one rank on the surviving node, which holds its own shard and the lost node's replica: the
snapshot of 2 ranks is resharded to 1 (`tier: memory`, `from_world_size: 2`), at most
memory_every steps are redone and the run ends where the uninterrupted one does."""

from __future__ import annotations

import subprocess

import pytest
from test_faults import STEPS, job_field, named, node_fail_drill, wait_for

from conftest import losses

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

EVERY = 5
TIER = [f"checkpoint.memory_every={EVERY}"]


@pytest.fixture
def reference(lab_reference) -> dict[int, float]:
    return lab_reference


def test_node_failure_with_a_spare_restores_the_lost_rank_from_its_replica(lab, tmp_path, reference):
    # no disk checkpoint but the last: the snapshot is always the newer tier (else a failure
    # right after a disk save rightly loads that, tier disk)
    run, _, victim = node_fail_drill(tmp_path, "spare_nodes=1", "checkpoint.every=1000", *TIER)
    (failed,) = named(run, "node_failed")
    loaded = named(run, "checkpoint_loaded")
    assert len(loaded) == 1 and loaded[0]["tier"] == "peer" and loaded[0]["peer_ranks"], loaded
    # the newest committed snapshot: one taken at the failure may be in flight (not committed), so
    # at most two intervals back on a busy machine
    assert 0 <= failed["step"] - loaded[0]["step"] <= 2 * EVERY, (failed, loaded)
    assert losses(run) == reference


def test_node_failure_without_a_spare_shrinks_and_reshards_the_snapshot(lab, tmp_path, reference):
    hold = subprocess.run(["sbatch", "--parsable", "-w", "node3", "-N1", "--job-name=dtk-test-hold", "--output=/dev/null",
                           "--wrap=sleep 600"], capture_output=True, text=True).stdout.strip()
    try:
        wait_for(lambda: job_field(hold, "JobState") == "RUNNING", 30, "the job holding node3")
        run, _, _ = node_fail_drill(tmp_path, "checkpoint.every=1000", *TIER, grow=True)
    finally:
        subprocess.run(["scancel", hold], capture_output=True)
    started = named(run, "started")
    assert started[1]["world_size"] == 1
    (failed,) = named(run, "node_failed")
    # the shrunk start's load (the node may come back and the job grow back to 2 later: a disk load)
    shrunk_end = started[2]["time"] if len(started) > 2 else float("inf")
    loaded = [e for e in named(run, "checkpoint_loaded") if started[1]["time"] <= e["time"] < shrunk_end]
    assert len(loaded) == 1 and loaded[0]["tier"] == "memory" and loaded[0]["from_world_size"] == 2, named(run, "checkpoint_loaded")
    # the newest committed snapshot: one taken at the failure may be in flight (not committed), so
    # at most two intervals back on a busy machine
    assert 0 <= failed["step"] - loaded[0]["step"] <= 2 * EVERY, (failed, loaded)
    assert abs(losses(run)[STEPS] - reference[STEPS]) <= 1e-5 * abs(reference[STEPS])
