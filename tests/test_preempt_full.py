"""The preemption drill's case where Slurm signals every process of the job, the batch
script's too (`python -m dtk.drill preempt RUN_DIR --full`: scancel --signal=TERM --full,
then the preempting job), on the lab. The save the workers start on the signal either
completes or is never resumed from: every resume loads a checkpoint that was committed
(its `checkpoint_saved` event, its manifest), never a folder left without its manifest, and
the losses equal the run without the fault (conftest's lab_reference)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from test_faults import drill, job_field, named, step_reached, submit, wait_for

from conftest import losses
from lab_support import job_gone

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def unfinished(run: Path) -> set[int]:
    """Steps whose checkpoint folder has no manifest (a save that did not complete)."""
    folders = (run / "checkpoints").glob("step_*")
    return {int(f.name.split("_")[1]) for f in folders if f.is_dir() and not (f / "manifest.json").is_file()}


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def _final(job: str) -> bool:
    if job_gone(job) and not job_field(job, "JobState"):
        return True  # purged after MinJobAge
    return job_field(job, "JobState") in ENDED


def ended(job: str) -> bool:
    """The job is over for good: a final state (not the moment of a requeue, when squeue may
    list it nowhere), or purged, and still so a few seconds later (a job the driver requeues
    after its step ended can show a final state for a moment before it is PENDING again)."""
    if not _final(job):
        return False
    time.sleep(10)
    return _final(job)


def status(run: Path) -> str | None:
    """The run's summary status; None when the job ended before its driver wrote one."""
    try:
        return json.loads((run / "summary.json").read_text())["status"]
    except FileNotFoundError:
        return None


def test_signal_to_every_process_then_preemption_resumes_only_from_a_committed_save(lab, tmp_path, lab_reference):
    job, run = submit(tmp_path)
    jobs = [job]
    try:
        wait_for(lambda: step_reached(run, 60), 120, "step 60")
        drill("preempt", run, "--full", "--hold", "5")
        wait_for(lambda: ended(job) or named(run, "resumed"), 120, f"job {job} to end or resume")
        left = unfinished(run)  # what the signal left behind before any resume could clean it up
        wait_for(lambda: ended(job), 240, f"job {job} to end")
        if status(run) != "finished":  # the job ended on the signal (its driver too): the same command goes on
            left |= unfinished(run)
            jobs.append(submit(tmp_path)[0])
            wait_for(lambda: ended(jobs[-1]), 240, f"job {jobs[-1]} to end")
    finally:
        subprocess.run(["scancel", *jobs], capture_output=True)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished", summary
    committed = {e["step"] for e in named(run, "checkpoint_saved")}
    resumed = [e for e in named(run, "resumed") if e["restart"] >= 1]
    assert resumed, "the run did not resume after the drill"
    for e in resumed:
        assert e["step"] in committed and e["step"] not in left, (e, sorted(committed), sorted(left))
    verified = {json.loads(line)["step"]: json.loads(line)["verified"]
                for line in _list(run).splitlines()}
    assert all(verified.values()), verified  # what is left on disk verifies; unfinished folders are gone
    assert losses(run) == lab_reference


def _list(run: Path) -> str:
    from conftest import dtk

    proc = dtk("dtk.checkpoint", "list", "--json", str(run))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout
