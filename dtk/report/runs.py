"""A run directory read once into plain records, for the report and the goodput account."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtk.common.errors import UserError
from dtk.common.rundir import EVAL_LOG, PLAN_JSON, SYSTEM_LOG, RunDir, read_jsonl


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
    evals: list[dict[str, Any]] = field(default_factory=list)
    """The validation records of eval.jsonl (step, val_loss, val_NAME ...), in file order."""
    label: str = ""
    """What the report calls the run beside others: the keys in which its config differs
    from theirs (`optim.lr=0.001`), else its name (see `label_by_differences`)."""

    @property
    def latest(self) -> dict[int, dict[str, Any]]:
        """Per step, the record that counts (the later of a step logged twice)."""
        return {int(r["step"]): r for r in self.metric_lines if "step" in r}

    @property
    def losses(self) -> dict[int, float]:
        return {step: float(r["loss"]) for step, r in sorted(self.latest.items()) if r.get("loss") is not None}

    def events_named(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == name]


HANDOVER_RUN = "run"
"""Where a handover folder (python -m dtk.handover) keeps the records of its run."""


def load_run(path: Path, *, key: str = "RUN_DIR") -> RunData:
    """Read a run directory, or the run a handover folder carries; a folder that is neither
    is the user's mistake."""
    if not path.is_dir():
        raise UserError(f"{key}={path}: no such directory")
    if not (path / PLAN_JSON).is_file() and (path / HANDOVER_RUN / PLAN_JSON).is_file():
        path = path / HANDOVER_RUN
    run = RunDir(path)
    plan = run.read_plan(key=key)
    data = RunData(
        path=path,
        name=path.parent.name if path.name == HANDOVER_RUN and (path.parent / "README.md").is_file() else path.name,
        plan=plan,
        metric_lines=[r for r in read_jsonl(run.metrics) if "step" in r],
        events=list(read_jsonl(run.events)),
        summary=run.read_summary(),
        system=list(read_jsonl(path / SYSTEM_LOG)),
        evals=[r for r in read_jsonl(path / EVAL_LOG) if "step" in r],
    )
    data.label = data.name
    return data


def load_baseline(path: Path) -> RunData:
    """The run a comparison is made against: a run directory, or a handover folder, that
    logged steps (a folder with a plan alone, like a handover's config/, has nothing to
    compare)."""
    run = load_run(path, key="--baseline")
    if not run.metric_lines:
        where = " (a handover's config/ folder: give the handover folder itself)" if (path.name == "config") else ""
        raise UserError(f"--baseline {path}: holds no logged step (no metrics.jsonl){where}; a baseline is a run"
                        " directory, or a handover folder, of a run that trained")
    return run


# Where a run lives and how it was submitted differ between runs without making them other runs.
_NOT_LABELS = ("run.", "submit.")


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict) and node:
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): node}


def _text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return json.dumps(value, separators=(",", ":")) if isinstance(value, (list, dict)) else str(value)


def flat_config(run: RunData) -> dict[str, Any]:
    """The run's config as `section.key` -> value, less where it lives and how it was submitted."""
    return {k: v for k, v in _flat(run.plan.get("config") or {}).items() if not k.startswith(_NOT_LABELS)}


def label_by_differences(runs: list[RunData]) -> None:
    """Name each of several runs (a sweep) by the config keys whose values differ among them
    (`optim.lr=0.001, train.seed=2`), the same keys for every run; a run alone, or runs that
    differ in no key, keep their names."""
    flats = [_flat(r.plan.get("config") or {}) for r in runs]
    if not flats:
        return
    same = {k for k, v in flats[0].items() if all(k in f and f[k] == v for f in flats)}
    keys = sorted(k for k in {k for f in flats for k in f} - same if not k.startswith(_NOT_LABELS))
    for run, flat in zip(runs, flats, strict=True):
        run.label = ", ".join(f"{k}={_text(flat.get(k))}" for k in keys) if len(runs) > 1 and keys else run.name
