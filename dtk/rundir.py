"""The run directory: the one place a run lives, on storage every node sees.

    <run.root>/<run.name>/
        config.yaml       resolved configuration
        plan.json         the plan of the latest submission (what workers read)
        plan.md           the topology scheme of the latest submission: mesh, placement, memory, traffic
        mesh.json         the mesh the workers built (every rank's node and axis groups), per start
        metrics.jsonl     one line per step, written by global rank 0; a redone step appears again
        events.jsonl      lifecycle events, appended by the driver and by rank 0
        heartbeat         touched by rank 0 as training progresses; the driver watches its mtime
        checkpoints/step_NNNNNNNN/   complete only once manifest.json exists
        logs/start_NN/rank_R.log     worker output per start
        summary.json      written at the end (finished, failed or stopped)
        stop_request.json written by `python -m dtk.stop`; the driver acts on it and removes it

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

CHECKPOINT_DIR_RE = re.compile(r"^step_(\d{8})$")
MANIFEST = "manifest.json"
HEARTBEAT = "heartbeat"
STOP_REQUEST = "stop_request.json"
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


@dataclass(frozen=True)
class RunDir:
    path: Path

    @property
    def config_yaml(self) -> Path:
        return self.path / "config.yaml"

    @property
    def plan_json(self) -> Path:
        return self.path / "plan.json"

    def read_plan(self) -> dict[str, Any]:
        """plan.json as a dict, refused unless it is dtk's (of any version: the keys every
        plan has): a folder that is not a run directory is the user's mistake."""
        from dtk.errors import UserError

        where = f"RUN_DIR={self.path}"
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
        return self.path / "metrics.jsonl"

    @property
    def events(self) -> Path:
        return self.path / "events.jsonl"

    @property
    def summary(self) -> Path:
        return self.path / "summary.json"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def stop_request(self) -> Path:
        return self.path / STOP_REQUEST

    def read_stop_request(self) -> dict[str, Any] | None:
        """What `python -m dtk.stop` asked for (`by`, `now`, `time`), or None."""
        try:
            return json.loads(self.stop_request.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def checkpoint_dir(self, step: int) -> Path:
        return self.checkpoints / f"step_{step:08d}"

    def log_dir(self, start: int) -> Path:
        return self.path / "logs" / f"start_{start:02d}"

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

    def checkpoint_steps(self) -> list[tuple[int, Path, bool]]:
        """(step, folder, complete) for every checkpoint folder, oldest first."""
        if not self.checkpoints.is_dir():
            return []
        found = []
        for child in self.checkpoints.iterdir():
            m = CHECKPOINT_DIR_RE.match(child.name)
            if m and child.is_dir():
                found.append((int(m.group(1)), child, (child / MANIFEST).is_file()))
        return sorted(found)

    def read_summary(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.summary.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None


def pid_alive(pid: int) -> bool:
    """Whether a process of this pid exists on this host (0 or less: no pid was recorded, not
    the caller's process group, which os.kill(0, 0) would ask about)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, owned by someone else
    return True
