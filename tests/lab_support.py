"""The lab cluster for tests: bring it up, or skip with the reason (fail under CI=true,
through conftest.require).

conftest.py wires these into a session fixture; a test module that changes the lab (as
tests/test_lab.py does) restores it afterwards with the same two functions.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import psutil

from dtk import lab
from dtk.lab import session
from dtk.lab.files import LabLayout

REPO = Path(__file__).resolve().parents[1]
END = "<!-- end procedure -->"
STEPS = 400
TRAIN = ["train.global_batch=32", f"train.steps={STEPS}", "checkpoint.every=20", "train.log_every=50"]
"""The lab drills' job (tests/test_faults.py, tests/test_memory_tier_lab.py); conftest's
lab_reference is its run without a fault."""
CONDITIONAL = "only when sinfo shows a *"  # the node-failure step for a node whose slurmd does not answer


def procedure(name: str = "node-failure") -> list[tuple[str, str]]:
    """(command, comment) for each line of a procedure block of docs/recovery.md
    (tests/test_recovery_doc.py and the node-failure drill of tests/test_faults.py follow them)."""
    text = (REPO / "docs" / "recovery.md").read_text()
    block = text.split(f"<!-- procedure: {name} -->", 1)[1].split(END, 1)[0]
    steps = []
    for line in block.splitlines():
        if line.startswith("    ") and line.strip():
            command, _, comment = line.strip().partition("  #")
            steps.append((command.strip(), comment.strip()))
    return steps


def node_state(node: str) -> str:
    """Slurm's state of a node (`sinfo %T`): idle, allocated, down, down*, drained, ..."""
    return subprocess.run(["sinfo", "-h", "-N", "-n", node, "-o", "%T"], capture_output=True, text=True).stdout.strip()


def unavailable_reason() -> str | None:
    """Why the lab cannot run on this machine, or None when it can."""
    if os.geteuid() != 0:
        return "the Slurm lab needs root: it starts munged, slurmctld and slurmd"
    missing = lab.missing_programs()
    if missing:
        return f"Slurm/munge not installed (missing {', '.join(missing)}): apt-get install slurm-wlm munge"
    return None


def ensure_lab(nodes: int = 3, *, gpus_per_node: int = 0) -> lab.LabStatus:
    """The lab up with `nodes` idle nodes: a no-op when it already is, a restart when it
    runs another node count. Never installs packages from a test. The lab is this test
    session's (dtk.lab.session; conftest's `lab` fixture names the session): while another
    session holds it the test skips (fails under CI=true) naming that session. A restart
    ends any job left on the lab (forced): a job there is a leftover of this session's
    earlier tests, since no other session may use the lab meanwhile."""
    # Imported here, not at the top: conftest imports this module.
    from conftest import require

    reason = unavailable_reason()
    require(reason is None, f"the Slurm lab cannot run here: {reason}")
    os.environ.setdefault(session.SESSION_ENV, str(os.getpid()))
    held = session.holder(LabLayout(lab.lab_dir()))
    require(held is None or session.is_in(held), f"the lab is in use by another session: {held and held.line()}")
    return lab.up(nodes, install=False, force=True, gpus_per_node=gpus_per_node, log=lambda _line: None)


def lab_down() -> None:
    """Stop the lab if it is up, and end this session's hold on it; nothing to do on a
    machine that cannot run it."""
    if unavailable_reason() is None and lab.status().record is not None:
        lab.down(force=True, log=lambda _line: None)


def lab_release() -> None:
    """End this session's hold on the lab and leave the lab up (it was up before the session)."""
    layout = LabLayout(lab.lab_dir())
    held = session.holder(layout)
    if held is not None and session.is_in(held):
        session.release(layout)


def named_process(folder: Path, name: str, *, stdout=None, script: str | None = None,
                  cwd: Path | None = None) -> subprocess.Popen:
    """A real process named `name` (say `slurmstepd`): a link to sleep 300, or a shell
    script, in `folder`/bin, working in `cwd` (default: this process's folder). The kernel
    names a process after the file it executes."""
    bin_dir = folder / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / name
    if script is None:
        path.symlink_to(shutil.which("sleep"))
        argv = [str(path), "300"]
    else:
        path.write_text("#!/bin/sh\n" + script)
        path.chmod(0o755)
        argv = [str(path)]
    proc = subprocess.Popen(argv, stdout=stdout, stderr=subprocess.DEVNULL, cwd=cwd)
    for _ in range(200):  # until exec has renamed it
        if psutil.Process(proc.pid).name() == name:
            return proc
        time.sleep(0.01)
    raise AssertionError(f"{name} did not start")


def end_process_tree(proc: subprocess.Popen) -> None:
    """Kill a process a test started, and its children, if still running."""
    if proc.poll() is None:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
    proc.wait()


def job_gone(job: str) -> bool:
    """Whether Slurm no longer lists `job` as queued, running or completing. A query that
    failed (a controller too busy to answer, one restarting) says nothing: not gone; a job
    purged after MinJobAge is unknown to squeue, which says so: gone."""
    proc = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True)
    if proc.returncode != 0:
        return "Invalid job id" in proc.stderr
    return not proc.stdout.strip()
