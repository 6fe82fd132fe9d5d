"""The report of one or more runs, assembled from its arguments: each run's numbers, the
plan's prediction against them, the comparison of runs, a baseline, the audit, the plots;
and as text. `python -m dtk.report` and the handover's report/ both make it here."""

from __future__ import annotations

import argparse
from pathlib import Path

from dtk.common import audit
from dtk.common.errors import ArgumentParser, UserError
from dtk.report.compare import DEFAULT_TOLERANCE, against_baseline, describe_verdict, pair_kind, repeatability
from dtk.report.numbers import run_numbers
from dtk.report.planned import planned, planned_lines
from dtk.report.runs import RunData, flat_config, label_by_differences, load_baseline, load_run
from dtk.report.text import baseline_block, run_block, sweep_block, sweep_row

AUDIT_LINES = 10  # the newest entries of each run's audit log shown in the text report


EPILOG = """examples:
  python -m dtk.report runs/transformer-1a2b3c4d5e
  python -m dtk.report runs/a runs/b                      # loss curves overlaid, repeatability verdict
  python -m dtk.report runs/new --baseline runs/old       # better/worse than a recorded baseline
  python -m dtk.report runs/a --json --no-plots

Per run: final loss, steps/s, samples/s and tokens/s, idle share and its parts (data, comm,
checkpoint, straggler), goodput over the job's lifetime, MFU where the device's peak is
known, restarts, checkpoints, stragglers, host and GPU load, and who submitted, drilled,
exported or deleted what (the run root's audit/). Plots (PNG) go to
RUN_DIR/report/ (loss.png, phases.png, ranks.png, goodput.png), or to --out.
Given several runs, each is compared with the first. Runs of one identity (config hash) get
a verdict: identical (bit-for-bit equal losses), within the tolerance (with the largest
difference), equal within float tolerance (another layout or scheme of the same run), or
diverged (from which step). Runs of other identities (a sweep) get a table instead: final
loss, validation loss and tokens/s of each, named by the keys that differ.
docs/report.md explains every figure.
"""


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m dtk.report",
        description="Where a run's time went, how runs compare, as numbers and PNG plots.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("runs", metavar="RUN_DIR", nargs="+", type=Path, help="run directories; the first is the reference")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--baseline", metavar="RUN_DIR", type=Path,
                   help="a recorded run (its run directory, or its handover folder) to compare speed and utilisation with")
    p.add_argument("--out", metavar="DIR", type=Path, help="write the plots here instead of RUN_DIR/report/")
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                   help=f"relative loss difference still counted as repeatable (default {DEFAULT_TOLERANCE:g})")
    p.add_argument("--no-plots", action="store_true", help="numbers only; no PNG files, no matplotlib needed")
    return p


def check_plots_writable(run_dir: Path) -> None:
    """Without --out the plots go into the run directory, which under an access policy only
    its user and the maintainers write: a viewer is pointed to --out, before any work."""
    import getpass
    import os

    folder = run_dir / "report"
    target = folder if folder.exists() else run_dir
    if os.access(target, os.W_OK | os.X_OK):
        return
    raise UserError(f"cannot write the plots into {folder} as user {getpass.getuser()}: a run's files are written by"
                    " its user and the maintainers; give --out DIR (a folder of your own), or --no-plots")


def report(args: argparse.Namespace) -> dict:
    if args.tolerance < 0:
        raise UserError(f"--tolerance={args.tolerance}: expected 0 or more (e.g. 1e-3)")
    runs = [load_run(p) for p in args.runs]
    if not args.no_plots and args.out is None:
        for run in runs:
            check_plots_writable(run.path)
    label_by_differences(runs)
    numbers = [run_numbers(r) for r in runs]
    out: dict = {"runs": numbers}
    out["planned"] = [planned(r, n) for r, n in zip(runs, numbers, strict=True)]  # measured against the plan
    out["audit"] = [{"run": r.name, "entries": audit.read(audit.run_root_of(r.path), run=r.plan.get("run_name", r.name))}
                    for r in runs]
    if len(runs) > 1:
        out.update(compare_runs(runs, numbers, tolerance=args.tolerance))
    if args.baseline is not None:
        base = run_numbers(load_baseline(args.baseline))
        out["baseline"] = {"run_dir": base["run_dir"],
                           "comparisons": [{"run": n["name"], "rows": against_baseline(n, base)} for n in numbers]}
    if not args.no_plots:
        from dtk.report.plots import write_plots

        out["plots"] = [str(p) for p in write_plots(runs, numbers, args.out)]
    return out


def compare_runs(runs: list[RunData], numbers: list[dict], *, tolerance: float) -> dict:
    """Each run against the first: a repeatability verdict where both are one run identity
    (bitwise expected for one config, float noise for another layout or scheme), else a row
    of the sweep table, by the keys that differ."""
    ref, ref_flat = runs[0], flat_config(runs[0])
    verdicts, swept = [], []
    for run, n in zip(runs[1:], numbers[1:], strict=True):
        flat = flat_config(run)
        differs = sorted(k for k in set(ref_flat) | set(flat) if ref_flat.get(k) != flat.get(k))
        kind = pair_kind(ref.plan.get("config_hash"), run.plan.get("config_hash"), differs)
        if kind == "sweep":
            swept.append(n)
            continue
        v = repeatability(ref.losses, run.losses, tolerance=tolerance, layout=kind == "layout")
        verdicts.append({"reference": ref.label, "run": run.label, **v, **({"differs": differs} if differs else {})})
    out: dict = {"repeatability": verdicts} if verdicts else {}
    if swept:
        out["sweep"] = [sweep_row(n) for n in [numbers[0], *swept]]
    return out


def render(out: dict) -> str:
    blocks = ["\n".join(run_block(n) + planned_lines(p)) for n, p in zip(out["runs"], out["planned"], strict=True)]
    for v in out.get("repeatability", []):
        blocks.append(f"repeatability of {v['run']} against {v['reference']}: {describe_verdict(v)}")
    if out.get("sweep"):
        blocks.append("\n".join(sweep_block(out["sweep"])))
    if "baseline" in out:
        for c in out["baseline"]["comparisons"]:
            blocks.append("\n".join(baseline_block(f"{out['baseline']['run_dir']} (run {c['run']})", c["rows"])))
    for a in out.get("audit", []):
        if a["entries"]:
            blocks.append(f"audit of {a['run']} (who did what; all of it in --json)\n"
                          + "\n".join(f"  {audit.describe(e)}" for e in a["entries"][-AUDIT_LINES:]))
    if out.get("plots"):
        blocks.append("plots\n" + "\n".join(f"  {p}" for p in out["plots"]))
    return "\n\n".join(blocks)
