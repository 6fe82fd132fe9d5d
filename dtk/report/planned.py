"""The plan held against the run: the step time and the memory per device that
`python -m dtk.plan` predicts for this job, against what the run measured.

- step time: dtk.plan.cost.steptime's prediction for the job's own scheme at its size and its
  model (the built-in transformer from the run's config; the plan.* what-if keys are for
  planning and are not the model that ran), against the median `step_time_s` of
  metrics.jsonl. Predicted on a GPU of known peak only (cluster.accelerator or
  cluster.peak_tflops); a user's model is not counted here (that would build it).
  A `+sync` run's prediction spreads one synchronization over sync.every steps, and its
  median step leaves the synchronizing steps out: it is held against the mean step over
  whole synchronization periods (`sync_periods`: steps kH+1 .. (k+1)H, the last the
  synchronizing one; the first period, which holds the start-up, left out when there are
  others), and the synchronizing step is shown apart.
- memory: summary.json's `memory`, which every worker measured against its own rank's
  prediction (dtk.plan.cost.predict): the largest rank's figures.

A ratio is measured / predicted: above 1, the run was slower (or larger) than planned.
"""

from __future__ import annotations

import json
from typing import Any

from dtk.common.errors import UserError
from dtk.report.runs import RunData


def _step(run: RunData, measured: float | None) -> dict[str, Any]:
    from dtk.config.convert import builtin_transformer
    from dtk.plan.cost.inputs import device_kind
    from dtk.plan.cost.predict import real_context
    from dtk.plan.cost.report import chosen_variant
    from dtk.plan.cost.steptime import hardware_of, step_time
    from dtk.plan.plan import Plan
    from dtk.plan.shape import builtin_shape, is_builtin

    try:
        plan = Plan.from_json(json.dumps(run.plan))
    except (KeyError, TypeError, ValueError) as exc:
        return {"predicted_s": None, "why": f"plan.json cannot be read as a plan of this dtk ({type(exc).__name__})"}
    cfg = plan.config
    if not is_builtin(cfg.model):
        return {"predicted_s": None, "why": "a model of the user's: python -m dtk.plan predicts its step"}
    device = device_kind(cfg)
    model = builtin_transformer(cfg.model)
    assert cfg.scheme is not None and model is not None  # a resolved plan's; a built-in model (checked above)
    try:
        hw = hardware_of(cfg.cluster, device=device, param_dtype=str(cfg.scheme.param_dtype), doctor=cfg.plan.doctor)
    except UserError as exc:
        return {"predicted_s": None, "why": str(exc)}
    if hw is None:
        return {"predicted_s": None, "why": "no step-time model for this device (the CPU, or a GPU of unknown peak)"}
    try:
        shape = builtin_shape(model)
        ctx = real_context(cfg, plan, shape, device=device)
        t = step_time(shape, ctx.job(chosen_variant(ctx, plan)), global_batch=plan.global_batch,
                      tasks_per_node=plan.tasks_per_node, hw=hw)
    except UserError as exc:
        return {"predicted_s": None, "why": str(exc)}
    if t is None:
        return {"predicted_s": None, "why": "the model has no sequence length to count tokens by"}
    ratio = None if not measured else round(measured / t.total_s, 3)
    return {"predicted_s": round(t.total_s, 4), "measured_s": measured, "ratio": ratio, "time_model": hw.source,
            "predicted": t.to_json()}


def sync_periods(records: dict[int, dict[str, Any]], every: int, fragments: int = 1) -> dict[str, Any] | None:
    """A +sync run's steps in whole synchronization periods of `every` steps (module doc):
    their mean step, the synchronizing steps' median (with sync.fragments=F, every
    every/F-th step synchronizes a fragment) and the other steps' median; None before a
    whole period is logged."""
    import statistics

    times = {s: float(r["step_time_s"]) for s, r in records.items() if r.get("step_time_s")}
    last = max(times, default=0) // every
    periods = [k for k in range(last) if all(k * every + i in times for i in range(1, every + 1))]
    if len(periods) > 1 and periods[0] == 0:
        periods = periods[1:]  # the start-up's period
    if not periods:
        return None
    stride = every // fragments
    steps = [k * every + i for k in periods for i in range(1, every + 1)]
    syncing = [times[s] for s in steps if s % stride == 0]
    between = [times[s] for s in steps if s % stride]
    return {
        "every": every, "fragments": fragments, "periods": len(periods), "first_step": periods[0] * every + 1,
        "last_step": (periods[-1] + 1) * every,
        "mean_s": round((sum(syncing) + sum(between)) / (len(syncing) + len(between)), 6),
        "sync_step_s": round(statistics.median(syncing), 6),
        "between_s": round(statistics.median(between), 6) if between else None,
    }


