"""The local driver's workers come from its fork server (dtk.worker.forkserver): one process
per run that imported torch once, the parent of every worker, each worker a session of its
own. A driver killed with SIGKILL leaves nothing behind: the server gets SIGTERM from the
kernel when its parent dies, and the workers when theirs does (PR_SET_PDEATHSIG), so no
orphaned worker goes on writing into a run that the same command may start again; the
workers take that SIGTERM as a stop and save first."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from conftest import REPO
from dtk.common.rundir import RunDir, read_progress
from dtk.common.storage import checkpoints_of, committed_steps

# The server's loop with children that play a killed worker and its peer: the victim listens,
# the peer connects and waits; the victim is killed; the peer fails on the broken connection
# and exits 20 ms later (a worker's error path takes at least that).
SERVER = """
import os, signal, socket, sys, time
from dtk.worker.forkserver import serve

def child(request):
    role, path = request["args"]
    sock = socket.socket(socket.AF_UNIX)
    if role == "victim":
        sock.bind(path)
        sock.listen(1)
        conn, _ = sock.accept()
        time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGKILL)
    while True:
        try:
            sock.connect(path)
            break
        except OSError:
            time.sleep(0.005)
    sock.recv(1)
    time.sleep(0.02)
    os._exit(1)

serve(child)
"""


def test_the_server_reports_ends_in_the_order_they_happened(tmp_path):
    """The peer was forked first and ends 20 ms after the victim. Reaped by a sweep every
    0.05 s, both ends usually fell in one sweep and were reported oldest child first, and
    the local driver blamed the peer for the kill; woken by each child's pidfd, the server
    reports the victim's end first."""
    server = subprocess.Popen([sys.executable, "-c", SERVER], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert "ready" in json.loads(server.stdout.readline())
        path = str(tmp_path / "sock")
        for number, role in enumerate(["peer", "victim"]):
            server.stdin.write(json.dumps({"id": number, "args": [role, path], "env": {}, "log": "-"}) + "\n")
            server.stdin.flush()
        pids, ends = {}, {}
        while len(ends) < 2:
            message = json.loads(server.stdout.readline())
            if "id" in message:
                pids[message["pid"]] = ["peer", "victim"][message["id"]]
            else:
                ends[pids[message["exit"]]] = (message["code"], message["at"], len(ends))
    finally:
        server.stdin.close()
        server.wait(timeout=10)
    assert ends["victim"][0] == -signal.SIGKILL and ends["peer"][0] == 1
    assert ends["victim"][1] < ends["peer"][1] and ends["victim"][2] == 0, ends


@pytest.mark.slow
def test_workers_are_forked_by_one_server_and_a_killed_driver_leaves_no_process(tmp_path):
    driver = subprocess.Popen([sys.executable, "-m", "dtk.submit", "tasks_per_node=2", "train.steps=100000",
                               "checkpoint.every=100000", "run.name=r", f"run.root={tmp_path}"], cwd=tmp_path,
                              env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    run = RunDir(tmp_path / "r")
    try:
        deadline = time.monotonic() + 180
        while not (run.path.is_dir() and (read_progress(run) or (0, 0))[1] >= 3):
            assert driver.poll() is None and time.monotonic() < deadline, "the run did not reach step 3"
            time.sleep(0.1)
        pids = [int(p) for p in (run.log_dir(0) / "pids").read_text().split()]
        workers = [psutil.Process(pid) for pid in pids]
        (server,) = {w.parent() for w in workers}
        assert "dtk.worker.forkserver" in " ".join(server.cmdline()) and server.parent().pid == driver.pid
        assert all(os.getsid(pid) == pid for pid in pids)  # a Ctrl-C at the terminal reaches the driver alone

        driver.send_signal(signal.SIGKILL)
        driver.wait()
        gone, alive = psutil.wait_procs([server, *workers], timeout=120)
        assert not alive, [p.cmdline() for p in alive]
        # Their SIGTERM is a stop: they agreed on a step and saved it before they went.
        (stopped,) = [e for e in run.events_list() if e["event"] == "preempted"]
        assert stopped["signal"] == "SIGTERM" and stopped["saved"], stopped
        assert stopped["checkpoint_step"] in committed_steps(checkpoints_of(run))
    finally:
        if driver.poll() is None:
            driver.kill()
        for proc in psutil.process_iter():
            try:
                if str(run.path) in " ".join(proc.cmdline()):
                    proc.kill()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
