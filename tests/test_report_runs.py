"""The report on real local runs: repeatability verdicts, PNG files, and the goodput of a run
whose workers were killed and that the same command resumed."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, dtk, losses, only_run_dir, run_dirs

pytestmark = [pytest.mark.slow, pytest.mark.dist]

JOB = ["train.steps=12", "checkpoint.every=6", "train.log_every=6", "train.global_batch=32"]


def _run(root: Path, *overrides: str) -> Path:
    proc = dtk("dtk.submit", *JOB, *overrides, f"run.root={root}", cwd=root.parent)
    assert proc.returncode == 0, proc.stderr
    return only_run_dir(root)


def _png_curves(path: Path) -> int:
    from PIL import Image

    with Image.open(path) as img:
        img.load()
        return int(img.text["Description"].split(":")[0].removeprefix("curves="))


def test_identical_runs_say_identical_and_another_lr_diverged(tmp_path):
    a = _run(tmp_path / "a")
    b = _run(tmp_path / "b")
    c = _run(tmp_path / "c", "optim.lr=1e-3")
    proc = dtk("dtk.report", str(a), str(b), str(c), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    (same,) = out["repeatability"]  # another learning rate is a sweep, not a repeatability pair
    assert same["verdict"] == "identical" and same["common_steps"] == 12
    assert [r["run"] for r in out["sweep"]] == ["optim.lr=0.003", "optim.lr=0.001"]
    assert out["sweep"][1]["final_loss"] == losses(c)[12] != losses(a)[12]
    # Step 1 runs before any update, so both learning rates give the same loss there; the
    # first step after a different-sized update is where they part.
    first_diff = min(s for s in losses(a) if losses(a)[s] != losses(c)[s])
    assert first_diff >= 2
    assert _png_curves(a / "report" / "loss.png") == 3
    for name in ("phases.png", "goodput.png"):
        assert _png_curves(a / "report" / name) >= 1
    summary = json.loads((a / "summary.json").read_text())
    assert 0 < summary["goodput"]["goodput"] < 1
    # A 2-process local run: every record has its phases, adding up to the step time.
    records = [json.loads(line) for line in (a / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13))
    for r in records:
        assert set(r["phases"]) == {"data", "forward", "backward", "optimizer", "comm", "checkpoint", "straggler"}
        assert sum(r["phases"].values()) == pytest.approx(r["step_time_s"], rel=0.05)
        assert 0 <= r["idle_share"] <= 1 and r["tflops"] > 0 and "mfu" not in r  # no peak on the CPU
    assert [r["step"] for r in records if "ranks" in r] == [6, 12]
    # The saves at steps 6 and 12 block for a while; steps 1-5 had nothing to save (their
    # median: a step descheduled in that microsecond lap on a loaded machine moves no verdict).
    before = statistics.median(r["phases"]["checkpoint"] for r in records[:5])
    assert records[5]["phases"]["checkpoint"] > 10 * before and records[11]["phases"]["checkpoint"] > 10 * before
    ready = [json.loads(line) for line in (a / "events.jsonl").read_text().splitlines() if '"ready"' in line]
    assert ready and ready[0]["import_s"] > 0 and ready[0]["process_group_s"] >= 0


def test_the_same_run_under_fsdp_is_equal_to_ddp_within_float_tolerance_and_shows_its_validation(tmp_path):
    job = ["train.eval_every=6", "train.profile=false"]
    ddp = _run(tmp_path / "ddp", *job)
    fsdp = _run(tmp_path / "fsdp", *job, "+scheme=fsdp")
    proc = dtk("dtk.report", str(ddp), str(fsdp), "--no-plots")
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("repeatability"))
    # One run identity on two layouts: their sums run in another order, so bitwise equality
    # is not promised; never "diverged" over that noise.
    assert "identical: bit-for-bit" in line or "equal within float tolerance" in line, line
    assert "one run identity; differs in" in line and "scheme.name" in line and "diverged" not in line
    evals = [json.loads(x) for x in (fsdp / "eval.jsonl").read_text().splitlines()]
    assert f"validation   val_loss {evals[-1]['val_loss']:.6f} at step 12" in proc.stdout


def test_killed_and_resumed_run_shows_redone_work_and_restart_time(tmp_path):
    root = tmp_path / "runs"
    # Records are written every train.log_every steps: those of steps 11..15 are on disk before the kill.
    job = ["train.steps=40", "checkpoint.every=10", "train.log_every=5", "train.global_batch=32", f"run.root={root}",
           "fault.max_restarts=0"]  # the driver stops at the kill (no relaunch); the next command resumes
    env = dict(os.environ, PYTHONPATH=str(REPO))
    driver = subprocess.Popen([sys.executable, "-m", "dtk.submit", *job], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    run = None
    while time.monotonic() < deadline:
        assert driver.poll() is None, "the job ended before it could be killed"
        runs = run_dirs(root) if root.exists() else []
        # The step-10 save is asynchronous: on a busy machine step 15 can be logged before its
        # manifest is written, and a kill then leaves nothing to load.
        committed = runs and (runs[0] / "checkpoints" / "step_00000010" / "manifest.json").exists()
        if committed and (runs[0] / "metrics.jsonl").exists() and losses(runs[0]) and max(losses(runs[0])) >= 15:
            run = runs[0]
            break
        time.sleep(0.05)
    assert run is not None, "step 15 not reached"
    for pid in (run / "logs" / "start_00" / "pids").read_text().split():
        os.kill(int(pid), signal.SIGKILL)
    driver.communicate(timeout=60)
    assert driver.returncode == 1

    proc = dtk("dtk.submit", *job, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    proc = dtk("dtk.report", str(run), "--json", "--no-plots")
    assert proc.returncode == 0, proc.stderr
    g = json.loads(proc.stdout)["runs"][0]["goodput"]
    assert g["restarts"] == 1 and g["redone_steps"] >= 5  # steps 11..15 at least, done twice
    assert g["parts"]["redone_s"] > 0 and g["parts"]["checkpoint_load_s"] > 0
    second = g["starts"][1]
    assert second["startup_s"] > 0 and second["checkpoint_load_s"] > 0
    assert g["restart_s"] >= second["startup_s"] + second["checkpoint_load_s"]
    assert sum(g["parts"].values()) == pytest.approx(g["wall_s"], rel=1e-3)
    # The worker's own account in summary.json says the same.
    summary = json.loads((run / "summary.json").read_text())
    assert summary["goodput"]["redone_steps"] == g["redone_steps"]
    text = dtk("dtk.report", str(run), "--no-plots").stdout
    assert f"restarts     1: {g['restart_s']:.1f} s restarting, {g['redone_steps']} step(s) redone" in text
