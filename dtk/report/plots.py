"""PNG figures of runs. matplotlib is imported here only, and only when a figure is drawn,
so the text report and --json work where it is missing.

Each figure is built on a bare `Figure` with the Agg canvas (no pyplot, no global state,
no display needed) and saved with its curve labels in the PNG's `Description` text, so a
reader (or a test) can tell what a file shows without looking at it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dtk.common.errors import UserError
from dtk.common.rundir import PHASES
from dtk.report.runs import RunData

GOODPUT_COLOURS = {
    "queue": "#999999", "startup": "#e6a23c", "checkpoint_load": "#b88230", "redone": "#d9534f",
    "productive": "#4caf50", "checkpoint_save": "#5b8def", "down": "#555555", "other": "#cccccc",
}


def _figure(width: float = 8.0, height: float = 4.5):
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError("plots need matplotlib: pip install matplotlib (or pass --no-plots)") from None
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def save(fig, path: Path, labels: list[str]) -> Path:
    """Write the figure as PNG with its curve count and labels in the file's metadata."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, format="png", metadata={"Description": f"curves={len(labels)}: " + ", ".join(labels)})
    return path


def loss_curves(runs: list[RunData]):
    """Loss per step of every run, overlaid: one line per run."""
    fig = _figure()
    ax = fig.add_subplot()
    for run in runs:
        losses = run.losses
        ax.plot(list(losses), list(losses.values()), label=run.label, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean over the global batch)")
    ax.set_title("loss")
    ax.legend(loc="upper right", fontsize="small")
    ax.grid(alpha=0.3)
    return fig


def phase_breakdown(run: RunData):
    """Step time split into its phases over the run (stacked); the step time alone when the
    run was not profiled."""
    fig = _figure()
    ax = fig.add_subplot()
    records = [r for _, r in sorted(run.latest.items())]
    steps = [r["step"] for r in records]
    if any(r.get("phases") for r in records):
        profiled = [r for r in records if r.get("phases")]
        xs = [r["step"] for r in profiled]
        ys = [[float(r["phases"].get(p) or 0.0) * 1000 for r in profiled] for p in PHASES]
        ax.stackplot(xs, ys, labels=list(PHASES), alpha=0.85)
        # Beside the plot, not over it: inside, it hid the tallest steps.
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", borderaxespad=0.0)
        ax.set_title(f"{run.name}: step time by phase")
    else:
        ax.plot(steps, [float(r.get("step_time_s") or 0.0) * 1000 for r in records], label="step time")
        ax.set_title(f"{run.name}: step time (not profiled: train.profile=false)")
    ax.set_xlabel("step")
    ax.set_ylabel("ms")
    ax.grid(alpha=0.3)
    return fig


def rank_times(run: RunData):
    """Step time of each rank at every gathered interval: one line per rank. None when the
    run has no per-rank times (a one-process run, or not profiled)."""
    gathered = [(r["step"], r["ranks"]) for _, r in sorted(run.latest.items()) if isinstance(r.get("ranks"), dict)]
    gathered = [(s, g) for s, g in gathered if g.get("busy_s") or g.get("step_time_s")]
    if not gathered:
        return None
    key = "busy_s" if all(g.get("busy_s") for _, g in gathered) else "step_time_s"
    num_ranks = len(gathered[-1][1][key])
    fig = _figure()
    ax = fig.add_subplot()
    for rank in range(num_ranks):
        pts = [(s, g[key][rank]) for s, g in gathered if len(g[key]) == num_ranks]
        ax.plot([p[0] for p in pts], [p[1] * 1000 for p in pts], marker=".", label=f"rank {rank}")
    what = "busy time (step time less waiting)" if key == "busy_s" else "step time"
    ax.set_title(f"{run.name}: per-rank {what}")
    ax.set_xlabel("step")
    ax.set_ylabel("ms per step")
    ax.legend(loc="upper right", fontsize="small", ncol=max(1, num_ranks // 8))
    ax.grid(alpha=0.3)
    return fig


def goodput_bar(name: str, goodput: dict[str, Any]):
    """One horizontal bar of the wall time from first submission to the end, split into its parts."""
    fig = _figure(8.0, 3.0)
    ax = fig.add_subplot()
    left = 0.0
    wall = goodput.get("wall_s") or 0.0
    for part, seconds in goodput.get("parts", {}).items():
        key = part[:-2]
        if seconds <= 0:
            continue
        share = seconds / wall if wall else 0.0
        ax.barh([0], [seconds], left=left, color=GOODPUT_COLOURS.get(key), label=f"{key} {share:.1%}")
        left += seconds
    ax.set_yticks([])
    ax.set_xlabel("seconds from first submission")
    gp = goodput.get("goodput")
    ax.set_title(f"{name}: goodput {gp:.1%} of {wall:.1f} s" if gp is not None else f"{name}: goodput")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.45), fontsize="small", ncol=4, frameon=False)
    return fig


def _labels_of(fig) -> list[str]:
    ax = fig.axes[0]
    handles, labels = ax.get_legend_handles_labels()
    return labels


def write_plots(runs: list[RunData], numbers: list[dict[str, Any]], out: Path | None) -> list[Path]:
    """Every figure of the report. Without `out` they go to RUN_DIR/report/ (the overlay of
    several runs to the first run's); with it, to OUT/ (per-run files prefixed by run name)."""
    written = []
    first_dir = out if out is not None else runs[0].path / "report"
    fig = loss_curves(runs)
    written.append(save(fig, first_dir / "loss.png", _labels_of(fig)))
    for run, nums in zip(runs, numbers, strict=True):
        folder, prefix = (out, f"{run.name}-") if out is not None else (run.path / "report", "")
        fig = phase_breakdown(run)
        written.append(save(fig, folder / f"{prefix}phases.png", _labels_of(fig)))
        fig = rank_times(run)
        if fig is not None:
            written.append(save(fig, folder / f"{prefix}ranks.png", _labels_of(fig)))
        fig = goodput_bar(run.name, nums["goodput"])
        written.append(save(fig, folder / f"{prefix}goodput.png", _labels_of(fig)))
    return written
