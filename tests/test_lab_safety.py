"""A machine's own Slurm is never disturbed by the lab.

`python -m dtk.lab up` is run for real on a stand-in of this machine's configuration:
$DTK_LAB_ETC holds the slurm.conf, hosts and resolv.conf that the lab would read and
write, and $DTK_LAB_DIR its own folder, both under tmp_path. The processes are real ones
named like Slurm's. So these tests exercise the code path of a real `up` and can run
while the real lab serves other tests: the lab refuses before it writes, installs or stops
anything, and what it stops is chosen by ownership, never by name.
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from conftest import REPO, require
from dtk import lab
from dtk.common.processes import process_start
from dtk.lab import daemons, dns, files, ownership
from lab_support import end_process_tree, named_process

FOREIGN_CONF = "ClusterName=site\nSlurmctldHost=ctl01\n"


@pytest.fixture
def machine(tmp_path):
    """(environment for `python -m dtk.lab`, stand-in /etc) with a fake apt-get first on a
    PATH that lacks the Slurm clients: an `up` that reached its install step would call it."""
    require(os.geteuid() == 0, "the lab commands need root")
    etc = tmp_path / "etc"
    (etc / "slurm").mkdir(parents=True)
    (etc / "hosts").write_text("127.0.0.1 localhost\n")
    (etc / "resolv.conf").write_text("nameserver 127.0.0.1\n")  # nothing answers there: no SRV record
    fakebin = tmp_path / "fakebin"
    fakebin.mkdir()
    apt = fakebin / "apt-get"
    apt.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'apt-get.called'}\nexit 1\n")
    apt.chmod(0o755)
    env = {"DTK_LAB_ETC": str(etc), "DTK_LAB_DIR": str(tmp_path / "lab"), "PATH": str(fakebin)}
    return env, etc


@pytest.fixture
def reaper():
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        end_process_tree(proc)


def up(env: dict, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m dtk.lab up --nodes 2` on the stand-in machine (SLURM_CONF only when given)."""
    inherited = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
    return subprocess.run([sys.executable, "-m", "dtk.lab", "up", "--nodes", "2"],
                          env={**inherited, **env, **(extra_env or {}), "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=60)


def assert_refused_untouched(result, etc: Path, env: dict, tmp_path: Path) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("error: this machine has a Slurm") and len(result.stderr.splitlines()) == 1
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "apt-get.called").exists(), "up reached apt-get"
    assert not Path(env["DTK_LAB_DIR"]).exists(), "up wrote its folder before refusing"
    assert (etc / "hosts").read_text() == "127.0.0.1 localhost\n"
    return result.stderr


def test_up_with_a_foreign_conf_and_a_slurmstepd_exits_2_before_apt_get(machine, tmp_path, reaper):
    env, etc = machine
    (etc / "slurm" / "slurm.conf").write_text(FOREIGN_CONF)
    dummy = named_process(tmp_path, "slurmstepd")
    reaper.append(dummy)
    stderr = assert_refused_untouched(up(env), etc, env, tmp_path)
    assert f"{etc}/slurm/slurm.conf exists and was not written by dtk.lab" in stderr
    assert f"slurmstepd (pid {dummy.pid}," in stderr
    assert dummy.poll() is None and psutil.Process(dummy.pid).name() == "slurmstepd"
    assert (etc / "slurm" / "slurm.conf").read_text() == FOREIGN_CONF


@pytest.mark.parametrize("program", ["slurmd", "slurmctld", "munged"])
def test_up_refuses_daemons_it_did_not_start(machine, tmp_path, reaper, program):
    env, etc = machine
    dummy = named_process(tmp_path, program)
    reaper.append(dummy)
    stderr = assert_refused_untouched(up(env), etc, env, tmp_path)
    assert f"{program} (pid {dummy.pid}," in stderr
    assert dummy.poll() is None
    assert not (etc / "slurm" / "slurm.conf").exists()


def test_a_recorded_daemon_is_itself_after_the_clock_moves_and_a_reused_pid_is_not(tmp_path, reaper):
    """The lab knows its daemons by pid, start and name. The epoch start that psutil reports
    moves by a whole second when the clock is adjusted, and a lab that took its munged for
    dead stopped coming up; the start in clock ticks after boot does not move."""
    proc = named_process(tmp_path, "munged")
    reaper.append(proc)
    found = daemons.Daemon.of("munged", psutil.Process(proc.pid))
    assert found.start and daemons.is_alive(found)
    assert daemons.is_alive(daemons.Daemon("munged", proc.pid, found.create_time - 1.0, found.start))
    assert daemons.is_alive(daemons.Daemon.from_json(found.to_json()))
    reused = daemons.Daemon("munged", proc.pid, found.create_time - 3600, process_start(1))
    assert not daemons.is_alive(reused)
    assert not daemons.is_alive(daemons.Daemon("munged", proc.pid, found.create_time - 3600))  # an older record
    assert not daemons.is_alive(daemons.Daemon("slurmd", proc.pid, found.create_time, found.start))


def test_up_refuses_a_slurm_conf_named_by_slurm_conf(machine, tmp_path):
    env, etc = machine
    site = tmp_path / "site.conf"
    site.write_text(FOREIGN_CONF)
    stderr = assert_refused_untouched(up(env, {"SLURM_CONF": str(site)}), etc, env, tmp_path)
    assert f"SLURM_CONF={site} names a Slurm config that dtk.lab did not write" in stderr


# -- a configless cluster announced by DNS ---------------------------------------------------

def srv_reply(request: bytes, targets: dict[str, tuple[str, int]]) -> bytes:
    """The answer of a name server that knows `targets` (SRV name -> (host, port))."""
    name, offset, labels = [], 12, request
    while labels[offset]:
        name.append(labels[offset + 1 : offset + 1 + labels[offset]].decode())
        offset += 1 + labels[offset]
    question = request[12 : offset + 5]
    qname = ".".join(name)
    header_id = request[:2]
    if qname not in targets:
        return header_id + struct.pack(">HHHHH", 0x8183, 1, 0, 0, 0) + question  # NXDOMAIN
    host, port = targets[qname]
    target = b"".join(bytes([len(p)]) + p.encode() for p in host.split(".")) + b"\0"
    rdata = struct.pack(">HHH", 0, 0, port) + target
    answer = b"\xc0\x0c" + struct.pack(">HHIH", dns.TYPE_SRV, dns.CLASS_IN, 60, len(rdata)) + rdata
    return header_id + struct.pack(">HHHHH", 0x8180, 1, 1, 0, 0) + question + answer


@pytest.fixture
def name_server():
    """A real name server on a loopback address, port 53; yields its address and the
    records it serves (a dict the test fills)."""
    require(os.geteuid() == 0, "a name server on port 53 needs root")
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    address = f"127.53.{os.getpid() % 250}.{threading.get_ident() % 250 + 1}"
    sock.bind((address, 53))
    sock.settimeout(0.1)
    records: dict[str, tuple[str, int]] = {}
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                request, peer = sock.recvfrom(512)
            except TimeoutError:
                continue
            sock.sendto(srv_reply(request, records), peer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield address, records
    stop.set()
    thread.join()
    sock.close()


def test_srv_lookup_follows_the_search_list(name_server, tmp_path):
    address, records = name_server
    resolv = tmp_path / "resolv.conf"
    resolv.write_text(f"# site resolver\nnameserver {address}\nsearch other.test example.test\n")
    assert dns.slurmctld_records(resolv) is None
    records["_slurmctld._tcp.example.test"] = ("ctl01.example.test", 6817)
    assert dns.slurmctld_records(resolv) == ("_slurmctld._tcp.example.test", ["ctl01.example.test:6817"])


def test_up_refuses_where_dns_names_a_slurm_controller(machine, name_server, tmp_path):
    env, etc = machine
    address, records = name_server
    records["_slurmctld._tcp.example.test"] = ("ctl01.example.test", 6817)
    (etc / "resolv.conf").write_text(f"nameserver {address}\nsearch example.test\n")
    stderr = assert_refused_untouched(up(env), etc, env, tmp_path)
    assert "DNS answers the SRV record _slurmctld._tcp.example.test with ctl01.example.test:6817" in stderr
    assert not (etc / "slurm" / "slurm.conf").exists()


def test_resolver_config_reads_servers_and_the_last_search_line():
    text = "nameserver 10.0.0.1 # main\n; a comment\ndomain a.test\nnameserver 10.0.0.2\nsearch b.test c.test\n"
    assert dns.resolver_config(text) == (["10.0.0.1", "10.0.0.2"], ["b.test", "c.test"])


# -- what is the lab's: by record and by the files it holds, never by name ----------------------

def test_down_stops_the_labs_processes_and_leaves_a_namesake_alone(tmp_path, reaper):
    require(os.geteuid() == 0, "the lab commands need root")
    root = tmp_path / "lab"
    layout = files.LabLayout(root)
    layout.log_dir.mkdir(parents=True)
    layout.marker.touch()
    with (layout.log_dir / "slurmd-node1.log").open("a") as log:
        # A job step of the lab (it holds its node's log, as slurmstepd does) with a task under it.
        step = named_process(tmp_path, "slurmstepd", stdout=log, script="sleep 300 &\nwait\n")
        node = named_process(tmp_path, "slurmd", stdout=log)
    (tmp_path / "elsewhere").mkdir()
    namesake = named_process(tmp_path / "elsewhere", "slurmstepd")  # a slurmstepd that is not the lab's
    reaper += [step, node, namesake]
    task = psutil.Process(step.pid).children()
    census = ownership.census(layout, None)
    assert {p.pid for p in census.steps} == {step.pid, *(t.pid for t in task)} and len(task) == 1
    assert {p.pid for p in census.ours} == {node.pid}
    assert namesake.pid in {p.pid for p in census.foreign}
    lab.down(root=root, force=True, log=lambda _line: None)
    assert step.wait(5) is not None and node.wait(5) is not None
    assert not task[0].is_running() or task[0].status() == psutil.STATUS_ZOMBIE
    assert namesake.poll() is None


def test_a_job_step_holding_no_file_yet_is_the_labs_by_its_working_folder(tmp_path, reaper):
    """A slurmstepd that is starting (or ending) holds no file under the lab's folder, and,
    reparented to init, is no child of a slurmd; it works in its slurmd's folder (the lab's
    log folder), which is what makes it the lab's. Before, such a step made `up` refuse as
    a stranger unless it opened its log within 10 s."""
    require(os.geteuid() == 0, "reading another process's working folder needs root")
    layout = files.LabLayout(tmp_path / "lab")
    layout.log_dir.mkdir(parents=True)
    layout.marker.touch()
    starting = named_process(tmp_path, "slurmstepd", cwd=layout.log_dir)
    (tmp_path / "elsewhere").mkdir()
    namesake = named_process(tmp_path / "elsewhere", "slurmstepd", cwd=tmp_path / "elsewhere")
    reaper += [starting, namesake]
    assert not ownership.holds_file_under(psutil.Process(starting.pid), layout.root)
    census = ownership.census(layout, None)
    assert starting.pid in {p.pid for p in census.steps}
    assert {p.pid for p in ownership.strangers(layout, None)} & {starting.pid, namesake.pid} == {namesake.pid}


def test_a_process_that_is_gone_or_exiting_has_no_working_folder(tmp_path):
    proc = subprocess.Popen(["sleep", "300"], cwd=tmp_path)
    found = psutil.Process(proc.pid)
    assert ownership.working_folder(found) == tmp_path
    proc.kill()
    proc.wait()
    assert ownership.working_folder(found) is None


def test_hosts_is_replaced_whole_keeping_its_mode(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n")
    hosts.chmod(0o644)
    before = hosts.stat().st_ino
    files.ensure_hosts(2, hosts)
    assert hosts.read_text() == f"127.0.0.1 localhost\n127.0.0.1 node1 node2 {files.HOSTS_MARK}\n"
    assert hosts.stat().st_ino != before  # a new file renamed over the old one
    assert hosts.stat().st_mode & 0o777 == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["hosts"]
