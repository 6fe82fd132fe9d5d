"""python -m dtk.plan [overrides] [--json]: the plan of a job, without launching it."""

from __future__ import annotations

from dtk.config.compose import compose
from dtk.errors import run_cli
from dtk.plan.plan import make_plan

USAGE = """usage: python -m dtk.plan [KEY=VALUE ...] [+scheme=NAME] [--json]

Compose and check the configuration exactly as dtk.submit would, and print the plan:
world size, parallel degrees, batch arithmetic, run directory. Nothing is created.

Groups (choose with GROUP=NAME): cluster, model, data, optim, checkpoint; scheme is
added with +scheme=NAME (without one, a multi-worker job is DDP).

Keys (KEY=VALUE; default; meaning):
"""


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        from dtk.config.docs import render_keys

        print(USAGE + render_keys())
        return 0
    as_json = "--json" in argv
    plan = make_plan(compose([a for a in argv if a != "--json"]))
    print(plan.to_json() if as_json else plan.describe())
    return 0


if __name__ == "__main__":
    run_cli(main)
