"""The report on run directories written here: goodput arithmetic, repeatability verdicts,
baseline comparison, the PNG files and the command's errors. Real runs: test_report_runs.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import dtk, run_main
from dtk.report.compare import against_baseline, repeatability
from dtk.report.goodput import account
from dtk.report.numbers import run_numbers
from dtk.report.plots import loss_curves, phase_breakdown, rank_times
from dtk.report.runs import load_run

PHASES = {"data": 0.01, "forward": 0.03, "backward": 0.04, "optimizer": 0.01, "comm": 0.005, "checkpoint": 0.0,
          "straggler": 0.005}


def write_run(path: Path, losses: dict[int, float], *, events=None, step_time=0.1, phases=True, ranks=False) -> Path:
    path.mkdir(parents=True)
    (path / "plan.json").write_text(json.dumps({"steps": max(losses), "global_batch": 8, "world_size": 2,
                                                "config": {"model": {"seq_len": 16}}}))
    lines = []
    for step, loss in losses.items():
        rec = {"step": step, "time": 1000.0 + step * step_time, "loss": loss, "world_size": 2, "restart": 0,
               "step_time_s": step_time}
        if phases:
            rec["phases"] = dict(PHASES)
            rec["idle_share"] = 0.2
        if ranks and step % 5 == 0:
            rec["ranks"] = {"step_time_s": [step_time, step_time], "busy_s": [0.08, 0.095], "wait_s": [0.02, 0.005]}
        lines.append(json.dumps(rec))
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    events = events if events is not None else [
        {"time": 990.0, "event": "submitted"},
        {"time": 991.0, "event": "started", "restart": 0},
        {"time": 999.0, "event": "ready", "step": 0, "process_start": 991.5, "import_s": 4.0, "process_group_s": 1.0,
         "model_s": 2.0},
        {"time": 1000.0 + max(losses) * step_time, "event": "finished"},
    ]
    (path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def test_goodput_of_a_run_killed_and_resumed():
    # Submitted at 0, queued 2 s, started 8 s, trained steps 1-30 at 1 s each (checkpoint at
    # 20), killed at 40; resubmitted at 50 (10 s down), queued 1 s, 5 s start-up with a 2 s
    # load, redid 21-30 and went on to 40.
    events = [
        {"time": 0.0, "event": "submitted"},
        {"time": 2.0, "event": "started", "restart": 0},
        {"time": 10.0, "event": "ready", "step": 0},
        {"time": 40.0, "event": "failed"},
        {"time": 50.0, "event": "submitted"},
        {"time": 51.0, "event": "started", "restart": 1},
        {"time": 55.0, "event": "checkpoint_loaded", "step": 20, "seconds": 2.0},
        {"time": 56.0, "event": "ready", "step": 20},
        {"time": 76.0, "event": "finished"},
    ]
    lines = [{"step": s, "time": 10.0 + s, "step_time_s": 1.0, "restart": 0} for s in range(1, 31)]
    lines += [{"step": s, "time": 36.0 + s, "step_time_s": 1.0, "restart": 1} for s in range(21, 41)]
    g = account(events, lines)
    p = g["parts"]
    assert g["wall_s"] == 76.0
    assert p["queue_s"] == 3.0 and p["down_s"] == 10.0
    assert p["startup_s"] == 8.0 + 3.0 and p["checkpoint_load_s"] == 2.0
    assert p["redone_s"] == 10.0 and g["redone_steps"] == 10
    assert p["productive_s"] == 40.0
    assert p["other_s"] == pytest.approx(76.0 - 3 - 10 - 11 - 2 - 10 - 40)
    assert g["goodput"] == pytest.approx(40 / 76, abs=1e-4)
    # The restart cost: the second start's queue, start-up and load, and the time down before it.
    assert g["restart_s"] == 1.0 + 3.0 + 2.0 + 10.0
    assert g["restarts"] == 1 and len(g["starts"]) == 2


def test_a_start_that_never_reached_a_step_is_all_startup():
    events = [{"time": 0.0, "event": "submitted"}, {"time": 1.0, "event": "started", "restart": 0},
              {"time": 31.0, "event": "failed"}]
    g = account(events, [])
    assert g["parts"]["startup_s"] == 30.0 and g["parts"]["productive_s"] == 0.0 and g["goodput"] == 0.0


def test_repeatability_verdicts():
    a = {1: 5.0, 2: 4.0, 3: 3.0}
    assert repeatability(a, dict(a))["verdict"] == "identical"
    near = {1: 5.0, 2: 4.0 * (1 + 2e-5), 3: 3.0}
    v = repeatability(a, near, tolerance=1e-4)
    assert v["verdict"] == "within" and v["largest_at_step"] == 2
    assert v["largest_rel_diff"] == pytest.approx(2e-5, rel=1e-3)
    far = {1: 5.0, 2: 4.5, 3: 2.0}
    v = repeatability(a, far, tolerance=1e-4)
    assert v["verdict"] == "diverged" and v["diverged_at_step"] == 2 and v["largest_at_step"] == 3


def test_baseline_says_better_or_worse_by_how_much(tmp_path):
    base = run_numbers(load_run(write_run(tmp_path / "base", {1: 5.0, 2: 4.0}, step_time=0.2)))
    fast = run_numbers(load_run(write_run(tmp_path / "fast", {1: 5.0, 2: 4.0}, step_time=0.1)))
    rows = {r["key"]: r for r in against_baseline(fast, base)}
    assert rows["step_time_s_median"]["verdict"] == "better"
    assert rows["step_time_s_median"]["change"] == pytest.approx(-0.5)
    assert rows["samples_per_s"]["verdict"] == "better" and rows["samples_per_s"]["change"] == pytest.approx(1.0)
    assert rows["tokens_per_step"]["verdict"] == "same"
    rows = {r["key"]: r for r in against_baseline(base, fast)}
    assert rows["step_time_s_median"]["verdict"] == "worse"


@pytest.mark.slow
def test_figures_have_one_curve_per_run_phase_and_rank(tmp_path):
    a = load_run(write_run(tmp_path / "a", {1: 5.0, 2: 4.0, 3: 3.5}))
    b = load_run(write_run(tmp_path / "b", {1: 5.0, 2: 4.2, 3: 3.9}))
    assert len(loss_curves([a, b]).axes[0].get_lines()) == 2
    assert len(phase_breakdown(a).axes[0].collections) == len(PHASES)  # one stacked area per phase
    assert rank_times(a) is None  # no per-rank times gathered
    c = load_run(write_run(tmp_path / "c", {s: 1.0 for s in range(1, 11)}, ranks=True))
    assert len(rank_times(c).axes[0].get_lines()) == 2


def test_per_rank_phases_name_where_the_slowest_rank_spends_its_time(tmp_path):
    run = write_run(tmp_path / "r", {1: 5.0, 2: 4.0})
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # Rank 2 computes its forward 40 ms longer; ranks 0 and 1 wait for it at the reduction.
    lines[-1]["ranks"] = {"step_time_s": [0.1] * 3, "busy_s": [0.06, 0.06, 0.1], "wait_s": [0.04, 0.04, 0.0],
                          **{f"{p}_s": [v] * 3 for p, v in PHASES.items()}}
    lines[-1]["ranks"]["forward_s"] = [0.03, 0.03, 0.07]
    lines[-1]["ranks"]["straggler_s"] = [0.04, 0.04, 0.0]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    ranks = run_numbers(load_run(run))["ranks"]
    assert ranks["forward_s"] == [0.03, 0.03, 0.07]
    assert ranks["slowest"] == {"rank": 2, "phase": "forward", "seconds": 0.07, "median_s": 0.03}
    text = run_main("dtk.report", str(run), "--no-plots").stdout
    assert "slowest rank 2: most of its extra time in forward, 70.0 ms per step against 30.0 ms" in text


def _png(path: Path):
    from PIL import Image

    with Image.open(path) as img:
        img.load()  # decodes every pixel: a truncated file raises here
        return img.size, img.text.get("Description", "")


@pytest.mark.slow
def test_report_command_two_runs_text_json_and_pngs(tmp_path):
    a = write_run(tmp_path / "a", {1: 5.0, 2: 4.0, 3: 3.5})
    b = write_run(tmp_path / "b", {1: 5.0, 2: 4.2, 3: 3.9}, ranks=True)
    proc = run_main("dtk.report", str(a), str(b))
    assert proc.returncode == 0, proc.stderr
    assert "repeatability of b against a: diverged from step 2" in proc.stdout
    assert "idle share   20.0% of step time" in proc.stdout
    assert "goodput" in proc.stdout and "checkpoints  0 saved" in proc.stdout
    size, desc = _png(a / "report" / "loss.png")
    assert size[0] > 100 and desc.startswith("curves=2: a, b")
    assert _png(a / "report" / "phases.png")[1].startswith(f"curves={len(PHASES)}: data, forward")
    assert _png(a / "report" / "goodput.png")[1].startswith("curves=")
    assert not (a / "report" / "ranks.png").exists()

    out = tmp_path / "plots"
    proc = run_main("dtk.report", str(a), str(a), "--json", "--out", str(out), "--baseline", str(b))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["repeatability"][0]["verdict"] == "identical"
    assert data["runs"][0]["phases"]["main_idle"] == "data"
    assert {Path(p).name for p in data["plots"]} == {"loss.png", "a-phases.png", "a-goodput.png"}
    assert _png(out / "loss.png")[1].startswith("curves=2")
    assert data["baseline"]["comparisons"][0]["rows"]


def test_report_imports_no_torch(tmp_path):
    a = write_run(tmp_path / "a", {1: 5.0, 2: 4.0})
    code = ("import sys; from dtk.report.__main__ import main; main([sys.argv[1]]);"
            " assert 'torch' not in sys.modules, 'torch imported'")
    proc = dtk("-c", code, str(a))
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("make, says", [
    (lambda p: p / "missing", "no such directory"),
    (lambda p: p, "not a dtk run directory"),
])
def test_report_mistakes_are_one_error_line(tmp_path, make, says):
    proc = run_main("dtk.report", str(make(tmp_path)))
    assert proc.returncode == 2
    assert proc.stderr.startswith("error:") and says in proc.stderr and len(proc.stderr.splitlines()) == 1


def test_two_runs_without_a_common_step_is_an_error(tmp_path):
    a = write_run(tmp_path / "a", {1: 5.0})
    b = write_run(tmp_path / "b", {2: 5.0})
    proc = run_main("dtk.report", str(a), str(b), "--no-plots")
    assert proc.returncode == 2 and "no logged step in common" in proc.stderr


def test_goodput_parts_sum_to_the_wall_time_with_a_cancelled_job_and_a_start_never_ready():
    """A job cancelled while pending (dtk.stop), submitted again; a start that never reached
    its first step and failed; submitted again and trained. Each second is counted once."""
    events = [
        {"time": 0.0, "event": "submitted"},
        {"time": 10.0, "event": "stopped", "by": "dtk.stop by alice"},  # cancelled in the queue
        {"time": 50.0, "event": "submitted"},
        {"time": 52.0, "event": "started", "restart": 0},
        {"time": 80.0, "event": "failed"},  # never ready
        {"time": 100.0, "event": "submitted"},
        {"time": 101.0, "event": "started", "restart": 1},
        {"time": 105.0, "event": "ready", "step": 0},
        {"time": 115.0, "event": "finished"},
    ]
    lines = [{"step": s, "time": 105.0 + s, "step_time_s": 1.0, "restart": 1} for s in range(1, 11)]
    g = account(events, lines)
    p = g["parts"]
    assert g["wall_s"] == 115.0
    assert p["queue_s"] == 10.0 + 2.0 + 1.0 and p["down_s"] == 40.0 + 20.0
    assert p["startup_s"] == 28.0 + 4.0 and p["productive_s"] == 10.0
    assert sum(p.values()) == pytest.approx(g["wall_s"]) and p["other_s"] == 0.0


def _with_config(path: Path, config: dict) -> Path:
    plan = json.loads((path / "plan.json").read_text())
    (path / "plan.json").write_text(json.dumps({**plan, "config": {**plan["config"], **config}}))
    return path


def test_a_sweep_names_each_run_by_the_keys_that_differ(tmp_path):
    a = _with_config(write_run(tmp_path / "transformer-1a", {1: 5.0, 2: 4.0}),
                     {"optim": {"lr": 1e-3, "beta1": 0.9}, "run": {"name": "transformer-1a"}})
    b = _with_config(write_run(tmp_path / "transformer-2b", {1: 5.0, 2: 4.1}),
                     {"optim": {"lr": 3e-3, "beta1": 0.9}, "run": {"name": "transformer-2b"}})
    proc = run_main("dtk.report", str(a), str(b))
    assert proc.returncode == 0, proc.stderr
    assert f"run          {a}  (optim.lr=0.001)" in proc.stdout
    assert "repeatability of" not in proc.stdout and "diverged" not in proc.stdout  # a sweep is no repeatability pair
    assert "sweep: 2 runs of different configurations (no repeatability verdict)" in proc.stdout
    assert _png(a / "report" / "loss.png")[1] == "curves=2: optim.lr=0.001, optim.lr=0.003"
    alone = json.loads(run_main("dtk.report", str(a), "--json", "--no-plots").stdout)["runs"][0]
    assert alone["label"] == "transformer-1a"


def test_the_phases_legend_is_beside_the_bars_not_over_them(tmp_path):
    run = load_run(write_run(tmp_path / "a", {s: 5.0 - s / 10 for s in range(1, 21)}))
    fig = phase_breakdown(run)
    fig.tight_layout()
    fig.canvas.draw()
    ax = fig.axes[0]
    legend, plot = ax.get_legend().get_window_extent(), ax.get_window_extent()
    assert legend.x0 >= plot.x1  # wholly right of the axes: no bar is under it
    assert len(ax.get_legend().get_texts()) == len(PHASES)


def test_a_run_shorter_than_the_sampling_interval_has_one_system_sample(tmp_path):
    from dtk.common.rundir import read_jsonl
    from dtk.report.numbers import system_load
    from dtk.train.system import SystemSampler

    path = tmp_path / "system.jsonl"
    sampler = SystemSampler(path, interval_s=3600.0, rank=0).start()
    sampler.stop()
    samples = list(read_jsonl(path))
    assert len(samples) == 1 and samples[0]["cpu_percent"] is not None
    assert system_load(samples)["samples"] == 1


def _with_eval(path: Path, records: list[dict]) -> Path:
    (path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_validation_metrics_of_eval_jsonl_are_shown(tmp_path):
    a = _with_eval(write_run(tmp_path / "a", {s: 5.0 - s / 10 for s in range(1, 21)}), [
        {"step": 10, "val_loss": 3.25, "val_accuracy": 0.5, "val_samples": 64, "seconds": 0.1},
        {"step": 20, "val_loss": 3.5, "val_accuracy": 0.75, "val_samples": 64, "seconds": 0.1}])
    proc = run_main("dtk.report", str(a), "--no-plots")
    assert proc.returncode == 0, proc.stderr
    assert ("validation   val_loss 3.500000 at step 20, val_accuracy 0.75 (2 evaluation(s); first 3.250000 at step 10,"
            " best 3.250000 at step 10)") in proc.stdout
    v = json.loads(run_main("dtk.report", str(a), "--json", "--no-plots").stdout)["runs"][0]["validation"]
    assert (v["step"], v["val_loss"], v["metrics"], v["evaluations"]) == (20, 3.5, {"val_accuracy": 0.75}, 2)
    b = write_run(tmp_path / "b", {1: 5.0, 2: 4.0})
    assert "validation   - (no eval.jsonl" in run_main("dtk.report", str(b), "--no-plots").stdout


def test_a_sweep_is_a_table_of_each_runs_losses_and_speed(tmp_path):
    runs = []
    for i, lr in enumerate((1e-3, 3e-3, 1e-2)):
        path = write_run(tmp_path / f"r{i}", {1: 5.0, 2: 4.0 - i / 10, 3: 3.0 - i / 10})
        _with_config(path, {"optim": {"lr": lr}})
        plan = json.loads((path / "plan.json").read_text())
        (path / "plan.json").write_text(json.dumps({**plan, "config_hash": f"hash{i}"}))
        runs.append(_with_eval(path, [{"step": 3, "val_loss": 3.5 - i / 10}]))
    proc = run_main("dtk.report", *map(str, runs), "--no-plots")
    assert proc.returncode == 0, proc.stderr
    assert "diverged" not in proc.stdout and "repeatability of" not in proc.stdout
    table = proc.stdout.split("sweep: 3 runs")[1].splitlines()
    assert table[2].split() == ["optim.lr=0.001", "3", "3.000000", "3.500000", "1,280"]
    assert table[4].split() == ["optim.lr=0.01", "3", "2.800000", "3.300000", "1,280"]
    sweep = json.loads(run_main("dtk.report", *map(str, runs), "--json", "--no-plots").stdout)["sweep"]
    assert [r["run"] for r in sweep] == ["optim.lr=0.001", "optim.lr=0.003", "optim.lr=0.01"]


def _layout(path: Path, scheme: str) -> Path:
    _with_config(path, {"scheme": {"name": scheme}, "optim": {"lr": 0.003}})
    plan = json.loads((path / "plan.json").read_text())
    (path / "plan.json").write_text(json.dumps({**plan, "config_hash": "samehash"}))
    return path


def test_one_run_on_another_scheme_is_equal_within_float_tolerance_not_diverged(tmp_path):
    """DDP here and FSDP on the lab: the same run identity; their losses agree to ~1e-7 at the
    first step and drift with training, at step 99 past 1e-3 but below the loss's own
    step-to-step change."""
    curve = {s: 3.0 + 0.5 * ((s * 7919) % 13) / 13 - s / 100 for s in range(1, 101)}
    drift = {s: v * (1 + 1e-7 * 1.1 ** s) for s, v in curve.items()}  # 1.3e-3 relative at step 99
    ddp = _layout(write_run(tmp_path / "ddp", curve), "ddp")
    fsdp = _layout(write_run(tmp_path / "fsdp", drift), "fsdp")
    proc = run_main("dtk.report", str(ddp), str(fsdp), "--no-plots")
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("repeatability"))
    assert "equal within float tolerance (one run identity; differs in scheme.name)" in line, line
    assert "step 1 agrees to 1.1e-07 relative" in line and "largest relative difference 0.00" in line
    # A real difference shows at the first step, where both compute from the same weights and batch.
    broken = _layout(write_run(tmp_path / "broken", {s: v * (1 + 1e-4) for s, v in curve.items()}), "fsdp")
    v = json.loads(run_main("dtk.report", str(ddp), str(broken), "--json", "--no-plots").stdout)["repeatability"][0]
    assert (v["verdict"], v["diverged_at_step"]) == ("diverged", 1)
    # The same config (not another layout) keeps the plain tolerance: 1e-3 is 1e-3.
    same = _layout(write_run(tmp_path / "same", drift), "ddp")
    v = json.loads(run_main("dtk.report", str(ddp), str(same), "--json", "--no-plots").stdout)["repeatability"][0]
    assert v["verdict"] == "diverged" and v["diverged_at_step"] > 90
