"""The figures of one run: loss, speed, idle share and its parts, goodput, MFU, restarts,
checkpoints, stragglers, per-rank step times and host/GPU load. Plain dicts, for the text
report, --json and the baseline comparison."""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from dtk.common.rundir import IDLE_PHASES, PHASES
from dtk.report.goodput import account
from dtk.report.runs import RunData


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def phase_profile(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Each phase's share of the summed step time over the profiled records, and idle_share."""
    profiled = [r for r in records if r.get("phases") and r.get("step_time_s")]
    if not profiled:
        return None
    total = sum(float(r["step_time_s"]) for r in profiled)
    shares = {p: sum(float(r["phases"].get(p) or 0.0) for r in profiled) / total for p in PHASES}
    return {
        "steps": len(profiled),
        "shares": {p: round(v, 4) for p, v in shares.items()},
        "idle_share": round(sum(shares[p] for p in IDLE_PHASES), 4),
        "main_idle": max(IDLE_PHASES, key=lambda p: shares[p]),
    }


def per_rank(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Median over the logging intervals of each rank's step time, idle time and phases, and
    the slowest rank's phase that most exceeds the median rank's (where its time goes)."""
    gathered = [r["ranks"] for r in records if isinstance(r.get("ranks"), dict) and r["ranks"].get("step_time_s")]
    if not gathered:
        return None
    num_ranks = len(gathered[-1]["step_time_s"])
    out: dict[str, Any] = {"num_ranks": num_ranks, "intervals": len(gathered)}
    for key in ("step_time_s", "busy_s", "wait_s", *(f"{p}_s" for p in PHASES)):
        cols = [g[key] for g in gathered if len(g.get(key) or []) == num_ranks]
        if cols:
            out[key] = [round(statistics.median(c[i] for c in cols), 6) for i in range(num_ranks)]
    if gathered[-1].get("hosts"):
        out["hosts"] = gathered[-1]["hosts"]
    busy = out.get("busy_s")
    own = [p for p in PHASES if p != "straggler" and f"{p}_s" in out]  # waiting for others is no rank's own
    if num_ranks > 1 and busy and own:
        slow = max(range(num_ranks), key=lambda r: busy[r])
        medians = {p: statistics.median_low(out[f"{p}_s"]) for p in own}
        phase = max(own, key=lambda p: out[f"{p}_s"][slow] - medians[p])
        out["slowest"] = {"rank": slow, "phase": phase, "seconds": out[f"{phase}_s"][slow], "median_s": medians[phase]}
    return out


def checkpoints(run: RunData) -> dict[str, Any]:
    saved = run.events_named("checkpoint_saved")
    return {
        "saved": len(saved),
        "loaded": len(run.events_named("checkpoint_loaded")),
        "rejected": len(run.events_named("checkpoint_rejected")),
        "save_s_median": _median([float(e["seconds"]) for e in saved if "seconds" in e]),
        "blocked_s_median": _median([float(e["blocked_seconds"]) for e in saved if "blocked_seconds" in e]),
        "last_step": saved[-1].get("step") if saved else None,
    }


def stragglers(run: RunData) -> list[dict[str, Any]]:
    """One line per flagged rank: how often, on which host, how much slower than the median."""
    by_rank: dict[Any, dict[str, Any]] = {}
    for e in run.events_named("straggler"):
        entry = by_rank.setdefault(e.get("rank"), {"rank": e.get("rank"), "host": e.get("host"), "times": 0, "max_ratio": 0.0})
        entry["times"] += 1
        entry["max_ratio"] = max(entry["max_ratio"], float(e.get("ratio") or 0.0))
        entry["last_step"] = e.get("step")
    return sorted(by_rank.values(), key=lambda x: (x["rank"] is None, x["rank"]))


def system_load(samples: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Mean host CPU and GPU utilisation, peak memory, from system.jsonl."""
    if not samples:
        return None
    gpus: dict[str, list[float]] = defaultdict(list)
    for s in samples:
        for g in s.get("gpus") or []:
            for key in ("util_percent", "mem_used_gib", "power_w"):
                if g.get(key) is not None:
                    gpus[key].append(float(g[key]))
    out = {
        "samples": len(samples),
        "hosts": sorted({str(s.get("host")) for s in samples}),
        "cpu_percent_mean": _mean([float(s["cpu_percent"]) for s in samples if s.get("cpu_percent") is not None]),
        "mem_used_gib_max": max((float(s["mem_used_gib"]) for s in samples if s.get("mem_used_gib") is not None), default=None),
        "gpu_util_percent_mean": _mean(gpus["util_percent"]),
        "gpu_mem_used_gib_max": max(gpus["mem_used_gib"], default=None),
        "gpu_power_w_mean": _mean(gpus["power_w"]),
    }
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items()}


_LIFECYCLE = ("submitted", "started", "requeued", "relaunched", "finished", "failed", "stopped")


def _status(run: RunData, logged: bool) -> str:
    """summary.json's status while it is the run's latest word: a summary from before a later
    submission or start (a failed run submitted again) does not describe the run now."""
    said = (run.summary or {}).get("status")
    lifecycle = [e.get("event") for e in run.events if e.get("event") in _LIFECYCLE]
    if said and (not lifecycle or lifecycle[-1] == said):
        return said
    if said:
        return f"running or stopped (started again after it {said})"
    return "running or stopped" if logged else "no steps logged"


def run_numbers(run: RunData) -> dict[str, Any]:
    latest = [r for _, r in sorted(run.latest.items())]
    step_times = [float(r["step_time_s"]) for r in latest if r.get("step_time_s")]
    median_step = _median(step_times)
    global_batch = run.plan.get("global_batch")
    seq_len = ((run.plan.get("config") or {}).get("model") or {}).get("seq_len")  # plan.json of any version
    # Where the run is now: its newest record (during a redo the larger steps are a dead start's).
    last = run.metric_lines[-1] if run.metric_lines else {}
    epoch_times = [r["epoch_time_s"] for r in latest if r.get("epoch_time_s") is not None]
    return {
        "run_dir": str(run.path),
        "name": run.name,
        "label": run.label or run.name,
        "status": _status(run, bool(latest)),
        "step": last.get("step"),
        "total_steps": run.plan.get("steps"),
        "world_size": last.get("world_size") or run.plan.get("world_size"),
        "final_loss": last.get("loss"),
        "step_time_s_median": median_step,
        "steps_per_s": round(1.0 / median_step, 3) if median_step else None,
        "samples_per_s": round(global_batch / median_step, 1) if median_step and global_batch else None,
        "tokens_per_s": round(global_batch * seq_len / median_step, 1) if median_step and global_batch and seq_len else None,
        "tokens_per_step": global_batch * seq_len if global_batch and seq_len else None,
        "tokens_total": global_batch * seq_len * len(latest) if global_batch and seq_len else None,
        "tflops_median": _median([float(r["tflops"]) for r in latest if r.get("tflops") is not None]),
        "mfu_median": _median([float(r["mfu"]) for r in latest if r.get("mfu") is not None]),
        "epoch_time_s": epoch_times[-1] if epoch_times else None,
        "phases": phase_profile(latest),
        "goodput": account(run.events, run.metric_lines),
        "restarts": max(0, len(run.events_named("started")) - 1),
        "checkpoints": checkpoints(run),
        "stragglers": stragglers(run),
        "ranks": per_rank(latest),
        "system": system_load(run.system),
        "validation": validation(run),
    }


def validation(run: RunData) -> dict[str, Any] | None:
    """The last evaluation of eval.jsonl (val_loss and every val_NAME metric), the first and the
    best val_loss, and how many there were (a step evaluated twice after a restart: the later)."""
    by_step = {int(r["step"]): r for r in run.evals if r.get("val_loss") is not None}
    if not by_step:
        return None
    steps = sorted(by_step)
    last, first = by_step[steps[-1]], by_step[steps[0]]
    best = min(steps, key=lambda s: float(by_step[s]["val_loss"]))
    return {
        "evaluations": len(steps),
        "step": steps[-1],
        "val_loss": float(last["val_loss"]),
        "metrics": {k: v for k, v in last.items() if k.startswith("val_") and k not in ("val_loss", "val_samples")},
        "val_samples": last.get("val_samples"),
        "first_step": steps[0],
        "first_val_loss": float(first["val_loss"]),
        "best_step": best,
        "best_val_loss": float(by_step[best]["val_loss"]),
    }
