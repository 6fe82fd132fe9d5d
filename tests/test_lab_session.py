"""One session at a time on the lab (dtk/lab/session.py): the lock's logic on a lab folder
under tmp_path, with real processes as the sessions, and the refusal of `down` as a
person sees it (one `error:` line, exit 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from conftest import REPO, require, run_main
from dtk.lab import session
from dtk.lab.files import LabLayout
from dtk.lab.programs import LabError
from dtk.lab.record import read_record


@pytest.fixture
def layout(tmp_path) -> LabLayout:
    root = tmp_path / "lab"
    root.mkdir()
    (root / ".dtk-lab").touch()
    return LabLayout(root)


@pytest.fixture
def other():
    """A live process that is not this one nor above it: another person's shell, say."""
    proc = subprocess.Popen(["sleep", "300"])
    yield proc
    proc.kill()
    proc.wait()


def held_by(layout: LabLayout, pid: int, *, user: str = "alice") -> session.Session:
    held = session.of_process(pid, user=user)
    layout.session.write_text(json.dumps(held.__dict__))
    return held


def test_a_free_lab_is_claimed_for_the_callers_session(layout, monkeypatch):
    monkeypatch.setenv(session.SESSION_ENV, str(os.getpid()))
    mine = session.claim(layout, doing="up")
    assert (mine.pid, mine.created) == (os.getpid(), psutil.Process().create_time())
    assert session.holder(layout) == mine
    assert session.claim(layout, doing="up") == mine  # again from the same session: kept, not replaced
    session.release(layout)
    assert session.holder(layout) is None and not layout.session.exists()


def test_another_live_session_is_refused_with_its_name(layout, other):
    held = held_by(layout, other.pid)
    with pytest.raises(LabError) as refused:
        session.claim(layout, doing="python -m dtk.lab up")
    message = str(refused.value)
    assert f"alice's sleep 300 (pid {other.pid}" in message and "--take" in message
    assert "python -m dtk.lab up would change the lab" in message
    assert "\n" not in message
    assert session.holder(layout) == held  # unchanged


def test_take_takes_a_live_session_over(layout, other, monkeypatch):
    monkeypatch.setenv(session.SESSION_ENV, str(os.getpid()))
    held_by(layout, other.pid)
    mine = session.claim(layout, doing="up", take=True)
    assert mine.pid == os.getpid() and session.holder(layout) == mine


def test_a_session_whose_process_ended_holds_nothing(layout, monkeypatch):
    monkeypatch.setenv(session.SESSION_ENV, str(os.getpid()))
    ended = subprocess.Popen(["sleep", "300"])
    held_by(layout, ended.pid)
    ended.kill()
    ended.wait()
    assert session.holder(layout) is None
    assert session.claim(layout, doing="up").pid == os.getpid()  # taken over without --take


def test_a_reused_pid_is_not_the_session(layout, other):
    held = held_by(layout, other.pid)
    layout.session.write_text(json.dumps(dict(held.__dict__, created=held.created - 60)))
    assert session.holder(layout) is None


def test_a_process_under_the_session_is_of_it(layout, monkeypatch):
    """A test session's own `python -m dtk.lab up` (a subprocess of pytest) passes; so does
    a command run under the shell that holds the lab (the holder is above it)."""
    parent = psutil.Process().parent()
    held_by(layout, parent.pid)
    assert session.check(layout, doing="up").pid == parent.pid
    monkeypatch.setenv(session.SESSION_ENV, str(os.getpid()))
    assert session.caller_pid() == os.getpid()


def test_the_session_of_a_command_is_the_process_above_its_launchers(monkeypatch):
    """`sudo python -m dtk.lab up` typed in a shell: the shell, not sudo (here the process
    above this one plays sudo)."""
    parents = psutil.Process().parents()
    require(len(parents) >= 2 and parents[0].name() != parents[1].name(), "no parent unlike its own parent")
    monkeypatch.setattr(session, "LAUNCHERS", frozenset({parents[0].name()}))
    assert session.caller_pid({}) == parents[1].pid
    monkeypatch.setattr(session, "LAUNCHERS", frozenset())
    assert session.caller_pid({}) == parents[0].pid


def test_a_session_variable_naming_a_stranger_is_ignored(other):
    assert session.caller_pid({session.SESSION_ENV: str(other.pid)}) != other.pid


def test_down_by_another_session_refuses_unless_taken(layout, other):
    require(os.geteuid() == 0, "python -m dtk.lab down needs root")
    held_by(layout, other.pid, user="bob")
    env = {"DTK_LAB_DIR": str(layout.root)}
    refused = run_main("dtk.lab", "down", "--force", env=env)
    assert refused.returncode == 2, refused
    assert refused.stderr.startswith("error: the lab is in use by another session: bob's sleep 300")
    assert len(refused.stderr.splitlines()) == 1 and "Traceback" not in refused.stderr
    assert layout.session.exists()
    taken = run_main("dtk.lab", "down", "--take", env=env)
    assert taken.returncode == 0, taken
    assert "lab is not up" in taken.stdout and not layout.session.exists()


def from_another_session(tmp_path, *args: str) -> tuple[int, str]:
    """`python -m dtk.lab ARGS` run by a process outside this test session: started in the
    background by a shell that exits at once, so no process of pytest is above it."""
    env = {k: v for k, v in os.environ.items() if k != session.SESSION_ENV}
    out, code = tmp_path / "out", tmp_path / "rc"
    code.unlink(missing_ok=True)
    argv = " ".join([sys.executable, "-m", "dtk.lab", *args])
    subprocess.run(["sh", "-c", f"(cd {REPO} && {argv} > {out} 2>&1; echo $? > {code}.tmp; mv {code}.tmp {code}) &"],
                   env=env, check=True)
    deadline = time.monotonic() + 120
    while not code.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return int(code.read_text()), out.read_text()


@pytest.mark.slurm
@pytest.mark.slow
def test_the_labs_up_and_down_from_another_session_are_refused_and_change_nothing(lab, tmp_path):
    layout = lab.layout
    held = session.holder(layout)
    assert held is not None and held.pid == os.getpid()
    daemons_before = read_record(layout).daemons
    for args in (("up", "--nodes", "2"), ("up", "--nodes", "3", "--preempt-mode", "cancel"), ("down", "--force")):
        code, out = from_another_session(tmp_path, *args)
        assert code == 2, out
        assert out.startswith("error: the lab is in use by another session: "), out
        assert f"(pid {os.getpid()}," in out and len(out.splitlines()) == 1, out
    record = read_record(layout)
    assert record.daemons == daemons_before and record.preempt_mode == "requeue" and record.num_nodes == 3
    assert session.holder(layout) == held
