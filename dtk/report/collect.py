"""Where a run stands, collected from its directory and Slurm: state, step, loss, checkpoints,
restarts by cause, every start, memory, divergence and the audit's newest entries. What
`python -m dtk.status` prints and the handover's status.json holds. No torch (login node)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dtk.checkpoint.manifest import list_checkpoints
from dtk.common import audit
from dtk.common.errors import UserError
from dtk.common.processes import driver_alive
from dtk.common.rundir import RunDir, read_jsonl, read_progress
from dtk.common.storage import StoreUnreachable
from dtk.report import starts as start_history

ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "RESIZING", "SUSPENDED"}


def _slurm_state(job_id: str, slurm) -> tuple[str | None, str | None]:
    """(state, None), or (None, why) when Slurm did not answer; (None, None) where there
    are no Slurm commands: then the run directory says what it can."""
    from dtk.launch.slurmctl import LOGIN_RETRY_S, Slurm, SlurmUnavailable

    try:
        return (slurm or Slurm(retry_s=LOGIN_RETRY_S)).job_state(job_id), None
    except UserError:
        return None, None
    except SlurmUnavailable as exc:
        return None, str(exc)


def collect(run: RunDir, *, slurm=None) -> dict[str, Any]:
    plan = run.read_plan()
    events = run.events_list()
    summary = run.read_summary()
    starts = [e for e in events if e.get("event") == "started"]
    fabrics = [e for e in events if e.get("event") == "topology"]
    job_ids = list(dict.fromkeys(str(e["job_id"]) for e in events if e.get("job_id")))
    slurm_ids = [j for j in job_ids if not j.startswith("local-")]
    last_job = slurm_ids[-1] if slurm_ids else None
    job_state, slurm_error = _slurm_state(last_job, slurm) if last_job else (None, None)

    last_event = events[-1]["event"] if events else None
    if job_state in ACTIVE:
        state = "pending" if job_state in ("PENDING", "REQUEUED", "REQUEUE_HOLD", "CONFIGURING") else "running"
    elif summary and summary.get("status") in ("finished", "failed", "stopped") and last_event == summary["status"]:
        state = summary["status"]
    elif starts and not last_job and driver_alive(starts[-1]):
        state = "running"
    elif slurm_error:
        state = "unknown"
    elif not starts:
        state = "pending" if last_job else "submitted"
    else:
        state = "stopped"
    lines = list(read_jsonl(run.metrics))
    # Where the run is now: the newest record. During a redo after a restart, the larger
    # steps on record are the dead start's.
    current = next((r for r in reversed(lines) if "step" in r), None)
    last_step = int(current["step"]) if current else 0
    # Records reach the file once per train.log_every; rank 0's progress file has the last
    # completed step of the newest start (dtk.driver.record).
    progress = read_progress(run)
    started = [e for e in events if e.get("event") == "started"]
    if progress is not None and started and progress[0] == started[-1].get("restart"):
        last_step = progress[1]
    max_restarts = _max_restarts(plan)
    history = start_history.history(events, lines, max_restarts=max_restarts)
    # Sizes against the manifest, not checksums: status must stay quick on large checkpoints
    # (python -m dtk.checkpoint list RUN_DIR reads every byte).
    try:
        complete = [c.step for c in list_checkpoints(run, checksums=False) if c.verified]
        store_error = None
    except StoreUnreachable as exc:  # checkpoint.dir's object store did not answer from here
        complete, store_error = [], str(exc)
    return {
        "run_dir": str(run.path),
        "state": state,
        "slurm_state": job_state,
        "slurm_error": slurm_error,
        "store_error": store_error,
        "step": last_step,
        "total_steps": plan["steps"],
        "loss": current.get("loss") if current else None,
        "last_checkpoint": complete[-1] if complete else None,
        "restarts": max(0, len(starts) - 1),
        "restarts_by_cause": _by_cause(history),
        "relaunches_left": history[-1]["budget_left"] if history else max_restarts,
        "job_ids": job_ids,
        "starts": history,
        # The latest start's fabric: what its workers chose before their process group.
        "fabric": {k: fabrics[-1][k] for k in ("restart", "transport", "interface", "master_addr") if k in fabrics[-1]}
        if fabrics else None,
        "error": summary.get("error") if summary and state == "failed" else None,
        "stopped_by": summary.get("stopped_by") if summary and state == "stopped" else None,
        "final_loss": summary.get("final_loss") if summary and state == "finished" else None,
        "memory": _memory(summary.get("memory") if summary and state == "finished" else None),
        "divergence": _divergence(events),
        **_audit(run.path, plan.get("run_name", run.path.name)),
    }


def _audit(run_dir: Path, name: str) -> dict[str, Any]:
    """The run's genuine audit entries, and what is wrong with the run root's log."""
    log = audit.verify(audit.run_root_of(run_dir))
    return {"audit": [e for e in log.entries if e.get("run") == name], "audit_problems": log.problems}


def _memory(memory: dict[str, Any] | None) -> dict[str, Any] | None:
    """The largest rank's measured memory against that same rank's plan (summary.json's
    `memory`; a summary of an older dtk put the largest plan of any rank beside it)."""
    if not memory or memory.get("gap") is None:
        return None
    out = {k: memory[k] for k in ("device", "predicted_bytes", "measured_bytes", "gap", "mismatch_ranks")}
    ranks = [r for r in memory.get("ranks") or [] if r.get("measured_bytes") is not None]
    if ranks:
        worst = max(ranks, key=lambda r: r["measured_bytes"])
        out.update({k: worst[k] for k in ("predicted_bytes", "measured_bytes", "gap")}, rank=worst["rank"])
    return out


def _max_restarts(plan: dict[str, Any]) -> int:
    """fault.max_restarts of the run, from its plan.json (the schema's default for a plan
    written without its config)."""
    fault = plan["config"]["fault"] if "config" in plan and "fault" in plan["config"] else {}
    if "max_restarts" in fault:
        return int(fault["max_restarts"])
    from dtk.config.schema import FaultConfig

    return FaultConfig().max_restarts


def _divergence(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Skipped updates and rollbacks of a divergence (dtk.train.divergence)."""
    return {
        "skipped_steps": [e["step"] for e in events if e.get("event") == "skipped_update"],
        "rollbacks": [{k: e.get(k) for k in ("step", "last_bad_step", "cause", "to_step", "data_window")}
                      for e in events if e.get("event") == "rolled_back"],
    }


def _by_cause(history: list[dict[str, Any]]) -> dict[str, int]:
    """Restarts counted by the kind of their cause (the words before any colon)."""
    counts: dict[str, int] = {}
    for start in history[1:]:
        kind = start["cause"].split(":")[0].split(" (")[0]
        counts[kind] = counts.get(kind, 0) + 1
    return counts
