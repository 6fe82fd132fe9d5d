"""The follow line of submit.wait / the local driver: step, loss, speed, ETA, and the newest
validation figures from eval.jsonl (they are not only in rank 0's log)."""

from __future__ import annotations

import io
import json

from dtk.launch.progress import Progress


def append(path, record) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")


def test_the_follow_line_shows_the_newest_validation_figures(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    out = io.StringIO()
    progress = Progress(metrics, total=20, every=5, out=out)
    for step in range(1, 6):
        append(metrics, {"step": step, "loss": 2.0, "lr": 1e-3, "step_time_s": 0.1})
    progress.poll()
    assert "step 5/20" in out.getvalue() and "val_" not in out.getvalue()
    append(tmp_path / "eval.jsonl", {"step": 5, "val_loss": 1.25, "val_accuracy": 0.5, "seconds": 0.2})
    for step in range(6, 11):
        append(metrics, {"step": step, "loss": 1.5, "lr": 1e-3, "step_time_s": 0.1})
    with open(tmp_path / "eval.jsonl", "a") as fh:
        fh.write('{"step": 10, "val_lo')  # a line still being written waits for the next poll
    progress.poll()
    last = out.getvalue().splitlines()[-1]
    assert "step 10/20" in last and "| val_loss 1.2500 val_accuracy 0.5000 (step 5)" in last, last
