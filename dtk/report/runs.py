"""A run directory read once into plain records, for the report and the goodput account."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtk.errors import UserError
from dtk.rundir import RunDir, read_jsonl
from dtk.train.system import SYSTEM_LOG


@dataclass
class RunData:
    """Everything the report reads from one run directory."""

    path: Path
    name: str
    plan: dict[str, Any]
    metric_lines: list[dict[str, Any]]
    """Every metrics.jsonl record in file order, a step redone after a restart included."""
    events: list[dict[str, Any]]
    summary: dict[str, Any] | None
    system: list[dict[str, Any]] = field(default_factory=list)

    @property
    def latest(self) -> dict[int, dict[str, Any]]:
        """Per step, the record that counts (the later of a step logged twice)."""
        return {int(r["step"]): r for r in self.metric_lines if "step" in r}

    @property
    def losses(self) -> dict[int, float]:
        return {step: float(r["loss"]) for step, r in sorted(self.latest.items()) if r.get("loss") is not None}

    def events_named(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == name]


def load_run(path: Path) -> RunData:
    """Read a run directory; a folder that is not one is the user's mistake."""
    if not path.is_dir():
        raise UserError(f"RUN_DIR={path}: no such directory")
    run = RunDir(path)
    plan = run.read_plan()
    return RunData(
        path=path,
        name=path.name,
        plan=plan,
        metric_lines=[r for r in read_jsonl(run.metrics) if "step" in r],
        events=list(read_jsonl(run.events)),
        summary=run.read_summary(),
        system=list(read_jsonl(path / SYSTEM_LOG)),
    )
