"""benchmarks/gpu_check.sh without the pieces it needs: its preflight says each missing one
in an error line of its own, exits 2 and runs nothing. And the parts of
benchmarks/gpu_check.py that need no GPU: the loss comparison, the memory and checkpoint
figures, the host-sync count per thread. (Device names -> the
accelerator table, H200 NVL told apart from H200 SXM: tests/test_flops.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_check  # noqa: E402

SCRIPT = REPO / "benchmarks" / "gpu_check.sh"


def run_script(tmp_path: Path, path: str, **env_vars: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=path, PYTHON=sys.executable)
    env.pop("CC", None)
    env.update(env_vars)
    return subprocess.run(["bash", str(SCRIPT), str(tmp_path / "root")], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.slow  # the script's preflight imports torch and dtk's dependencies in a process
def test_without_nvidia_smi_the_check_is_one_error_line_and_exit_2(tmp_path):
    proc = run_script(tmp_path, "/usr/bin:/bin")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "error: gpu_check needs an NVIDIA GPU: nvidia-smi is not on PATH (no GPU or no driver on this machine)"
    ]
    assert not (tmp_path / "root").exists()


@pytest.mark.slow  # the script's preflight imports torch and dtk's dependencies in a process
def test_an_nvidia_smi_that_lists_no_gpu_is_one_error_line_and_exit_2(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'No devices were found'\nexit 6\n")
    fake.chmod(0o755)
    proc = run_script(tmp_path, f"{bin_dir}:/usr/bin:/bin")
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.splitlines() == ["error: gpu_check needs an NVIDIA GPU: nvidia-smi lists none"]


@pytest.mark.slow  # the script's preflight imports torch and dtk's dependencies in a process
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


@pytest.mark.slow  # the script's preflight imports torch and dtk's dependencies in a process
def test_every_missing_piece_is_a_line_of_its_own(tmp_path):
    """A Python without dtk's dependencies (a bare venv), a C compiler that is not there and
    no GPU: one line per piece, all of them, and nothing run."""
    bare = tmp_path / "bare"
    venv.create(bare)
    proc = run_script(tmp_path, "/usr/bin:/bin", PYTHON=str(bare / "bin" / "python"), CC="/nonexistent/cc")
    assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr
    lines = proc.stderr.splitlines()
    assert all(line.startswith("error: gpu_check needs ") for line in lines), lines
    deps = [line.split("dependency ")[1].split(":")[0] for line in lines if "dependency" in line]
    assert deps == ["torch", "submitit", "hydra", "omegaconf", "h5py", "psutil", "numpy"]  # dtk itself imports
    assert "error: gpu_check needs a C compiler for Triton (torch.compile): CC=/nonexistent/cc is not on PATH" in lines
    assert lines[-1].startswith("error: gpu_check needs an NVIDIA GPU: nvidia-smi is not on PATH")
    assert len(lines) == 9
    assert not (tmp_path / "root").exists()


@pytest.mark.slow  # the script's preflight imports torch and dtk's dependencies in a process
def test_missing_python_headers_are_a_line(tmp_path):
    """Triton builds its launcher against the interpreter's include folder: without Python.h
    there, torch.compile fails at its first GPU kernel, so the preflight says so."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        "import sysconfig\n_paths = sysconfig.get_paths\n"
        "sysconfig.get_paths = lambda *a, **k: {**_paths(*a, **k), 'include': '/nonexistent/include'}\n")
    proc = run_script(tmp_path, "/usr/bin:/bin", PYTHONPATH=f"{shim}:{REPO}")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "error: gpu_check needs Python.h for Triton (torch.compile): not in /nonexistent/include (install the Python"
        " development headers, e.g. python3-dev)",
        "error: gpu_check needs an NVIDIA GPU: nvidia-smi is not on PATH (no GPU or no driver on this machine)",
    ]


def test_the_runs_get_no_restarts():
    """A failed check run fails at once, with its own error, instead of being relaunched."""
    text = SCRIPT.read_text()
    assert text.count("fault.max_restarts=0") == 2  # the throughput run and every small run
    assert text.count("\"$PYTHON\" -m dtk.submit") == 2


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
    from dtk.plan.cost.memory import RankBytes
    from dtk.plan.cost.predict import rank_record, summarize

    gib = 2**30
    planned = RankBytes(rank=0, params=4 * gib, grads=4 * gib, optimizer=8 * gib, activations=3 * gib, buffers=gib,
                        margin=2 * gib, host=0)
    ranks = [rank_record(planned, {"total": round(measured * gib)}, rank=r, device="cuda",
                         activations_estimated=True) for r, measured in enumerate((19.0, 25.0))]
    summary = {"peak_memory_gib": 19.0, "memory": summarize(ranks, device="cuda")}
    line = gpu_check.memory_figure(summary, {"per_device_bytes": {"total": 22 * gib}})
    assert line == ("peak memory     25.00 GiB measured (max_memory_allocated, largest rank) against 20.00 GiB"
                    " predicted by dtk.plan (states + activations + buffers): measured / predicted 1.25"
                    " (plan_mismatch on rank(s) 1); 22.00 GiB with the plan's margin")
    assert "not against the plan: summary.json has no prediction" in gpu_check.memory_figure({"peak_memory_gib": 3}, None)


def test_host_syncs_count_the_training_thread_only():
    """Real warnings raised in two threads, as CUDA's sync debug mode raises them in the
    thread that synchronized: the loader's thread is counted apart, not as the loop's."""
    import threading
    import warnings

    caught: list[tuple[str, str]] = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = gpu_check.recorder(caught)
        warnings.warn("called a synchronizing CUDA operation (item)", UserWarning, stacklevel=1)
        loader = threading.Thread(target=lambda: warnings.warn("called a synchronizing CUDA operation (copy)",
                                                               UserWarning, stacklevel=1), name="loader")
        loader.start()
        loader.join()
        warnings.warn("something else", UserWarning, stacklevel=1)
    training, others = gpu_check.split_syncs(caught, training_thread=threading.current_thread().name)
    assert training == ["called a synchronizing CUDA operation (item)"]
    assert others == ["called a synchronizing CUDA operation (copy)"]


def test_the_checkpoint_line_says_block_stage_and_commit():
    saved = {"step": 40, "bytes": 12.5e9, "seconds": 10.0, "blocked_seconds": 0.25, "staging_seconds": 3.5,
             "asynchronous": True}
    assert gpu_check.checkpoint_figure(saved) == (
        "checkpoint      step 40 (async): 12.50 GB; block 0.25 s (training waited), stage 3.50 s (copy to host"
        " memory), commit 10.0 s (to the committed manifest) = 1.25 GB/s")
    sync = gpu_check.checkpoint_figure({**saved, "staging_seconds": None, "asynchronous": False})
    assert "(sync)" in sync and "stage - (copy" in sync
