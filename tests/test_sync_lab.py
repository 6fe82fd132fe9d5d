"""`+sync=diloco` through a node failure on the lab cluster: the node is set DOWN with
`python -m dtk.drill node-fail` while the run trains on 2 nodes x 2 workers (4 replicas);
no node can take its place (the third lab node is held by another job), so the driver goes
on on the survivor (docs/recovery.md), 2 replicas, and the workers resume the checkpoint
of 4 replicas by the rule of docs/schemes.md ("Resuming on another number of replicas"):
every replica from the last synchronized parameters. Where the node returns to service
before the end, the driver grows the job back to 2 nodes and the run goes from 2 replicas
to 4 the same way.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from test_faults import drill, finish, job_field, named, step_reached, wait_for

from conftest import dtk, only_run_dir
from dtk.checkpoint.export import load_model_state, synchronized

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS, EVERY = 160, 4
JOB = ["cluster=lab", "nodes=2", "tasks_per_node=2", "fault.hang_timeout_s=30", "+sync=diloco",
       f"sync.every={EVERY}", "train.global_batch=32", f"train.steps={STEPS}", "checkpoint.every=10",
       "train.log_every=20"]


def test_a_diloco_run_goes_on_on_the_surviving_node_with_fewer_replicas(lab, tmp_path):
    hold = subprocess.run(["sbatch", "--parsable", "-w", "node3", "-N1", "--job-name=dtk-test-hold",
                           "--output=/dev/null", "--wrap=sleep 900"], capture_output=True, text=True).stdout.strip()
    victim = None
    try:
        wait_for(lambda: job_field(hold, "JobState") == "RUNNING", 30, "the job holding node3")
        proc = dtk("dtk.submit", *JOB, f"run.root={tmp_path}", cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        job, run = proc.stdout.split("submitted job ", 1)[1].split()[0], only_run_dir(tmp_path)
        wait_for(lambda: step_reached(run, 30), 300, "step 30")
        victim = named(run, "started")[0]["nodes"][-1]
        drill("node-fail", run)
        summary = finish(job, run, timeout=600)
    finally:
        subprocess.run(["scancel", hold], capture_output=True)
        if victim is not None:
            subprocess.run(["scontrol", "update", f"nodename={victim}", "state=resume"], capture_output=True)
    assert summary["status"] == "finished", summary
    (failed,) = named(run, "node_failed")
    assert failed["nodes"] == [victim]
    started = named(run, "started")
    assert started[0]["world_size"] == 4 and started[1]["world_size"] == 2 and victim not in started[1]["nodes"]
    resumed = named(run, "resumed")
    changed = named(run, "sync_replicas_changed")
    step = resumed[0]["step"]
    assert changed[0] == {**changed[0], "step": step, "from_replicas": 4, "replicas": 2,
                          "synced_at": step - step % EVERY, "inner_steps_dropped": step % EVERY}
    if named(run, "grown"):  # the node came back to service and passed its health job: 4 replicas again
        step = resumed[1]["step"]
        assert [s["world_size"] for s in started] == [4, 2, 4]
        assert changed[1] == {**changed[1], "step": step, "from_replicas": 2, "replicas": 4,
                              "synced_at": step - step % EVERY, "inner_steps_dropped": step % EVERY}
    else:
        assert len(started) == 2 and len(changed) == 1
    steps = {json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()}
    assert steps == set(range(1, STEPS + 1))
    # the last step synchronized: every replica of the last start holds the anchor
    path = run / "checkpoints" / f"step_{STEPS:08d}"
    manifest = json.loads((path / "manifest.json").read_text())
    saved = load_model_state(path, manifest)
    for name, tensor in synchronized(saved).items():
        assert all(torch.equal(saved[f"replica{r}.{name}"], tensor) for r in range(manifest["sync_replicas"])), name
