"""The run directory: the one place a run lives, on storage every node sees.

    <run.root>/<run.name>/
        config.yaml       resolved configuration
        plan.json         the plan of the latest submission (what workers read)
        plan.md           the topology scheme of the latest submission: mesh, placement, memory, traffic
        mesh.json         the mesh the workers built (every rank's node and axis groups), per start
        metrics.jsonl     one line per step, written by global rank 0; a redone step appears again
        events.jsonl      lifecycle events, appended by the driver and by rank 0
        heartbeat         touched by rank 0 as training progresses; the driver watches its mtime
        progress          rank 0: its start and last completed optimizer step, rewritten each step
        checkpoints/step_NNNNNNNN/   complete only once manifest.json exists (with checkpoint.dir=s3://...,
                                     in the object store instead: dtk.common.storage)
        logs/start_NN/rank_R.log     worker output per start
        summary.json      written at the end (finished, failed or stopped)
        tracker.json      rank 0: the id of the run's MLflow / W&B run and the last step logged to it
        wandb/            W&B's own files (train.tracker=[wandb]), offline runs included
        stop_request.json written by `python -m dtk.stop`; the driver acts on it and removes it
    <run.root>/readmitted_nodes.json   nodes given back to the whole root (dtk/launch/reputation.py)

No torch here: the login node and the driver read run directories too.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Every name in a run directory, defined here only (tests/test_rundir_names.py holds the
# rest of dtk to it): writers and readers on the login node, the driver and the workers
# meet on these.
CONFIG_YAML = "config.yaml"
PLAN_JSON = "plan.json"
PLAN_MD = "plan.md"
MESH_FILE = "mesh.json"
TOPOLOGY_JSON = "topology.json"
DATA_SPLIT = "data.json"  # a user dataset's split
METRICS = "metrics.jsonl"
EVAL_LOG = "eval.jsonl"
SYSTEM_LOG = "system.jsonl"
EVENTS = "events.jsonl"
HEARTBEAT = "heartbeat"
PROGRESS = "progress"  # rank 0: "<start> <last completed optimizer step>", rewritten after every step
SUMMARY = "summary.json"
STOP_REQUEST = "stop_request.json"
RUN_LOCK = "lock"
EXCLUDED_NODES = "excluded_nodes.json"  # nodes the driver excludes from later starts, and why
EXCLUDED_NODES_LOCK = "excluded_nodes.lock"
# In the run root, not a run directory: each node's last readmission to the whole root
# (`python -m dtk.nodes RUN_ROOT --readmit NODE`); only later exclusions make it suspect
# again (dtk/launch/reputation.py).
READMITTED_NODES = "readmitted_nodes.json"
READMITTED_NODES_LOCK = ".readmitted_nodes.lock"
SRUN_LOG = "srun.log"  # in a start's log folder: the Slurm step's own output
WORKER_ERROR = "error_rank_{rank}.json"  # in a start's log folder: the exception a worker died of (dtk/worker/failure.py)
USER_CODE_ERROR = "user_code_error"  # the event: the same exception in user code ended two starts in a row
HEALTH_DIR = "health"  # a spare node's health check beats, one file per node
TENSORBOARD_DIR = "tensorboard"
TRACKER_STATE = "tracker.json"  # per tracker: its run id (reused by every start) and the last step it holds
WANDB_DIR = "wandb"  # W&B writes <run dir>/wandb/ when given dir=<run dir>
LOGS_DIR = "logs"
FORKSERVER_LOG = "forkserver.log"  # in LOGS_DIR: the local driver's worker fork server (dtk.worker.forkserver)
CHECKPOINTS_DIR = "checkpoints"
CHECKPOINT_DIR_RE = re.compile(r"^step_(\d{8})$")
MANIFEST = "manifest.json"  # in a checkpoint folder, written last: the commit
TRAINER_STATE = "trainer.json"  # in a checkpoint folder: step, data position, schedule

# What metrics.jsonl records name: written by the workers (dtk.train), read by the report.
PHASES = ("data", "forward", "backward", "optimizer", "comm", "checkpoint", "straggler")
"""The phases of metrics.jsonl, in step order."""
IDLE_PHASES = ("data", "comm", "checkpoint", "straggler")
"""Phases in which the accelerator waits: idle_share = their sum / step time."""
PLAN_KEYS = ("steps",)  # in every plan.json dtk wrote; status and report read no other key for sure


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON line with a single write, so concurrent writers never interleave lines."""
    line = (json.dumps(record, sort_keys=False, default=str) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """Records of a JSONL file; a torn last line (a writer killed mid-write) is skipped."""
    try:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    continue
    except FileNotFoundError:
        return


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON so that readers see the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=2, sort_keys=True, default=str)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


