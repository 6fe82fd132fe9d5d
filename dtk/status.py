"""python -m dtk.status RUN_DIR [--json]: where a run stands, from its directory and Slurm."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from dtk import audit
from dtk.checkpoint.manifest import list_checkpoints
from dtk.driver.record import read_progress
from dtk.errors import ArgumentParser, UserError, run_cli
from dtk.report import starts as start_history
from dtk.rundir import RunDir, driver_alive, read_jsonl

DESCRIPTION = """State (pending, running, finished, failed, stopped; unknown when Slurm does not answer),
step / total, loss, last complete checkpoint, restarts by cause and the crash/hang relaunches
left, every start with its job id, nodes, cause, the checkpoint step it resumed from, the
steps it redid and the downtime before it (dtk/report/starts.py), and the newest entries of the run root's audit log (who submitted, stopped, drilled,
exported or deleted what, when). Slurm jobs are asked with squeue/scontrol; the rest comes
from the run directory."""

AUDIT_LINES = 10  # the newest audit entries `render` shows; --json has them all
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
    complete = [c.step for c in list_checkpoints(run, checksums=False) if c.verified]
    return {
        "run_dir": str(run.path),
        "state": state,
        "slurm_state": job_state,
        "slurm_error": slurm_error,
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


def render(info: dict[str, Any]) -> str:
    loss = f"{info['loss']:.4f}" if info["loss"] is not None else "-"
    state = info["state"] + (f" (Slurm: {info['slurm_state']})" if info["slurm_state"] else "")
    lines = [
        f"run          {info['run_dir']}",
        f"state        {state}",
        f"step         {info['step']}/{info['total_steps']}  loss {loss}",
        f"checkpoint   {'step ' + str(info['last_checkpoint']) + ' (verified sizes)' if info['last_checkpoint'] is not None else 'none verified yet'}",
        f"restarts     {info['restarts']}"
        + (f" ({', '.join(f'{k} {v}' for k, v in info['restarts_by_cause'].items())})" if info["restarts_by_cause"] else "")
        + f"; crash/hang relaunches left in this allocation: {info['relaunches_left']} (fault.max_restarts)",
    ]
    slurm_jobs = [j for j in info["job_ids"] if not j.startswith("local-")]
    if len(slurm_jobs) > 1:
        lines.append(f"jobs         {' -> '.join(slurm_jobs)} (each one the same run: resubmitted after a preemption"
                     " that cancels, or submitted again)")
    if info["fabric"]:
        fabric = info["fabric"]
        lines.append(f"fabric       {fabric.get('transport')} across nodes over"
                     f" {fabric.get('interface') or 'the interface NCCL/gloo chose'}, master {fabric.get('master_addr')}"
                     f" (start {fabric.get('restart')}; why: topology.json)")
    if info["final_loss"] is not None:
        lines.append(f"final loss   {info['final_loss']:.6f}")
    memory = info["memory"]
    if memory:
        off = f"; plan_mismatch on rank(s) {', '.join(map(str, memory['mismatch_ranks']))}" if memory["mismatch_ranks"] else ""
        rank = f"rank {memory['rank']}, " if "rank" in memory else ""
        lines.append(f"memory       {memory['measured_bytes'] / 1e9:.3f} GB measured on the largest rank against"
                     f" {memory['predicted_bytes'] / 1e9:.3f} GB planned for it ({rank}{memory['gap']:+.0%},"
                     f" {memory['device']}){off}")
    div = info.get("divergence") or {}
    if div.get("skipped_steps"):
        lines.append(f"divergence   {len(div['skipped_steps'])} skipped update(s), at step(s)"
                     f" {', '.join(map(str, div['skipped_steps']))}")
        lines += [f"  rolled back: bad steps {r['step']}-{r['last_bad_step']} ({r['cause']}) -> checkpoint step"
                  f" {r['to_step']}, data window {r['data_window'][0]}-{r['data_window'][1]} skipped"
                  for r in div["rollbacks"]]
    if info["error"]:
        lines.append(f"error        {info['error']}")
    if info["stopped_by"]:
        resume = (f"submitting the same command again resumes from checkpoint step {info['last_checkpoint']}"
                  if info["last_checkpoint"] is not None else "no checkpoint: the same command starts it again")
        lines.append(f"stopped      by {info['stopped_by']}; {resume}")
    if info["slurm_error"]:
        lines.append(f"slurm        did not answer: {info['slurm_error']}")
    lines += [start_history.describe(s) for s in info["starts"]]
    shown = info["audit"][-AUDIT_LINES:]
    if shown:
        more = len(info["audit"]) - len(shown)
        lines.append(f"audit        {audit.AUDIT_DIR}/ in the run root" + (f" ({more} earlier not shown)" if more else ""))
        lines += [f"  {audit.describe(entry)}" for entry in shown]
    if info["audit_problems"]:
        lines.append(f"audit        NOT INTACT: {len(info['audit_problems'])} problem(s)"
                     " (python -m dtk.access audit RUN_ROOT lists them all)")
        lines += [f"  {problem}" for problem in info["audit_problems"][:AUDIT_LINES]]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m dtk.status", description=DESCRIPTION,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="a run directory (under run.root)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if not args.run_dir.is_dir():
        raise UserError(f"RUN_DIR={args.run_dir}: no such directory")
    info = collect(RunDir(args.run_dir))
    print(json.dumps(info, indent=2) if args.json else render(info))
    return 0


if __name__ == "__main__":
    from dtk.access.check import explain_denied

    run_cli(main, on_denied=explain_denied)
