"""dtk as a team installs it: the wheel built from the repository, installed (not editable)
into a fresh virtual environment, used from a project folder outside the repository.

The environment gets torch first, pinned to the version of the one running the tests and
taken from the machine's local wheels when pip's configuration has them (--no-index),
then the dtk wheel with its other dependencies.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, losses, only_run_dir, require

pytestmark = pytest.mark.slow

COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", "build", "runs", "*.egg-info", "__pycache__", ".pytest_cache")
DISTRIBUTION = "dtk-train"  # pyproject.toml's [project] name; "dtk" on the index is another project
WHEEL_PREFIX = DISTRIBUTION.replace("-", "_")
JOB = ["train.steps=20", "train.global_batch=32", "train.log_every=10", "optim.warmup_steps=2"]


def run(*argv, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    # Nothing of the repository or the test environment leaks in: no PYTHONPATH, and the
    # commands run in folders outside the repository.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "DTK_CONFIG_PATH")}
    return subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"{proc.args}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(python of the fresh environment, a project folder made there by dtk.init). Made once
    per session: under pytest-xdist the lab's test of this module runs in the lab's worker and
    the others elsewhere, so the first worker builds it in the session's shared folder while
    the others wait on a lock (a minute of pip on 2 cores, once instead of twice)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return _install(tmp_path_factory.mktemp("wheel"))
    shared = tmp_path_factory.getbasetemp().parent / "wheel-install"
    with open(f"{shared}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (shared / "installed").exists():
            shutil.rmtree(shared, ignore_errors=True)
            shared.mkdir()
            _install(shared)
            (shared / "installed").write_text("")
    return shared / "venv" / "bin" / "python", shared / "proj"


def _install(work: Path) -> tuple[Path, Path]:
    src = work / "src"
    # A copy, so that the build's own folders (build/, *.egg-info) never mix with the checkout.
    shutil.copytree(REPO, src, symlinks=True, ignore=COPY_IGNORE)
    ok(run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", work / "dist", src, cwd=work))
    (wheel,) = (work / "dist").glob(f"{WHEEL_PREFIX}-*.whl")
    venv = work / "venv"
    ok(run(sys.executable, "-m", "venv", venv, cwd=work))
    python = venv / "bin" / "python"
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    pin = f"torch=={torch.__version__.split('+')[0]}"
    if run(*pip, "--no-index", pin, cwd=work).returncode != 0:
        ok(run(*pip, pin, cwd=work))  # what scripts/setup.sh does where no local wheel is configured
    # By its distribution name, as the README says: the built wheel, not an index's project.
    ok(run(*pip, "--find-links", wheel.parent, f"{DISTRIBUTION}=={wheel.name.split('-')[1]}", cwd=work))
    ok(run(python, "-m", "dtk.init", "proj", cwd=work))
    return python, work / "proj"


def test_the_distribution_name_is_dtks_and_free_on_the_index(tmp_path):
    import tomllib

    assert tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["name"] == DISTRIBUTION
    # The index answers for a name it holds ("dtk": the unrelated project) and has none of ours.
    taken = run(sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp_path, "dtk==0.2", cwd=tmp_path)
    require(taken.returncode == 0, f"the package index does not answer here: {taken.stderr.strip()[-300:]}")
    free = run(sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp_path, DISTRIBUTION, cwd=tmp_path)
    assert free.returncode != 0 and "No matching distribution" in free.stderr, free.stdout + free.stderr


def test_the_wheel_installs_as_files_outside_the_repository(installed):
    python, project = installed
    meta = ok(run(python, "-m", "pip", "show", DISTRIBUTION, cwd=project)).stdout
    assert f"Name: {DISTRIBUTION}" in meta and "site-packages" in meta
    where = ok(run(python, "-c", "import dtk.common.resources as r, dtk; print(dtk.__file__); print(r.conf_dir())", cwd=project))
    module, conf = where.stdout.split()
    assert "site-packages" in module and not module.startswith(str(REPO))
    assert Path(conf, "config.yaml").is_file() and not Path(conf).is_symlink()
    assert Path(conf).parent.joinpath("slurm_templates", "setup", "nccl.sh").is_file()


def test_submit_from_the_project_folder_trains_its_model(installed):
    python, project = installed
    ok(run(python, "-m", "dtk.submit", *JOB, cwd=project))
    run_dir = only_run_dir(project / "runs")
    config = json.loads((run_dir / "plan.json").read_text())["config"]
    assert config["model"]["_target_"] == "proj.build"
    got = losses(run_dir)
    assert sorted(got) == list(range(1, 21)) and got[20] < got[1]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "finished"


@pytest.mark.slurm
def test_a_lab_job_from_the_project_folder_runs(installed, lab, tmp_path):
    python, project = installed
    proc = ok(run(python, "-m", "dtk.submit", "cluster=lab", "nodes=1", "tasks_per_node=2", "submit.wait=true",
                  f"run.root={tmp_path}", *JOB, cwd=project))
    assert "submitted job" in proc.stdout
    run_dir = only_run_dir(tmp_path)
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "finished"
    started = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "started" and str(e.get("job_id", "")).isdigit() for e in started)
    assert sorted(losses(run_dir)) == list(range(1, 21))


def test_config_dir_from_another_folder_reaches_the_workers(installed, tmp_path):
    """Run elsewhere, the project's module is importable only through the plan's import
    path: the workers' current folder is not the project."""
    python, project = installed
    ok(run(python, "-m", "dtk.submit", "--config-dir", project, "tasks_per_node=2", f"run.root={tmp_path}", *JOB,
           cwd=tmp_path))
    run_dir = only_run_dir(tmp_path)
    assert json.loads((run_dir / "plan.json").read_text())["import_path"] == [str(project)]
    assert sorted(losses(run_dir)) == list(range(1, 21))
