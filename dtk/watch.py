"""python -m dtk.watch RUN_ROOT [--once] [--json] [--alert CMD]: a watcher outside the job.

The driver runs inside the job; when it dies, loops or stops answering, nothing in the job
says so. This reads the run directories under a run root (events.jsonl, heartbeat,
excluded_nodes.json, plan.json, summary.json: dtk/common/rundir.py) and names what looks wrong:

    restart_storm     STORM_STARTS starts of a run within STORM_WINDOW_S seconds
    stalled_progress  STALLED_STARTS starts since the run's last new checkpoint
    silent            Slurm (or, for a local run, its driver's process) says running, and
                      the heartbeat is older than SILENT_FACTOR x the timeout that applies
    budget_low        crash/hang relaunches left in the allocation <= BUDGET_LEFT
    spares_exhausted  as many nodes excluded as the run has spares
    suspect_node      a node in the exclusions of cluster.suspect_after or more runs of the
                      root since its readmission there (the rule: dtk/launch/reputation.py)
    invalid_node      a name in a run's exclusions that is no node name (shown escaped;
                      dtk/launch/nodenames.py): left out of every submission

Give it the run root; a run directory is refused with the root to give instead.

Each alert is raised once per condition: the conditions seen are kept in RUN_ROOT/STATE,
an alert is new when its condition was not there at the previous check, and a condition
that clears and comes back is raised again. An alert is a line on stdout (a JSON object
with --json) and, with --alert CMD, the JSON on the command's stdin. It detects, it never
acts. Stdlib only, so cron can run it on a login node without dtk's dependencies.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtk.common.errors import ArgumentParser, UserError, run_cli
from dtk.common.rundir import EVENTS, EXCLUDED_NODES, HEARTBEAT, PLAN_JSON, SUMMARY, read_jsonl, write_json_atomic
from dtk.launch import reputation
from dtk.launch.nodenames import is_node_name, shown

STATE = ".dtk-watch.json"
STORM_STARTS, STORM_WINDOW_S = 3, 600.0
STALLED_STARTS = 3
SILENT_FACTOR = 2.0  # the driver itself acts after one timeout; twice that, it did not
BUDGET_LEFT = 1
EVERY_S = 60.0  # between checks without --once

JobState = Callable[[str], "str | None"]


@dataclass(frozen=True)
class Alert:
    detector: str
    key: str
    """What makes it this condition and no other (detector, run or node)."""
    message: str
    run: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def record(self, now: float) -> dict[str, Any]:
        return {"alert": self.detector, "run": self.run, "time": round(now, 3), "message": self.message,
                **self.details}

    def line(self) -> str:
        return f"watch: {self.detector}{f' run={self.run}' if self.run else ''}: {self.message}"


@dataclass
class Run:
    """What the detectors read of one run directory."""

    path: Path
    events: list[dict[str, Any]]
    plan: dict[str, Any]
    summary: dict[str, Any]
    exclusions: list[str]
    heartbeat: float | None
    entries: list[dict[str, Any]] = field(default_factory=list)
    """excluded_nodes.json as written: the reputation rule reads times and readmissions."""

    @staticmethod
    def read(path: Path) -> Run:
        events = sorted((e for e in read_jsonl(path / EVENTS) if "time" in e), key=lambda e: float(e["time"]))
        try:
            heartbeat: float | None = (path / HEARTBEAT).stat().st_mtime
        except OSError:
            heartbeat = None
        entries = reputation.read_json(path / EXCLUDED_NODES, [])
        exclusions = [e["node"] for e in entries if isinstance(e, dict) and is_node_name(e.get("node"))
                      and "readmitted" not in e]
        return Run(path, events, reputation.read_json(path / PLAN_JSON, {}), reputation.read_json(path / SUMMARY, {}), exclusions, heartbeat,
                   entries)

    @property
    def name(self) -> str:
        return self.path.name

    def times(self, event: str) -> list[float]:
        return [float(e["time"]) for e in self.events if e.get("event") == event]

    def fault(self, key: str) -> float | None:
        """fault.KEY as the run's plan.json resolved it (every plan dtk writes holds it); None
        for a plan without it, whose detectors that need it then say nothing."""
        value = ((self.plan.get("config") or {}).get("fault") or {}).get(key)
        return float(value) if isinstance(value, (int, float)) else None


def runs_under(root: Path) -> list[Run]:
    """Every run directory of the root: a folder with an events.jsonl."""
    return [Run.read(p) for p in sorted(root.iterdir()) if (p / EVENTS).is_file()]


def restart_storm(run: Run, now: float) -> Alert | None:
    starts = run.times("started")[-STORM_STARTS:]
    if len(starts) < STORM_STARTS or starts[-1] - starts[0] > STORM_WINDOW_S:
        return None
    return Alert("restart_storm", f"restart_storm:{run.name}",
                 f"{len(starts)} starts within {starts[-1] - starts[0]:.0f} s (threshold {STORM_STARTS} in"
                 f" {STORM_WINDOW_S:.0f} s); {len(run.times('started'))} starts in all", run.name,
                 {"starts": len(run.times("started")), "window_s": round(starts[-1] - starts[0], 1)})


def stalled_progress(run: Run, now: float) -> Alert | None:
    saved = run.times("checkpoint_saved")
    since = [t for t in run.times("started") if not saved or t > saved[-1]]
    if len(since) < STALLED_STARTS:
        return None
    last = max((int(e.get("step") or 0) for e in run.events if e.get("event") == "checkpoint_saved"), default=None)
    where = f"the last at step {last}" if last is not None else "none yet"
    return Alert("stalled_progress", f"stalled_progress:{run.name}",
                 f"{len(since)} starts since the last new checkpoint ({where})", run.name,
                 {"starts_since_checkpoint": len(since), "last_checkpoint": last})


def silent(run: Run, now: float, job_state: JobState) -> Alert | None:
    started = [e for e in run.events if e.get("event") in ("started", "submitted", "resubmitted")
               and e.get("job_id")]
    if not started or run.summary:
        return None
    job = str(started[-1]["job_id"])
    state = job_state(job)
    if state != "RUNNING":
        return None
    start = run.times("started")[-1] if run.times("started") else float(started[-1]["time"])
    fresh = run.heartbeat is None or run.heartbeat < start  # this start has not beaten yet
    since, timeout = (start, run.fault("startup_timeout_s")) if fresh else (run.heartbeat, run.fault("hang_timeout_s"))
    if timeout is None or since is None:
        return None
    limit = SILENT_FACTOR * timeout
    if now - since <= limit:
        return None
    return Alert("silent", f"silent:{run.name}:{job}",
                 f"job {job} is {state} but the heartbeat is {now - since:.0f} s old (limit {limit:.0f} s)",
                 run.name, {"job_id": job, "silent_s": round(now - since, 1)})


def budget_low(run: Run, now: float) -> Alert | None:
    found = run.fault("max_restarts")
    if found is None:
        return None
    allowed = int(found)
    begun = max(run.times("submitted") + run.times("requeued") + run.times("resubmitted") + [0.0])
    relaunches = [e for e in run.events if e.get("event") == "relaunched" and float(e["time"]) > begun]
    if not relaunches or allowed == 0:
        return None
    left = allowed - int(relaunches[-1].get("attempt") or len(relaunches))
    if left > BUDGET_LEFT:
        return None
    return Alert("budget_low", f"budget_low:{run.name}", f"{left} crash/hang relaunch(es) left of"
                 f" fault.max_restarts={allowed} in this allocation", run.name, {"relaunches_left": left})


def spares_exhausted(run: Run, now: float) -> Alert | None:
    spares = int(run.plan.get("spare_nodes") or 0)
    if not spares or len(run.exclusions) < spares:
        return None
    return Alert("spares_exhausted", f"spares_exhausted:{run.name}",
                 f"{len(run.exclusions)} node(s) excluded ({', '.join(run.exclusions)}) with spare_nodes={spares}:"
                 " the next node failure shrinks or requeues the job", run.name, {"excluded": run.exclusions})


def suspect_nodes(runs: list[Run], root: Path) -> list[Alert]:
    after = reputation.threshold(r.plan for r in runs)
    found = reputation.suspects_of({r.name: r.entries for r in runs}, reputation.read_readmitted(root), after=after)
    return [Alert("suspect_node", f"suspect_node:{node}", f"node {node} is excluded by {len(names)} runs"
                  f" ({', '.join(map(shown, names))}); new submissions under this root leave it out until"
                  f" python -m dtk.nodes {root} --readmit {node}", None, {"node": node, "runs": names})
            for node, names in found.items()]


def invalid_nodes(runs: list[Run]) -> list[Alert]:
    """One alert per name, escaped, that runs of the root exclude but is no node name."""
    found = reputation.invalid_of({r.name: r.entries for r in runs})
    return [Alert("invalid_node", f"invalid_node:{node}", f"{node} in the exclusions of {', '.join(map(shown, names))}"
                  " is no node name (letters, digits, '-', '_', '.', ranges like node[1-3,5]); every submission"
                  " leaves it out", None, {"node": node, "runs": names})
            for node, names in found.items()]


def detect(root: Path, *, now: float, job_state: JobState) -> list[Alert]:
    """Every condition that holds now (a finished run raises none of its own)."""
    runs = runs_under(root)
    alerts: list[Alert] = []
    for run in runs:
        if run.summary.get("status") == "finished":
            continue
        for check in (restart_storm, stalled_progress, budget_low, spares_exhausted):
            alerts += [a for a in [check(run, now)] if a]
        alerts += [a for a in [silent(run, now, job_state)] if a]
    return alerts + suspect_nodes(runs, root) + invalid_nodes(runs)


def job_state(job_id: str) -> str | None:
    """RUNNING, PENDING, ... as Slurm says; a local run's driver is RUNNING while its process
    lives. None: unknown (no such job, or no Slurm here)."""
    if job_id.startswith("local-"):
        try:
            os.kill(int(job_id.removeprefix("local-")), 0)
        except (ValueError, ProcessLookupError):
            return None
        except PermissionError:  # another user's live process
            return "RUNNING"
        return "RUNNING"
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    states = out.stdout.split()
    return states[0] if out.returncode == 0 and states else None


def check(root: Path, *, now: float, job_state: JobState = job_state) -> list[Alert]:
    """The alerts whose condition is new since the previous check; the state file is updated."""
    state_file = root / STATE
    active = reputation.read_json(state_file, {}).get("active", {})
    current = detect(root, now=now, job_state=job_state)
    new = [a for a in current if a.key not in active]
    try:
        write_json_atomic(state_file, {"active": {a.key: active.get(a.key, round(now, 3)) for a in current},
                                       "checked": round(now, 3)})
    except OSError as exc:
        raise UserError(f"RUN_ROOT={root}: cannot keep the watcher's state in {state_file} ({exc.strerror or exc});"
                        " run it as a user who may write the run root") from None
    return new


def deliver(alert: Alert, *, now: float, as_json: bool, command: str | None) -> None:
    record = alert.record(now)
    print(json.dumps(record, sort_keys=True) if as_json else alert.line(), flush=True)
    if command is None:
        return
    try:
        done = subprocess.run(command, shell=True, input=json.dumps(record) + "\n", text=True, timeout=60,
                              capture_output=True)
        if done.returncode:
            print(f"watch: --alert command exited {done.returncode}: {done.stderr.strip()[-200:]}", file=sys.stderr)
    except subprocess.TimeoutExpired:
        print("watch: --alert command did not end within 60 s", file=sys.stderr)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m dtk.watch", description=__doc__.split("\n\n")[1])
    parser.add_argument("run_root", metavar="RUN_ROOT", help="the folder that holds run directories (run.root)")
    parser.add_argument("--once", action="store_true", help=f"check once and exit (for cron); else every {EVERY_S:.0f} s")
    parser.add_argument("--json", action="store_true", help="each alert as one JSON object per line")
    parser.add_argument("--alert", metavar="CMD", help="a shell command run once per new alert, the alert as JSON on stdin")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    root = Path(args.run_root)
    if not root.is_dir():
        raise UserError(f"RUN_ROOT={root}: no such folder; give the run root (run.root) that holds run directories")
    if (root / EVENTS).is_file() or (root / PLAN_JSON).is_file():
        raise UserError(f"RUN_ROOT={root}: is a run directory, not a run root; dtk.watch watches every run of a"
                        f" root: python -m dtk.watch {root.resolve().parent}")
    while True:
        now = time.time()
        for alert in check(root, now=now):
            deliver(alert, now=now, as_json=args.json, command=args.alert)
        if args.once:
            return 0
        time.sleep(EVERY_S)


if __name__ == "__main__":
    run_cli(main)
