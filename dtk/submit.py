"""python -m dtk.submit [-m] [--config-dir DIR] [overrides...]: compose -> validate -> plan -> launch."""

from __future__ import annotations

import argparse

from dtk.config.compose import CONFIG_DIR_FLAG, compose, expand_sweep, search_path
from dtk.errors import ArgumentParser, run_cli
from dtk.plan.plan import Plan, make_plan

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


def add_config_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(CONFIG_DIR_FLAG, dest="config_dirs", action="append", default=[], metavar="DIR",
                        help="a project folder (python -m dtk.init DIR) whose config groups and modules come first;"
                             " repeatable")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m dtk.submit", description=DESCRIPTION, epilog=EPILOG,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-m", "--multirun", action="store_true",
                        help="a sweep: one job per combination of comma-separated values (Hydra's syntax)")
    add_config_dir(parser)
    parser.add_overrides()
    return parser


def plan_points(overrides: list[str], multirun: bool, config_dirs: list[str] | None = None) -> list[tuple[list[str], Plan]]:
    """Compose and plan every point first, so one bad point stops the sweep before any launch."""
    from dtk.data.hdf5 import check_config

    search = search_path(config_dirs or [])
    search.activate()
    points = expand_sweep(overrides) if multirun else [overrides]
    planned = [(point, make_plan(compose(point, search=search), import_path=search.modules)) for point in points]
    for _, plan in planned:
        # The one check that reads files: a dataset that is missing or does not fit the
        # model is an error here, not in every worker after the job waited in the queue.
        check_config(plan.config.data, plan.config.model)
    return planned


def main(argv: list[str]) -> int:
    args = build_parser().parse_intermixed_args(argv)
    multirun = args.multirun
    planned = plan_points(args.overrides, multirun, args.config_dirs)

    from dtk.launch.launch import Launched, describe_launch, launch

    results = []
    for point, plan in planned:
        if multirun:
            print(f"=== {' '.join(point) or '(defaults)'}", flush=True)
        if plan.config.submit.dry_run:
            print(describe_launch(plan))
            results.append(Launched(0))
        else:
            results.append(launch(plan))
    if multirun:
        print(f"\n{'job':>10}  {'code':>4}  run directory")
        for (_, plan), result in zip(planned, results, strict=True):
            print(f"{result.job_id or '-':>10}  {result.code:>4}  {plan.run_dir}")
    return max(r.code for r in results)


if __name__ == "__main__":
    run_cli(main)
