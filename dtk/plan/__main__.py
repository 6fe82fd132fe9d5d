"""python -m dtk.plan [overrides] [--json]: the plan of a job and its memory budget, without launching it."""

from __future__ import annotations

import json

from dtk.config.compose import compose, pop_config_dirs, search_path
from dtk.errors import run_cli
from dtk.plan.plan import make_plan

USAGE = """usage: python -m dtk.plan [--config-dir DIR] [KEY=VALUE ...] [+scheme=NAME] [--json]

Compose and check the configuration exactly as dtk.submit would, and print the plan:
world size, parallel degrees, batch arithmetic, run directory; and the memory budget:
bytes per device of parameters, gradients, optimizer state, activations, buffers and
margin under the job's scheme and every other scheme at the same node count, whether it
fits, the smallest device and node counts that fit, traffic per mesh axis, and the
recommended scheme. Nothing is created.

Groups (choose with GROUP=NAME): cluster, model, data, optim, checkpoint, task; scheme
is added with +scheme=NAME (without one, a multi-worker job is DDP). A project folder's
own groups come first: the current folder's conf/, --config-dir DIR, DTK_CONFIG_PATH.

Keys (KEY=VALUE; default; meaning):
"""


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        from dtk.config.docs import render_keys

        print(USAGE + render_keys())
        return 0
    config_dirs, argv = pop_config_dirs(argv)
    as_json = "--json" in argv
    search = search_path(config_dirs)
    search.activate()
    cfg = compose([a for a in argv if a != "--json"], search=search)
    plan = make_plan(cfg, import_path=search.modules)

    from dtk.plan.inputs import context
    from dtk.plan.report import memory_plan

    budget = memory_plan(context(cfg, plan, config_dirs=search.config), plan)
    if as_json:
        print(json.dumps({"plan": json.loads(plan.to_json()), **budget.to_json()}, indent=2, default=str))
    else:
        print(plan.describe() + "\n\n" + budget.describe())
    return 0


if __name__ == "__main__":
    run_cli(main)
