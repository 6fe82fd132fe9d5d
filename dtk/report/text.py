"""The printed report: a block of lines per run, then comparisons."""

from __future__ import annotations

from typing import Any

from dtk.common.rundir import IDLE_PHASES, PHASES


def _s(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.1f} s"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def run_block(n: dict[str, Any]) -> list[str]:
    loss = f"{n['final_loss']:.6f}" if n["final_loss"] is not None else "-"
    lines = [
        f"run          {n['run_dir']}" + (f"  ({n['label']})" if n.get("label", n["name"]) != n["name"] else ""),
        f"status       {n['status']}: step {n['step']}/{n['total_steps']}, world size {n['world_size']},"
        f" restarts {n['restarts']}",
        f"final loss   {loss}",
    ]
    v = n.get("validation")
    if v:
        extra = "".join(f", {k} {_fmt(x)}" for k, x in sorted(v["metrics"].items()))
        lines.append(f"validation   val_loss {v['val_loss']:.6f} at step {v['step']}{extra} ({v['evaluations']} evaluation(s);"
                     f" first {v['first_val_loss']:.6f} at step {v['first_step']}, best {v['best_val_loss']:.6f} at"
                     f" step {v['best_step']})")
    else:
        lines.append("validation   - (no eval.jsonl: train.eval_every=0, or no evaluation yet)")
    if n["step_time_s_median"]:
        speed = f"{n['steps_per_s']:.2f} steps/s (median step {_s(n['step_time_s_median'])})"
        if n["samples_per_s"]:
            speed += f", {n['samples_per_s']:,.0f} samples/s"
        if n["tokens_per_s"]:
            speed += f", {n['tokens_per_s']:,.0f} tokens/s"
        lines.append(f"speed        {speed}")
    if n.get("epoch_time_s"):
        lines.append(f"epoch        {_s(n['epoch_time_s'])} per epoch")
    ph = n["phases"]
    if ph:
        parts = "  ".join(f"{p} {_pct(ph['shares'][p])}" for p in IDLE_PHASES)
        lines.append(f"idle share   {_pct(ph['idle_share'])} of step time: {parts} (main: {ph['main_idle']})")
        busy = "  ".join(f"{p} {_pct(ph['shares'][p])}" for p in PHASES if p not in IDLE_PHASES)
        lines.append(f"compute      {busy}")
    else:
        lines.append("idle share   - (no phase timings: train.profile=false, or a run from before profiling)")
    if n["mfu_median"] is not None:
        lines.append(f"MFU          {_pct(n['mfu_median'])} ({n['tflops_median']:.1f} TFLOP/s achieved)")
    elif n["tflops_median"] is not None:
        lines.append(f"MFU          - (peak of this device unknown; {n['tflops_median']:.3f} TFLOP/s achieved)")
    g = n["goodput"]
    if g.get("goodput") is not None:
        parts = ", ".join(f"{k[:-2]} {v:.1f} s" for k, v in g["parts"].items() if v > 0)
        lines.append(f"goodput      {_pct(g['goodput'])} of {g['wall_s']:.1f} s from first submission: {parts}")
        if g["restarts"]:
            lines.append(f"restarts     {g['restarts']}: {g['restart_s']:.1f} s restarting, {g['redone_steps']} step(s)"
                         f" redone ({g['parts']['redone_s']:.1f} s)")
        if g.get("skipped_updates") or g.get("rollbacks"):
            lines.append(f"divergence   {g['skipped_updates']} update(s) skipped, {g['rollbacks']} rollback(s);"
                         " their steps count as redone (events skipped_update, rolled_back)")
    c = n["checkpoints"]
    ck = f"{c['saved']} saved"
    if c["saved"]:
        ck += f" (median {_s(c['save_s_median'])}, blocking {_s(c['blocked_s_median'])}), last at step {c['last_step']}"
    if c["loaded"] or c["rejected"]:
        ck += f"; {c['loaded']} loaded, {c['rejected']} rejected"
    lines.append(f"checkpoints  {ck}")
    if n["stragglers"]:
        for s in n["stragglers"]:
            lines.append(f"straggler    rank {s['rank']} on {s['host']}: flagged {s['times']} time(s),"
                         f" up to {s['max_ratio']:.2f}x the median")
    else:
        lines.append("stragglers   none flagged")
    r = n["ranks"]
    if r and r.get("busy_s"):
        cells = "  ".join(f"{i}:{_s(t)}" for i, t in enumerate(r["busy_s"]))
        lines.append(f"per rank     busy time per step (median): {cells}")
        slow = r.get("slowest")
        if slow:
            lines.append(f"slowest rank {slow['rank']}: most of its extra time in {slow['phase']},"
                         f" {_s(slow['seconds'])} per step against {_s(slow['median_s'])} on the median rank")
    sysl = n["system"]
    if sysl:
        system = [f"CPU {sysl['cpu_percent_mean']:.0f}%" if sysl.get("cpu_percent_mean") is not None else None,
                 f"memory up to {sysl['mem_used_gib_max']:.1f} GiB" if sysl.get("mem_used_gib_max") is not None else None,
                 f"GPU {sysl['gpu_util_percent_mean']:.0f}%" if sysl.get("gpu_util_percent_mean") is not None else None,
                 f"{sysl['gpu_power_w_mean']:.0f} W" if sysl.get("gpu_power_w_mean") is not None else None]
        lines.append(f"system       {', '.join(p for p in system if p)} ({sysl['samples']} samples,"
                     f" {len(sysl['hosts'])} host(s))")
    return lines


def baseline_block(name: str, rows: list[dict[str, Any]]) -> list[str]:
    lines = [f"against baseline {name}:"]
    if not rows:
        return lines + ["  no figure in common"]
    for r in rows:
        change = "" if r["change"] is None else f" ({100 * r['change']:+.1f}%)"
        lines.append(f"  {r['figure']:<30} {_fmt(r['baseline']):>12} -> {_fmt(r['run']):>12}  {r['verdict']}{change}")
    return lines


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def sweep_row(n: dict[str, Any]) -> dict[str, Any]:
    v = n.get("validation") or {}
    return {"run": n["label"], "run_dir": n["run_dir"], "step": n["step"], "final_loss": n["final_loss"],
            "val_loss": v.get("val_loss"), "val_step": v.get("step"), "tokens_per_s": n["tokens_per_s"]}


def sweep_block(rows: list[dict[str, Any]]) -> list[str]:
    """Runs of other identities side by side, each named by the keys that differ (no verdict:
    they are not meant to be equal)."""
    width = max(len(r["run"]) for r in rows)
    lines = [f"sweep: {len(rows)} runs of different configurations (no repeatability verdict)",
             f"  {'run':<{width}}  {'step':>6}  {'final loss':>12}  {'val_loss':>12}  {'tokens/s':>10}"]
    for r in rows:
        val = "-" if r["val_loss"] is None else f"{r['val_loss']:.6f}"
        loss = "-" if r["final_loss"] is None else f"{r['final_loss']:.6f}"
        tps = "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:,.0f}"
        lines.append(f"  {r['run']:<{width}}  {r['step'] if r['step'] is not None else '-':>6}  {loss:>12}  {val:>12}"
                     f"  {tps:>10}")
    return lines
