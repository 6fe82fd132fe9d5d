"""benchmarks/gpu_check.sh without a GPU: one error line, exit 2, nothing run. And the part
of benchmarks/gpu_check.py that needs no GPU: the loss comparison. (Device names -> the
accelerator table, H200 NVL told apart from H200 SXM: tests/test_flops.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_check  # noqa: E402

SCRIPT = REPO / "benchmarks" / "gpu_check.sh"


def run_script(tmp_path: Path, path: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=path, PYTHON=sys.executable)
    return subprocess.run(["bash", str(SCRIPT), str(tmp_path / "root")], env=env, capture_output=True, text=True,
                          timeout=120)


def test_without_nvidia_smi_the_check_is_one_error_line_and_exit_2(tmp_path):
    proc = run_script(tmp_path, "/usr/bin:/bin")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "error: gpu_check needs an NVIDIA GPU: nvidia-smi is not on PATH (no GPU or no driver on this machine)"
    ]
    assert not (tmp_path / "root").exists()


def test_an_nvidia_smi_that_lists_no_gpu_is_one_error_line_and_exit_2(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'No devices were found'\nexit 6\n")
    fake.chmod(0o755)
    proc = run_script(tmp_path, f"{bin_dir}:/usr/bin:/bin")
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.splitlines() == ["error: gpu_check needs an NVIDIA GPU: nvidia-smi lists none"]


def test_a_gpu_torch_cannot_see_is_one_error_line_and_exit_2(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 NVL (UUID: GPU-0)'\n")
    fake.chmod(0o755)
    proc = run_script(tmp_path, f"{bin_dir}:/usr/bin:/bin")
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: gpu_check needs a CUDA build of torch"), proc.stderr


def write_losses(folder: Path, losses: list[float]) -> Path:
    folder.mkdir()
    (folder / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": i + 1, "loss": v}) + "\n" for i, v in enumerate(losses)))
    return folder


def test_equivalence_passes_within_the_tolerance_and_fails_beyond_it(tmp_path, capsys):
    ref = write_losses(tmp_path / "ref", [5.0, 4.0, 3.0])
    close = write_losses(tmp_path / "close", [5.0, 4.0001, 3.0])
    far = write_losses(tmp_path / "far", [5.0, 4.1, 3.0])
    short = write_losses(tmp_path / "short", [5.0, 4.0])
    assert gpu_check.equivalence(ref, [close]) == 0
    assert gpu_check.equivalence(ref, [close, far]) == 1
    assert gpu_check.equivalence(ref, [short]) == 1
    out = capsys.readouterr().out
    assert "close vs ref" in out and "FAILED" in out


def test_peak_memory_figure_reads_what_the_workers_recorded_against_the_plan():
    from dtk.plan.memory import RankBytes
    from dtk.plan.predict import rank_record, summarize

    gib = 2**30
    planned = RankBytes(rank=0, params=4 * gib, grads=4 * gib, optimizer=8 * gib, activations=3 * gib, buffers=gib,
                        margin=2 * gib, host=0)
    ranks = [rank_record(planned, {"total": round(measured * gib)}, rank=r, device="cuda", reshard_after_forward=True,
                         activations_estimated=True) for r, measured in enumerate((19.0, 25.0))]
    summary = {"peak_memory_gib": 19.0, "memory": summarize(ranks, device="cuda")}
    line = gpu_check.memory_figure(summary, {"per_device_bytes": {"total": 22 * gib}})
    assert line == ("peak memory     25.00 GiB measured (max_memory_allocated, largest rank) against 20.00 GiB"
                    " predicted by dtk.plan (states + activations + buffers): measured / predicted 1.25"
                    " (plan_mismatch on rank(s) 1); 22.00 GiB with the plan's margin")
    assert "not against the plan: summary.json has no prediction" in gpu_check.memory_figure({"peak_memory_gib": 3}, None)
