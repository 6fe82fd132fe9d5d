"""Comparing runs: a repeatability verdict on their loss curves, and a run against a baseline.

Repeatability asks whether the same recipe gives the same numbers. `identical`: every
common step has bit-for-bit the same loss. `within`: none differs by more than the
tolerance (relative to the reference loss), with the largest difference named. `diverged`:
the first step where the difference exceeds the tolerance.
"""

from __future__ import annotations

from typing import Any

from dtk.errors import UserError

DEFAULT_TOLERANCE = 1e-3
"""Relative loss difference below which two runs count as the same within numerical noise
(reduction order on another world size or scheme moves losses by about 1e-6 to 1e-4)."""


def repeatability(reference: dict[int, float], other: dict[int, float], *, tolerance: float = DEFAULT_TOLERANCE) -> dict[str, Any]:
    """Verdict on `other`'s losses against `reference`'s, over the steps both logged."""
    common = sorted(set(reference) & set(other))
    if not common:
        raise UserError("the runs have no logged step in common: nothing to compare (are both past step 1?)")
    largest, largest_step, diverged_at = 0.0, common[0], None
    exact = True
    for step in common:
        a, b = reference[step], other[step]
        diff = abs(a - b)
        if diff != 0.0:
            exact = False
        rel = diff / max(abs(a), 1e-12)
        if rel > largest:
            largest, largest_step = rel, step
        if diverged_at is None and rel > tolerance:
            diverged_at = step
    out: dict[str, Any] = {
        "common_steps": len(common),
        "first_step": common[0],
        "last_step": common[-1],
        "tolerance": tolerance,
        "largest_rel_diff": largest,
        "largest_at_step": largest_step,
    }
    if exact:
        out["verdict"] = "identical"
    elif diverged_at is None:
        out["verdict"] = "within"
    else:
        out["verdict"] = "diverged"
        out["diverged_at_step"] = diverged_at
    return out


def describe_verdict(v: dict[str, Any]) -> str:
    span = f"{v['common_steps']} common steps ({v['first_step']}-{v['last_step']})"
    if v["verdict"] == "identical":
        return f"identical: bit-for-bit equal losses over {span}"
    if v["verdict"] == "within":
        return (f"within {v['tolerance']:g}: largest relative loss difference {v['largest_rel_diff']:.3g}"
                f" at step {v['largest_at_step']}, over {span}")
    return (f"diverged from step {v['diverged_at_step']} (relative loss difference > {v['tolerance']:g});"
            f" largest {v['largest_rel_diff']:.3g} at step {v['largest_at_step']}, over {span}")


# (key in run_numbers, label, True when a larger value is better)
BASELINE_FIGURES = (
    ("step_time_s_median", "step time (s)", False),
    ("samples_per_s", "samples/s", True),
    ("tokens_per_s", "tokens/s", True),
    ("idle_share", "idle share", False),
    ("utilisation", "utilisation (1 - idle share)", True),
    ("mfu_median", "MFU", True),
    ("cpu_percent_mean", "host CPU %", True),
    ("gpu_util_percent_mean", "GPU utilisation %", True),
    ("tokens_per_step", "tokens per step", True),
    ("tokens_total", "tokens processed", True),
    ("goodput", "goodput", True),
)


def _flat(numbers: dict[str, Any]) -> dict[str, Any]:
    flat = dict(numbers)
    phases = numbers.get("phases") or {}
    if phases:
        flat["idle_share"] = phases["idle_share"]
        flat["utilisation"] = round(1.0 - phases["idle_share"], 4)
    flat.update({k: v for k, v in (numbers.get("system") or {}).items() if k.endswith("_mean")})
    flat["goodput"] = (numbers.get("goodput") or {}).get("goodput")
    return flat


def against_baseline(run: dict[str, Any], baseline: dict[str, Any]) -> list[dict[str, Any]]:
    """Each figure both runs have: baseline, this run, the change in percent, better or worse."""
    a, b = _flat(baseline), _flat(run)
    rows = []
    for key, label, higher_better in BASELINE_FIGURES:
        base, now = a.get(key), b.get(key)
        if base is None or now is None:
            continue
        change = (now - base) / abs(base) if base else None
        if now == base:
            verdict = "same"
        else:
            verdict = "better" if (now > base) == higher_better else "worse"
        rows.append({"figure": label, "key": key, "baseline": base, "run": now,
                     "change": round(change, 4) if change is not None else None, "verdict": verdict})
    return rows
