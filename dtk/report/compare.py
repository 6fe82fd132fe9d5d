"""Comparing runs: a repeatability verdict on their loss curves, and a run against a baseline.

Repeatability asks whether the same recipe gives the same numbers, for runs meant to be
equal: the same run identity (config hash). `identical`: every common step has bit-for-bit
the same loss. `within`: none differs by more than the tolerance (relative to the reference
loss), with the largest difference named. `float` (equal within float tolerance): the runs
differ only in layout or scheme keys, agree at the first step to FLOAT_TOLERANCE and after
within the tolerance or the loss's own step-to-step change. `diverged`: the first step where
the difference exceeds that. Runs of another identity (a sweep) get no verdict: the report
compares them as a table by the keys that differ.
"""

from __future__ import annotations

import statistics
from typing import Any

from dtk.common.errors import UserError

DEFAULT_TOLERANCE = 1e-3
"""Relative loss difference below which two runs count as the same within numerical noise
(reduction order on another world size or scheme moves losses by about 1e-6 to 1e-4)."""


FLOAT_TOLERANCE = 1e-5
"""Relative loss difference at the first common step within which two layouts of one run
(another scheme, world size or micro-batch) agree: the same weights and batch, only the
order of the sums differs (measured about 1e-7 to 1e-6). Later steps drift further, as
training amplifies that noise."""


def pair_kind(ref_hash: str | None, other_hash: str | None, differs: list[str]) -> str:
    """How two runs are compared: `same` (one config: expect bitwise), `layout` (one run
    identity, other layout or scheme: expect float noise), `sweep` (other identity: no
    verdict, a table). Runs without a recorded identity: `same` when no key differs."""
    if ref_hash is not None and other_hash is not None:
        if ref_hash != other_hash:
            return "sweep"
        return "layout" if differs else "same"
    return "sweep" if differs else "same"


def _step_noise(losses: dict[int, float], steps: list[int]) -> float | None:
    """The loss's own step-to-step change (median absolute difference of consecutive steps)."""
    changes = [abs(losses[b] - losses[a]) for a, b in zip(steps, steps[1:], strict=False) if b == a + 1]
    return statistics.median(changes) if changes else None


def repeatability(reference: dict[int, float], other: dict[int, float], *, tolerance: float = DEFAULT_TOLERANCE,
                  layout: bool = False) -> dict[str, Any]:
    """Verdict on `other`'s losses against `reference`'s, over the steps both logged. With
    `layout` (one run on another layout), the first common step must agree within
    FLOAT_TOLERANCE, and a later step diverges only where it differs by more than the
    tolerance and by more than the loss's own step-to-step change."""
    common = sorted(set(reference) & set(other))
    if not common:
        raise UserError("the runs have no logged step in common: nothing to compare (are both past step 1?)")
    noise = _step_noise(reference, common) if layout else None
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
        if layout and step == common[0]:
            bad = rel > FLOAT_TOLERANCE
        else:
            bad = rel > tolerance and (noise is None or diff > noise)
        if diverged_at is None and bad:
            diverged_at = step
    out: dict[str, Any] = {
        "common_steps": len(common),
        "first_step": common[0],
        "last_step": common[-1],
        "tolerance": tolerance,
        "largest_rel_diff": largest,
        "largest_at_step": largest_step,
    }
    if layout:
        a = reference[common[0]]
        out.update(float_tolerance=FLOAT_TOLERANCE, first_rel_diff=abs(a - other[common[0]]) / max(abs(a), 1e-12),
                   step_noise=noise)
    if exact:
        out["verdict"] = "identical"
    elif diverged_at is None:
        out["verdict"] = "float" if layout else "within"
    else:
        out["verdict"] = "diverged"
        out["diverged_at_step"] = diverged_at
    return out


def describe_verdict(v: dict[str, Any]) -> str:
    span = f"{v['common_steps']} common steps ({v['first_step']}-{v['last_step']})"
    layout = f" (one run identity; differs in {', '.join(v['differs'])})" if v.get("differs") else ""
    if v["verdict"] == "identical":
        return f"identical: bit-for-bit equal losses over {span}{layout}"
    if v["verdict"] == "within":
        return (f"within {v['tolerance']:g}: largest relative loss difference {v['largest_rel_diff']:.3g}"
                f" at step {v['largest_at_step']}, over {span}")
    if v["verdict"] == "float":
        noise = f", the loss's own step-to-step change {v['step_noise']:.3g}" if v.get("step_noise") is not None else ""
        return (f"equal within float tolerance{layout}: step {v['first_step']} agrees to {v['first_rel_diff']:.3g}"
                f" relative (<= {v['float_tolerance']:g}); largest relative difference {v['largest_rel_diff']:.3g} at"
                f" step {v['largest_at_step']} (tolerance {v['tolerance']:g}{noise}), over {span}")
    return (f"diverged from step {v['diverged_at_step']} (relative loss difference > {v['tolerance']:g}"
            + (f", at the first step > {v['float_tolerance']:g}" if "float_tolerance" in v else "")
            + f"){layout}; largest {v['largest_rel_diff']:.3g} at step {v['largest_at_step']}, over {span}")


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
