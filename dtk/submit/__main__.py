"""python -m dtk.submit [-m] [--config-dir DIR] [overrides...]: compose -> validate -> plan -> launch."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dtk.common.errors import ArgumentParser, UserError, run_cli
from dtk.common.rundir import PLAN_MD
from dtk.config.compose import add_config_dir, compose, expand_sweep, search_path
from dtk.plan.cost.inputs import visible_gpus
from dtk.plan.plan import Plan, make_plan

if TYPE_CHECKING:
    from dtk.plan.cost.report import MemoryPlan

DESCRIPTION = """Compose the job's configuration from conf/ and the overrides, check it, and launch it
(default: cluster=local, 2 worker processes on this machine). Config groups and Python
modules of your own project folder (python -m dtk.init DIR) come first: from the current
folder when it has a conf/, from --config-dir DIR, or from DTK_CONFIG_PATH=DIR1:DIR2."""

EPILOG = """examples:
  python -m dtk.submit                                   train the default job here
  python -m dtk.submit +scheme=ddp tasks_per_node=4      4 workers, DDP
  python -m dtk.submit train.steps=50 submit.dry_run=true   show the launch, start nothing
  python -m dtk.submit -m optim.lr=1e-3,3e-4             one job per learning rate

Running the same command again continues the same run (run.name is derived from the
config). python -m dtk.plan --help lists every key with its meaning.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m dtk.submit", description=DESCRIPTION, epilog=EPILOG,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--multirun", action="store_true",
                        help="a sweep: one job per combination of comma-separated values (Hydra's syntax)")
    add_config_dir(parser)
    parser.add_overrides()
    return parser


@dataclass(frozen=True)
class Point:
    overrides: list[str]
    plan: Plan
    budget: MemoryPlan | None
    """The memory budget (None: not judged, the model could not be counted)."""
    note: str | None = None

    def files(self) -> dict[str, str]:
        """What the run directory gets besides config and plan: plan.md (dtk.plan.cost.handout)."""
        from dtk.plan.cost.handout import plan_markdown

        return {PLAN_MD: plan_markdown(self.plan, self.budget, self.note)}


BUDGET_KEYS = ("param_bytes", "grad_bytes", "optimizer_bytes")
"""plan.* keys that change the bytes the memory gate counts, not the model the workers build."""


def refuse_whatif(cfg) -> None:
    """plan.* model keys describe a model python -m dtk.plan plans without it being written;
    a submitted job trains its `model` group, whose shape is not the what-if's. The bytes
    keys change what the memory gate counts, not what the workers hold (fp32 parameters,
    gradients and AdamW's moments): with them a job that does not fit would pass the gate."""
    from dtk.plan.cost.whatif import whatif_keys

    keys = whatif_keys(cfg)
    if keys:
        given = " ".join(f"plan.{k}={v:g}" if isinstance(v, float) else f"plan.{k}={v}" for k, v in keys.items())
        raise UserError(f"{given}: what-if keys plan a model that is not written yet; dtk.submit trains the model"
                        " group (model=..., model.dim=...), so drop the plan.* keys (python -m dtk.plan takes them)")
    budget = {k: getattr(cfg.plan, k) for k in BUDGET_KEYS if getattr(cfg.plan, k) is not None}
    if budget:
        given = " ".join(f"plan.{k}={v:g}" for k, v in budget.items())
        raise UserError(f"{given}: bytes per element change what the memory check counts, not what the workers"
                        " hold; dtk.submit checks the job as it trains, so drop them (python -m dtk.plan takes"
                        " them; submit.force=true submits a job the check refuses)")


def plan_points(overrides: list[str], multirun: bool, config_dirs: list[str] | None = None) -> list[Point]:
    """Compose, plan and check every point first, so one bad point stops the sweep before any
    launch. A point whose memory does not fit is refused (one error line, exit 2); in a
    sweep it is skipped with one line and the rest go on."""
    from dtk.data.hdf5 import check_config
    from dtk.launch.launch import check_trackers
    from dtk.plan.cost.gate import check, planned_memory

    search = search_path(config_dirs or [])
    search.activate()
    points = expand_sweep(overrides) if multirun else [overrides]
    gpus = visible_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"))  # the local cluster's default workers
    composed = [(point, compose(point, search=search)) for point in points]
    for _, cfg in composed:
        refuse_whatif(cfg)
        check_trackers(cfg.train)
    planned = [(point, cfg, make_plan(cfg, import_path=search.modules, local_gpus=gpus)) for point, cfg in composed]
    for _, _, plan in planned:
        # The one check that reads files: a dataset that is missing or does not fit the
        # model is an error here, not in every worker after the job waited in the queue.
        check_config(plan.config.data, plan.config.model, eval_every=plan.config.train.eval_every,
                     global_batch=plan.global_batch)
    kept = []
    for point, cfg, plan in planned:
        checked = check(cfg, plan, search.config)
        if checked.refusal and not multirun:
            raise UserError(checked.refusal)
        if checked.refusal:
            print(f"skipped: {' '.join(point) or '(defaults)'}: {checked.refusal}", flush=True)
            continue
        if checked.note:
            print(f"note: {checked.note}", file=sys.stderr, flush=True)
        plan = dataclasses.replace(plan, memory=planned_memory(cfg, plan, checked))  # read by the workers
        kept.append(Point(point, plan, checked.budget, checked.note))
    if not kept:
        raise UserError(f"none of the sweep's {len(planned)} points fits; nothing submitted")
    return kept


def main(argv: list[str]) -> int:
    args = build_parser().parse_intermixed_args(argv)
    multirun = args.multirun
    points = plan_points(args.overrides, multirun, args.config_dirs)

    from dtk.launch.launch import check_run_root
    from dtk.submit.start import Launched, describe_launch, launch

    for p in points:
        if p.plan.config.submit.dry_run:  # a dry run says now what the real one would refuse
            check_run_root(Path(p.plan.run_dir).parent)

    results = []
    for p in points:
        if multirun:
            print(f"=== {' '.join(p.overrides) or '(defaults)'}", flush=True)
        if p.plan.config.submit.dry_run:
            print(describe_launch(p.plan))
            results.append(Launched(0))
        else:
            results.append(launch(p.plan, p.files()))
    if multirun:
        print(f"\n{'job':>10}  {'code':>4}  run directory")
        for p, result in zip(points, results, strict=True):
            print(f"{result.job_id or '-':>10}  {result.code:>4}  {p.plan.run_dir}")
    return max(r.code for r in results)


if __name__ == "__main__":
    from dtk.access.check import explain_denied

    run_cli(main, on_denied=explain_denied)
