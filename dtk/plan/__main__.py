"""python -m dtk.plan [--config-dir DIR] [overrides] [--json]: the plan of a job and its memory
budget, without launching it."""

from __future__ import annotations

import argparse
import json
import os

from dtk.common.errors import ArgumentParser, UserError, run_cli
from dtk.config.compose import add_config_dir, compose, search_path
from dtk.plan.cost.inputs import visible_gpus
from dtk.plan.plan import make_plan

DESCRIPTION = """Compose and check the configuration exactly as dtk.submit would, and print the plan:
world size, parallel degrees, batch arithmetic, run directory; and the memory budget:
bytes per device of parameters, gradients, optimizer state, activations, buffers and
margin under the job's scheme and every other scheme at the same node count, whether it
fits, the smallest device and node counts that fit, traffic per mesh axis, the predicted
step time (on a GPU of known peak), and the recommended layout: searched over schemes,
degrees, activation checkpointing, CPU offload, micro-batch and node count, with its
predicted step, tokens/s and MFU and the next 3 alternatives. Nothing is created.

Groups (choose with GROUP=NAME): cluster, model, data, optim, checkpoint, task; scheme
is added with +scheme=NAME (without one, a multi-worker job is DDP). A project folder's
own groups come first: the current folder's conf/, --config-dir DIR, DTK_CONFIG_PATH."""


class _PlanParser(ArgumentParser):
    """Its help ends with every key, read from the schemas only when --help asks for it."""

    def format_help(self) -> str:
        from dtk.config.docs import render_keys

        return super().format_help() + "\nkeys (KEY=VALUE; default; meaning):\n" + render_keys() + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = _PlanParser(prog="python -m dtk.plan", description=DESCRIPTION,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print the plan and the memory budget as JSON")
    add_config_dir(parser)
    parser.add_overrides()
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_intermixed_args(argv)
    search = search_path(args.config_dirs)
    search.activate()
    cfg = compose(args.overrides, search=search)
    gpus = visible_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"))
    try:
        plan = make_plan(cfg, import_path=search.modules, local_gpus=gpus)
    except UserError as refused:
        from dtk.plan.cost.search import names_a_layout

        if names_a_layout(args.overrides) or not str(refused).startswith("train.global_batch="):
            raise
        return _search_without_layout(args, search, gpus, cfg, refused)

    from dtk.plan.cost.inputs import context
    from dtk.plan.cost.report import memory_plan

    budget = memory_plan(context(cfg, plan, config_dirs=search.config), plan)
    if args.json:
        print(json.dumps({"plan": json.loads(plan.to_json()), **budget.to_json()}, indent=2, default=str))
    else:
        print(plan.describe() + "\n\n" + budget.describe())
    return 0


def _search_without_layout(args, search, gpus: int, cfg, refused: UserError) -> int:
    """The job names no layout, and the default's data-parallel size does not split its
    batch: no reason to refuse. The search plans the job from a layout that splits it (the
    job as given is not planned) and prints its recommendation."""
    from dtk.plan.cost.inputs import context
    from dtk.plan.cost.report import memory_plan
    from dtk.plan.cost.search import stand_ins

    world = cfg.nodes * cfg.tasks_per_node
    for layout in stand_ins(world, cfg.tasks_per_node, cfg.train.global_batch):
        standing = compose([*args.overrides, *layout], search=search)
        try:
            plan = make_plan(standing, import_path=search.modules, local_gpus=gpus)
        except UserError:
            continue
        budget = memory_plan(context(standing, plan, config_dirs=search.config), plan)
        if args.json:
            found = budget.to_json()
            print(json.dumps({"as_given": str(refused), "recommended": found["recommended"],
                              "alternatives": found["alternatives"]}, indent=2, default=str))
        else:
            lines = budget.describe().split("\n\n")[0].splitlines()
            searched = lines[next(i for i, line in enumerate(lines) if line.startswith("recommended")):]
            print("\n".join([f"as given    {refused} (no layout named: the search plans one)", *searched]))
        return 0
    raise refused


if __name__ == "__main__":
    run_cli(main)
