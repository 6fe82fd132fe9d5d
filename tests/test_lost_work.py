"""Lost work counted exactly: rank 0's progress file carries the last completed optimizer
step of a start whatever train.log_every is; the drivers' end-of-start events, dtk.status's
steps redone and the goodput account use it. The real run (SIGKILL at a known step) is in
test_lost_work_run.py."""

from __future__ import annotations

import json

import pytest

from conftest import dtk
from dtk.common.rundir import PROGRESS, RunDir, read_progress
from dtk.driver.record import last_completed_step, record_failure
from dtk.report.goodput import account
from dtk.report.starts import history
from dtk.train.policies import Heartbeat


def ev(t, kind, **fields):
    return {"time": t, "event": kind, **fields}


# train.log_every=10: metrics.jsonl is written at steps 10, 20, 30. Start 0 saved at 25 and
# was killed after step 37, so records 31-37 never reached the file; start 1 resumed from 25.
EVENTS = [
    ev(0.0, "submitted"),
    ev(1.0, "started", restart=0),
    ev(2.0, "ready", step=0),
    ev(40.0, "relaunched", cause="crashed", step=37, resume_from=25, attempt=1),
    ev(41.0, "started", restart=1),
    ev(42.0, "checkpoint_loaded", step=25, seconds=0.5),
    ev(43.0, "ready", step=25),
    ev(73.0, "finished"),
]
LINES = ([{"step": s, "time": 2.0 + s, "step_time_s": 1.0, "restart": 0, "loss": 1.0} for s in range(1, 31)]
         + [{"step": s, "time": 43.0 + (s - 25) * 2.0, "step_time_s": 2.0, "restart": 1, "loss": 1.0}
            for s in range(26, 41)])


def test_goodput_counts_the_steps_past_the_last_record():
    g = account(EVENTS, LINES)
    # 26-37 done twice: 26-30 with their own records (1 s each), 31-37 at the start's median (1 s).
    assert g["redone_steps"] == 12
    assert g["parts"]["redone_s"] == 12.0
    assert g["parts"]["productive_s"] == 25 * 1.0 + 15 * 2.0


def test_status_counts_the_steps_past_the_last_record():
    starts = history(EVENTS, LINES, max_restarts=2)
    assert starts[1]["resumed_from"] == 25 and starts[1]["steps_redone"] == 12


def test_a_run_without_the_exact_step_is_read_from_its_records_as_before():
    events = [dict(e) for e in EVENTS]
    events[3].pop("step")
    assert account(events, LINES)["redone_steps"] == 5
    assert history(events, LINES, max_restarts=2)[1]["steps_redone"] == 5


def test_the_progress_file_is_the_driver_s_last_step(tmp_path):
    run = RunDir(tmp_path)
    run.event("started", restart=0)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 30, "loss": 2.0}) + "\n")
    beat = Heartbeat(None, progress=tmp_path / PROGRESS, restart=0)
    for step in range(1, 38):
        beat.record_step(step)
        beat.record_step(step)  # after_step runs twice per step: one write
    assert read_progress(run) == (0, 37)
    assert last_completed_step(run) == 37
    record_failure(run, error="boom", restarts=0)
    assert json.loads(run.summary.read_text())["final_step"] == 37
    beat.close()

    # The next start has not completed a step: the file is the old start's, so its step is
    # where the new start began, not 37.
    run.event("started", restart=1)
    assert last_completed_step(run) == 30  # no `ready` yet: the newest record
    run.event("checkpoint_loaded", step=25)
    assert last_completed_step(run) == 25
    beat = Heartbeat(None, progress=tmp_path / PROGRESS, restart=1)
    beat.record_step(26)
    beat.close()
    assert read_progress(run) == (1, 26) and last_completed_step(run) == 26


@pytest.mark.parametrize("text", ["", "garbage", "1 2 3", "-1 5"])
def test_an_unreadable_progress_file_is_ignored(tmp_path, text):
    (tmp_path / PROGRESS).write_text(text)
    assert read_progress(RunDir(tmp_path)) is None


def test_status_shows_the_newest_start_s_progress_not_its_last_record(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "plan.json").write_text(json.dumps({"steps": 50, "run_name": "run", "config": {"fault": {"max_restarts": 3}}}))
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in EVENTS[:6]))  # start 1 is running
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in LINES[:30]))

    def step() -> int:
        proc = dtk("dtk.status", str(run), "--json", env={"PATH": "/nonexistent"})
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)["step"]

    (run / PROGRESS).write_text(f"{0:>10} {37:>12}\n")  # the dead start's: not where the run is
    assert step() == 30
    (run / PROGRESS).write_text(f"{1:>10} {28:>12}\n")
    assert step() == 28
