"""python -m dtk.plan [overrides] [--json]: the plan of a job, without launching it."""

from __future__ import annotations

from dtk.config.compose import compose, pop_config_dirs, search_path
from dtk.errors import run_cli
from dtk.plan.plan import make_plan

USAGE = """usage: python -m dtk.plan [--config-dir DIR] [KEY=VALUE ...] [+scheme=NAME] [--json]

Compose and check the configuration exactly as dtk.submit would, and print the plan:
world size, parallel degrees, batch arithmetic, run directory. Nothing is created.

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
    plan = make_plan(compose([a for a in argv if a != "--json"], search=search), import_path=search.modules)
    print(plan.to_json() if as_json else plan.describe())
    return 0


if __name__ == "__main__":
    run_cli(main)
