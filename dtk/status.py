"""python -m dtk.status RUN_DIR [--json]: where a run stands, from its directory and Slurm."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from dtk.common import audit
from dtk.common.errors import ArgumentParser, UserError, run_cli
from dtk.common.rundir import RunDir
from dtk.report import starts as start_history
from dtk.report.collect import collect

DESCRIPTION = """State (pending, running, finished, failed, stopped; unknown when Slurm does not answer),
step / total, loss, last complete checkpoint, restarts by cause and the crash/hang relaunches
left, every start with its job id, nodes, cause, the checkpoint step it resumed from, the
steps it redid and the downtime before it (dtk/report/starts.py), and the newest entries of the run root's audit log (who submitted, stopped, drilled,
exported or deleted what, when). Slurm jobs are asked with squeue/scontrol; the rest comes
from the run directory."""

AUDIT_LINES = 10  # the newest audit entries `render` shows; --json has them all


def _checkpoint(info: dict[str, Any]) -> str:
    if info["store_error"]:
        return "unknown: the checkpoint store did not answer (below)"
    step = info["last_checkpoint"]
    return f"step {step} (verified sizes)" if step is not None else "none verified yet"


def render(info: dict[str, Any]) -> str:
    loss = f"{info['loss']:.4f}" if info["loss"] is not None else "-"
    state = info["state"] + (f" (Slurm: {info['slurm_state']})" if info["slurm_state"] else "")
    lines = [
        f"run          {info['run_dir']}",
        f"state        {state}",
        f"step         {info['step']}/{info['total_steps']}  loss {loss}",
        f"checkpoint   {_checkpoint(info)}",
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
    if info["store_error"]:  # the checkpoint line above could not look in the store
        lines.append(f"store        did not answer: {info['store_error']}")
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
