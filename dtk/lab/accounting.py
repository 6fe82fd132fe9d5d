"""Slurm accounting for the lab: a MariaDB and a slurmdbd, both on 127.0.0.1, started only
when an access policy charges submitters to an account (AllowAccounts needs it).

Debian's packages serve (apt-get install slurmdbd mariadb-server): the database lives in
the lab directory, is created fresh each time accounting starts, and listens on a port of
its own, so a MariaDB the machine may run is left alone. Both daemons go into the lab's
record, so `lab down` stops them with the rest.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from dtk.lab import daemons
from dtk.lab.daemons import Daemon
from dtk.lab.files import LabLayout, SystemFiles
from dtk.lab.programs import LabError, Log, find_program, program, slurm

PACKAGES = ("slurmdbd", "mariadb-server")
PROGRAMS = ("slurmdbd", "sacctmgr", "mariadbd", "mariadb-install-db", "mariadb")
DB_PORT = 17306
DBD_PORT = 16819
DB_USER, DB_PASS, DB_NAME = "slurm", "dtklab", "slurm_acct_db"
CLUSTER = "dtklab"  # ClusterName in slurm_templates/slurm.conf.tmpl

CONF_LINES = (
    "AccountingStorageType=accounting_storage/slurmdbd",
    "AccountingStorageHost=localhost",
    f"AccountingStoragePort={DBD_PORT}",
    # A job of a user without an association (user, account) in the database is refused.
    "AccountingStorageEnforce=associations",
)


def missing() -> list[str]:
    return [name for name in PROGRAMS if find_program(name) is None]


def ensure_installed(install: bool, log: Log) -> None:
    if not missing():
        return
    why = "the access policy charges submitters to a Slurm account, which needs accounting"
    if not install:
        raise LabError(f"{why}: {', '.join(missing())} not found and --no-install was given; install them"
                       f" (apt-get install {' '.join(PACKAGES)}) or drop submitter.account from the policy")
    log(f"installing {' '.join(PACKAGES)} with apt-get ({why})")
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
    if shutil.which("apt-get") is None or subprocess.run(cmd, check=False).returncode != 0 or missing():
        raise LabError(f"{why}: could not install {' '.join(PACKAGES)} ({', '.join(missing())} missing);"
                       " install them, or drop submitter.account from the policy (AllowGroups alone needs no"
                       " accounting)")


def db_dir(layout: LabLayout) -> Path:
    return layout.root / "accounting"


def start(layout: LabLayout, log: Log) -> list[Daemon]:
    """A fresh database and the slurmdbd in front of it; returns both daemons."""
    folder = db_dir(layout)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    shutil.chown(folder, "mysql", "mysql")
    _run([program("mariadb-install-db"), "--no-defaults", "--user=mysql", f"--datadir={folder / 'data'}",
          "--auth-root-authentication-method=socket", "--skip-test-db"], "mariadb-install-db")
    sock, pid_file = folder / "mysqld.sock", folder / "mysqld.pid"
    # mariadbd stays in the foreground: the shell starts it in the background and exits,
    # which is the detaching that daemons.start expects.
    argv = [program("mariadbd"), "--no-defaults", "--user=mysql", f"--datadir={folder / 'data'}",
            f"--socket={sock}", f"--pid-file={pid_file}", f"--port={DB_PORT}", "--bind-address=127.0.0.1",
            f"--log-error={folder / 'mariadb.log'}", "--innodb-buffer-pool-size=32M"]
    db = daemons.start("mariadbd", ["sh", "-c", " ".join(argv) + " >/dev/null 2>&1 &"], pid_file,
                       output=folder / "startup.log", log=folder / "mariadb.log", timeout_s=30)
    started = [db]
    try:
        _wait(lambda: _sql(sock, "select 1").returncode == 0, 30, f"MariaDB on {sock}", folder / "mariadb.log")
        grants = "; ".join(f"create user '{DB_USER}'@'{h}' identified by '{DB_PASS}'; grant all on {DB_NAME}.*"
                           f" to '{DB_USER}'@'{h}'" for h in ("localhost", "127.0.0.1"))
        proc = _sql(sock, grants)
        if proc.returncode != 0:
            raise LabError(f"MariaDB refused the slurm user: {proc.stderr.strip()}")
        conf = layout.root / "slurmdbd.conf"  # slurmdbd reads it beside $SLURM_CONF
        conf.write_text("\n".join([
            "# Written by dtk.lab (python -m dtk.lab up --access): the lab's accounting daemon.",
            "AuthType=auth/munge", "DbdHost=localhost", "DbdAddr=127.0.0.1", f"DbdPort={DBD_PORT}",
            "SlurmUser=root", "StorageType=accounting_storage/mysql", "StorageHost=127.0.0.1",
            f"StoragePort={DB_PORT}", f"StorageUser={DB_USER}", f"StoragePass={DB_PASS}", f"StorageLoc={DB_NAME}",
            f"LogFile={layout.log_dir / 'slurmdbd.log'}", f"PidFile={layout.pid_dir / 'slurmdbd.pid'}", ""]))
        conf.chmod(0o600)  # slurmdbd refuses a config others can read: it holds the password
        started.append(daemons.start("slurmdbd", ["env", f"SLURM_CONF={layout.conf}", program("slurmdbd")],
                                     layout.pid_dir / "slurmdbd.pid", output=folder / "startup.log",
                                     log=layout.log_dir / "slurmdbd.log", timeout_s=30))
    except Exception:
        daemons.stop(started)
        raise
    log(f"accounting is up: MariaDB on 127.0.0.1:{DB_PORT}, slurmdbd on :{DBD_PORT} (data in {folder})")
    return started


def associate(system: SystemFiles, *, account: str, users: list[str]) -> None:
    """Register the cluster, the account and each user in it (their default account)."""
    _wait(lambda: _sacctmgr(system, ["list", "cluster"]).returncode == 0, 30, "slurmdbd", None)
    for args in (["add", "cluster", CLUSTER], ["add", "account", account, f"cluster={CLUSTER}"],
                 *(["add", "user", user, f"account={account}", f"cluster={CLUSTER}"] for user in users)):
        proc = _sacctmgr(system, args)
        said = proc.stdout + proc.stderr
        # Registered by an earlier `up --access` of this lab: an `up` again adds only what is new.
        if proc.returncode != 0 and "Nothing new added" not in said and "already exists" not in said:
            raise LabError(f"sacctmgr {' '.join(args)}: {(proc.stderr or proc.stdout).strip()}")


def _sacctmgr(system: SystemFiles, args: list[str]) -> subprocess.CompletedProcess:
    return slurm(["sacctmgr", "-i", *args], system)


def _sql(sock: Path, statement: str) -> subprocess.CompletedProcess:
    return subprocess.run([program("mariadb"), "--no-defaults", "-S", str(sock), "-u", "root", "-e", statement],
                          capture_output=True, text=True, timeout=30, check=False)


def _run(argv: list[str], what: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    if proc.returncode != 0:
        raise LabError(f"{what} failed: {(proc.stderr or proc.stdout).strip()[-300:]}")


def _wait(ready, timeout_s: float, what: str, log: Path | None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.3)
    raise LabError(f"{what} not ready after {timeout_s:.0f} s" + (f": {daemons.tail(log)}" if log else ""))