MEMORY_STORE_ENV = "DTK_MEMORY_STORE_ROOT"  # the in-memory snapshot tier's root; tests point it elsewhere
"""Unset: /dev/shm. The tier's store of a run on a node is <root>/dtk-<uid>/<run key>/<node>/."""
MEMORY_STORE_REFUSED = "memory_store_refused"  # the event: a store root another user owns or can write


def memory_store(run_path: Path) -> Path:
    """This run's in-memory snapshot store (all nodes' folders below it; each node sees its own
    /dev/shm): keyed by a hash of the run directory's absolute path, so a node's store never
    holds another run's state (the run lock keeps two jobs out of one run directory)."""
    import hashlib

    root = Path(os.environ.get(MEMORY_STORE_ENV) or "/dev/shm") / f"dtk-{os.getuid()}"
    return root / hashlib.sha256(str(Path(run_path).resolve()).encode()).hexdigest()[:16]


def remove_memory_store(run_path: Path) -> None:
    """Delete this node's part of the run's snapshot store (a finished, stopped or ended run)."""
    import shutil

    shutil.rmtree(memory_store(run_path), ignore_errors=True)


@dataclass(frozen=True)
class RunDir:
    path: Path

    @property
    def config_yaml(self) -> Path:
        return self.path / CONFIG_YAML

    @property
    def plan_json(self) -> Path:
        return self.path / PLAN_JSON

    def read_plan(self, *, key: str = "RUN_DIR") -> dict[str, Any]:
        """plan.json as a dict, refused unless it is dtk's (of any version: the keys every
        plan has): a folder that is not a run directory is the user's mistake."""
        from dtk.common.errors import UserError

        where = f"{key}={self.path}"
        if not self.plan_json.is_file():
            raise UserError(f"{where}: not a dtk run directory (no plan.json); run directories live under run.root")
        try:
            plan = json.loads(self.plan_json.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UserError(f"{where}: its plan.json does not parse ({exc}); not a dtk run directory, or a damaged one"
                            ) from None
        missing = [k for k in PLAN_KEYS if not isinstance(plan, dict) or k not in plan]
        if missing:
            raise UserError(f"{where}: its plan.json is not a dtk plan (no {', '.join(missing)});"
                            " run directories live under run.root")
        return plan

    @property
    def metrics(self) -> Path:
        return self.path / METRICS

    @property
    def events(self) -> Path:
        return self.path / EVENTS

    @property
    def summary(self) -> Path:
        return self.path / SUMMARY

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS_DIR

    @property
    def stop_request(self) -> Path:
        return self.path / STOP_REQUEST

    def read_stop_request(self) -> dict[str, Any] | None:
        """What `python -m dtk.stop` asked for (`by`, `now`, `time`), or None. A request
        older than the run's latest submission was left behind by a stop that never took
        effect (it timed out, the run ended first, its driver died): it is removed here and
        stops nothing, so it never acts on a later start."""
        try:
            request = json.loads(self.stop_request.read_text())
            asked = float(request.get("time") or self.stop_request.stat().st_mtime)
        except (FileNotFoundError, json.JSONDecodeError, AttributeError, TypeError, ValueError):
            return None
        submitted = [float(e["time"]) for e in read_jsonl(self.events) if e.get("event") == "submitted" and "time" in e]
        if submitted and asked < submitted[-1]:
            self.stop_request.unlink(missing_ok=True)
            return None
        return request

    def checkpoint_dir(self, step: int) -> Path:
        return self.checkpoints / f"step_{step:08d}"

    def log_dir(self, start: int) -> Path:
        return self.path / LOGS_DIR / f"start_{start:02d}"

    def worker_error(self, start: int, rank: int) -> Path:
        """The record of the exception rank `rank` of start `start` died of (WORKER_ERROR)."""
        return self.log_dir(start) / WORKER_ERROR.format(rank=rank)

    def event(self, event: str, **details: Any) -> None:
        append_jsonl(self.events, {"time": round(time.time(), 3), "event": event, **details})

    def events_list(self) -> list[dict[str, Any]]:
        return list(read_jsonl(self.events))

    def starts(self) -> int:
        """How many times workers of this run have been started so far."""
        return sum(1 for e in read_jsonl(self.events) if e.get("event") == "started")

    def latest_metrics(self) -> dict[int, dict[str, Any]]:
        """Per step, the latest record (a step redone after a restart replaces the earlier one)."""
        return {int(r["step"]): r for r in read_jsonl(self.metrics) if "step" in r}

    def read_summary(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.summary.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None


def read_progress(run: RunDir) -> tuple[int, int] | None:
    """(start, last completed optimizer step) from rank 0's RUN_DIR/progress; None when
    no start wrote one yet (or a run from an older dtk)."""
    try:
        words = (run.path / PROGRESS).read_text().split()
    except FileNotFoundError:
        return None
    if len(words) != 2 or not all(w.isdigit() for w in words):
        return None
    return int(words[0]), int(words[1])
