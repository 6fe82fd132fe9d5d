"""The tracker sink's logic (dtk.train.tracker) with a client that records what it is sent:
the id kept in tracker.json and reused by the next start, each step logged once (redone
steps and steps read back from metrics.jsonl), an unreachable tracker (one event, training
never waits, it catches up), and a tracker whose package is missing refused at submit.
The real MLflow server and W&B offline files: tests/test_tracker_runs.py."""

from __future__ import annotations

import json
import time
from pathlib import Path

from conftest import run_main
from dtk.common.rundir import TRACKER_STATE, append_jsonl
from dtk.config.choices import TRACKER_MODULES, Tracker, chosen_trackers
from dtk.train.tracker import TrackerSink, new_steps, read_state
from dtk.train.tracker_clients import flat_params


class Recorder:
    """A tracker that holds what it was sent; `down` calls raise as an unreachable one would."""

    name = "mlflow"

    def __init__(self, down: int = 0, held: int | None = None) -> None:
        self.down = down
        self.held = held
        self.opened: list[tuple[str | None, list[str]]] = []
        self.steps: list[int] = []
        self.closed: list[bool] = []

    def _call(self) -> None:
        if self.down:
            self.down -= 1
            raise ConnectionRefusedError("[Errno 111] Connection refused")

    def open(self, run_id, job_ids, remember):
        self._call()
        self.opened.append((run_id, list(job_ids)))
        return run_id or "run-1", self.held

    def log(self, records):
        self._call()
        self.steps.extend(r["step"] for r in records)

    def close(self, *, finished):
        self.closed.append(finished)


def records(*steps: int) -> list[dict]:
    return [{"step": s, "time": 1.0, "loss": 1.0 / s, "lr": 0.1, "restart": 0} for s in steps]


def sink(tmp_path: Path, client, events: list, **kw) -> TrackerSink:
    return TrackerSink(client, state=tmp_path / TRACKER_STATE, metrics=tmp_path / "metrics.jsonl",
                       event=lambda name, **d: events.append((name, d)), total_steps=6, backoff_s=(0.01, 0.05), **kw)


def test_the_id_is_kept_in_the_run_dir_and_reused_by_every_later_start_with_its_job_ids(tmp_path):
    first, events = Recorder(), []
    s = sink(tmp_path, first, events, job_id="101")
    s.add(records(1, 2, 3))
    s.close()
    state = read_state(tmp_path / TRACKER_STATE)
    assert state["mlflow"] == {**state["mlflow"], "run_id": "run-1", "last_step": 3, "job_ids": ["101"]}
    later = Recorder()
    s = sink(tmp_path, later, events, job_id="102")
    s.add(records(4, 5, 6))
    s.close()
    assert later.opened == [("run-1", ["101", "102"])] and later.steps == [4, 5, 6] and later.closed == [True]
    assert events == []


def test_each_step_is_logged_once_across_a_resume_and_the_records_read_back(tmp_path):
    assert new_steps(records(3, 4, 5, 4, 5, 6), 3) == (records(4, 5, 6), 6)
    # An earlier start wrote steps 1-5 to metrics.jsonl; its tracker got 1-2 (the next start
    # learns it from the tracker itself); the new start resumed from step 3 and redoes 4, 5.
    for record in records(1, 2, 3, 4, 5):
        append_jsonl(tmp_path / "metrics.jsonl", record)
    client, events = Recorder(held=2), []
    s = sink(tmp_path, client, events)
    s.add(records(4, 5))
    s.add(records(6))
    s.close()
    assert client.steps == [3, 4, 5, 6]


def test_an_unreachable_tracker_is_one_event_never_waited_for_and_caught_up(tmp_path):
    client, events = Recorder(down=3), []
    s = sink(tmp_path, client, events)
    began = time.monotonic()
    for step in range(1, 7):  # what the metrics thread does: hand over and go on
        s.add(records(step))
    handing_over = time.monotonic() - began
    deadline = time.monotonic() + 10
    while len(client.steps) < 6 and time.monotonic() < deadline:  # the retries, 10, 20, 40 ms apart
        time.sleep(0.005)
    s.close()
    assert handing_over < 0.05 < s.backoff_s[1] * 2  # it never waited for a retry
    assert [name for name, _ in events] == ["tracker_unreachable", "tracker_caught_up"]
    assert "Connection refused" in events[0][1]["error"] and events[1][1]["step"] == 6
    assert client.steps == [1, 2, 3, 4, 5, 6]


def test_a_tracker_still_down_at_the_end_is_tried_once_more_and_left(tmp_path):
    client, events = Recorder(down=10**6), []
    s = sink(tmp_path, client, events)
    s.add(records(1, 2))
    s.close()
    assert not s.thread.is_alive()
    assert [name for name, _ in events] == ["tracker_unreachable"] and client.steps == []


def test_params_are_the_flattened_config_with_keys_mlflow_takes():
    params = flat_params({"train": {"steps": 3, "tracker": ["mlflow"]}, "model": {"tp_plan": {"layers.*.attn": "x"}}})
    assert params == {"train.steps": "3", "train.tracker": "['mlflow']", "model.tp_plan.layers._.attn": "x"}
    assert chosen_trackers([Tracker.mlflow], tensorboard=True) == (Tracker.mlflow, Tracker.tensorboard)


def test_a_tracker_whose_package_is_missing_is_an_error_at_submit(monkeypatch, tmp_path):
    monkeypatch.setitem(TRACKER_MODULES, Tracker.wandb, "dtk_test_no_such_package")
    ran = run_main("dtk.submit", "train.tracker=[mlflow,wandb]", "submit.dry_run=true", f"run.root={tmp_path}")
    assert ran.returncode == 2 and ran.stderr.count("\n") == 1, ran.stderr
    assert ran.stderr.startswith("error: train.tracker includes wandb, but the dtk_test_no_such_package package")
    assert not list(tmp_path.iterdir())


def test_state_file_is_json_a_user_can_read(tmp_path):
    (tmp_path / TRACKER_STATE).write_text(json.dumps({"wandb": {"run_id": "abc"}}))
    assert read_state(tmp_path / TRACKER_STATE)["wandb"]["run_id"] == "abc"
