"""A configuration error only a worker can see ends the run at its first start, on both
drivers: the worker exits 2 (dtk.worker.codes.EXIT_CONFIG) with its `error:` line and
nothing is relaunched.

The error used is a real one: a dataset shard whose bytes changed after it was prepared
(same size, so the login node's size check passes) read with `data.verify=true`, which
makes every worker check the shards' checksums.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import dtk, only_run_dir

pytestmark = [pytest.mark.slow]

JOB = ["train.global_batch=32", "model.seq_len=32", "train.steps=20", "data=hdf5", "data.verify=true"]


def corrupt_dataset(tmp_path: Path) -> Path:
    np.save(tmp_path / "tokens.npy", np.random.default_rng(0).integers(0, 200, size=33 * 400).astype(np.int32))
    data = tmp_path / "data"
    proc = dtk("dtk.data", "prepare", "--input", str(tmp_path / "tokens.npy"), "--out", str(data), "--seq-len", "32")
    assert proc.returncode == 0, proc.stderr
    shard = sorted(data.glob("*.h5"))[0]
    raw = bytearray(shard.read_bytes())
    raw[-100] ^= 0xFF  # a token byte near the end: the HDF5 structure stays readable
    shard.write_bytes(bytes(raw))
    return data


def events(run: Path, name: str) -> list[dict]:
    return [e for e in map(json.loads, (run / "events.jsonl").read_text().splitlines()) if e["event"] == name]


@pytest.mark.dist
def test_local_run_stops_at_a_workers_configuration_error_with_its_line(tmp_path):
    data = corrupt_dataset(tmp_path)
    proc = dtk("dtk.submit", *JOB, f"data.path={data}", f"run.root={tmp_path / 'runs'}", cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: data.path={data}: shard ") and "does not match its crc32" in line
    run = only_run_dir(tmp_path / "runs")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and "does not match its crc32" in summary["error"]


@pytest.mark.slurm
def test_lab_job_fails_at_the_first_start_on_a_workers_configuration_error(lab, tmp_path):
    data = corrupt_dataset(tmp_path)
    proc = dtk("dtk.submit", "cluster=lab", "nodes=2", "tasks_per_node=1", "fault.max_restarts=3", *JOB,
               f"data.path={data}", "submit.wait=true", f"run.root={tmp_path / 'runs'}", cwd=tmp_path, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    run = only_run_dir(tmp_path / "runs")
    assert len(events(run, "started")) == 1 and events(run, "relaunched") == []
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"].startswith("configuration error in job ")
    assert "not relaunched: rank " in summary["error"] and "does not match its crc32" in summary["error"]
    (err,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert "does not match its crc32" in err


@pytest.mark.dist
def test_a_mistake_the_login_node_cannot_see_fails_the_local_run_at_once(tmp_path):
    """A model the login node builds and counts, but no worker can build: a UserError in the
    workers, exit 2, one line, no relaunch. (The built-in checks of parallel/, models/, dist/
    and data/ raise UserError too: test_what_only_a_worker_sees_is_a_user_error_there.)"""
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "mlp.yaml").write_text(
        "_target_: tests.models_for_tests.build_worker_only_mistake\nvocab_size: 256\nseq_len: 32\nwidth: 16\n"
        "depth: 2\n")
    proc = dtk("dtk.submit", f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "model=mlp",
               "tasks_per_node=2", "train.steps=5", "fault.max_restarts=3",
               f"run.root={tmp_path / 'runs'}", cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: model.width=16: this worker cannot build it") and "Traceback" not in proc.stderr
    assert "again" not in line  # no advice to resume: the same command fails the same way
    run = only_run_dir(tmp_path / "runs")
    assert len(events(run, "started")) == 1 and events(run, "relaunched") == []