def _sync_of(run: RunData) -> tuple[int, int]:
    """The run's sync.every and sync.fragments ((0, 1): it synchronizes every step)."""
    from dtk.plan.plan import Plan

    try:
        sync = Plan.from_json(json.dumps(run.plan)).config.sync
    except (KeyError, TypeError, ValueError):
        return 0, 1
    return (sync.every, sync.fragments) if sync is not None else (0, 1)


def planned(run: RunData, numbers: dict[str, Any]) -> dict[str, Any]:
    """The run's measured step time and memory against the plan's; a +sync run's step as the
    mean over whole synchronization periods (`sync_periods`)."""
    memory = (run.summary or {}).get("memory")
    mem = None
    if memory and memory.get("predicted_bytes"):
        measured = memory.get("measured_bytes")
        mem = {"predicted_bytes": memory["predicted_bytes"], "measured_bytes": measured,
               "ratio": None if not measured else round(measured / memory["predicted_bytes"], 3),
               "basis": memory.get("basis"), "mismatch_ranks": memory.get("mismatch_ranks", [])}
    every, fragments = _sync_of(run)
    periods = sync_periods(run.latest, every, fragments) if every else None
    measured = periods["mean_s"] if periods else numbers.get("step_time_s_median")
    step = _step(run, measured)
    if every:
        step["sync"] = periods or {"every": every, "periods": 0}
    return {"run": run.name, "step": step, "memory": mem}


def planned_lines(p: dict[str, Any]) -> list[str]:
    """The report's `plan` lines of one run."""
    s, m = p["step"], p["memory"]
    if s["predicted_s"] is None:
        lines = [f"plan         step time not predicted: {s['why']}"]
    elif s["measured_s"] is None:
        lines = [f"plan         step {s['predicted_s']:.4g} s predicted, none measured yet"]
    else:
        basis = " (mean over whole sync periods)" if "sync" in s and s["sync"]["periods"] else ""
        lines = [f"plan         step {s['measured_s']:.4g} s measured{basis} against {s['predicted_s']:.4g} s predicted"
                 f" (x{s['ratio']:.2f}) [{s['time_model']}]"]
    lines += _sync_lines(s["sync"] if "sync" in s else None)
    if m is None:
        lines.append("             memory: no prediction recorded (summary.json is written at the end)")
    elif m["measured_bytes"] is None:
        lines.append(f"             memory {m['predicted_bytes'] / 1e9:.3f} GB per device planned, not measured")
    else:
        off = f"; ranks {m['mismatch_ranks']} off by more than 10%" if m["mismatch_ranks"] else ""
        lines.append(f"             memory {m['measured_bytes'] / 1e9:.3f} GB per device measured against"
                     f" {m['predicted_bytes'] / 1e9:.3f} GB planned (x{m['ratio']:.2f}, {m['basis']}){off}")
    return lines


def _sync_lines(sync: dict[str, Any] | None) -> list[str]:
    """A +sync run's synchronizing step apart from the others."""
    if sync is None:
        return []
    if not sync["periods"]:
        return [f"             sync every {sync['every']} steps: no whole period logged yet"]
    between = f", the other steps {sync['between_s']:.4g} s (median)" if sync["between_s"] is not None else ""
    streamed = f" in {sync['fragments']} fragments" if sync["fragments"] > 1 else ""
    return [f"             sync every {sync['every']} steps{streamed}: the synchronizing step {sync['sync_step_s']:.4g} s"
            " (median)"
            f"{between}; mean {sync['mean_s']:.4g} s over {sync['periods']} whole period(s), steps"
            f" {sync['first_step']}-{sync['last_step']}"]
