"""An out-of-memory error in a worker stops the job: one `error:` line with the planned
numbers and the overrides that would fit, no traceback, no relaunch (a real 2-process run
of a user model whose forward raises torch.OutOfMemoryError, as a CUDA allocation does)."""

from __future__ import annotations

import json
import re

import pytest

from conftest import dtk, only_run_dir

pytestmark = [pytest.mark.slow, pytest.mark.dist]

MODEL_YAML = """\
_target_: tests.models_for_tests.build_out_of_memory
vocab_size: 256
seq_len: 32
width: 32
depth: 2
wrap_classes: [ResidualMLP]
"""


def test_out_of_memory_stops_the_job_with_one_line_and_no_relaunch(tmp_path):
    conf = tmp_path / "conf"
    (conf / "model").mkdir(parents=True)
    (conf / "model" / "oom.yaml").write_text(MODEL_YAML)
    proc = dtk("dtk.submit", f"hydra.searchpath=[file://{conf}]", "model=oom", "tasks_per_node=2", "+scheme=ddp",
               "train.steps=4", "train.global_batch=8", "fault.max_restarts=2", f"run.root={tmp_path / 'runs'}",
               cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    (line,) = errors
    assert re.search(r"; see python -m dtk\.plan \(worker rank \d; log \S+\)$", line), line  # whole, not cut
    assert line.startswith("error: out of memory on rank ") and " planned " in line
    assert "GB per device under ddp on 1 node(s) x 2 = params " in line
    assert "activations of this model are not estimated" in line
    assert "it needs more than planned: planned again for " in line
    assert "would fit: +scheme=" in line or "no override found: " in line
    assert "Traceback" not in proc.stderr and "relaunching" not in proc.stderr
    run = only_run_dir(tmp_path / "runs")
    events = [json.loads(ln)["event"] for ln in (run / "events.jsonl").read_text().splitlines()]
    assert events.count("started") == 1 and "relaunched" not in events
    for log in (run / "logs" / "start_00").glob("rank_*.log"):
        assert "Traceback" not in log.read_text(), log
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and "out of memory on rank" in summary["error"]
