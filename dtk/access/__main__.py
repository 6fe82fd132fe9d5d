"""python -m dtk.access {show,prepare,audit}: access policies (conf/access/*.yaml).

    python -m dtk.access show team                       roles, groups, members, what each may do
    python -m dtk.access prepare /shared/team --policy team
                                                         the team folder and run root (as root)
    python -m dtk.access audit /shared/team/runs         the audit log, every entry verified
                                                         (exit 1 when it is not intact)
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from dtk.access import layout
from dtk.access.policy import enforced, load_policy, policy_file
from dtk.access.text import render
from dtk.common import audit
from dtk.common.errors import ArgumentParser, UserError, run_cli


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m dtk.access", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="a policy's roles, groups, members and what each may do")
    show.add_argument("policy", help="a policy name (conf/access/NAME.yaml) or a YAML file")
    prep = sub.add_parser("prepare", help="create or repair the team folder and run root of a policy")
    prep.add_argument("team", type=Path, help="the team folder; the run root is TEAM/runs")
    prep.add_argument("--policy", required=True, help="a policy name (conf/access/NAME.yaml) or a YAML file")
    log = sub.add_parser("audit", help="a run root's audit log, each entry's writer and chain verified")
    log.add_argument("run_root", type=Path, metavar="RUN_ROOT", help="a run root (or a team folder: its runs/)")
    return parser


def show_audit(run_root: Path) -> int:
    """Every genuine entry, then what is wrong with the log; exit 1 when anything is."""
    if (run_root / layout.POLICY_FILE).is_file():
        run_root = run_root / layout.RUNS
    if not (run_root / audit.AUDIT_DIR).is_dir() and not (run_root / audit.OLD_FILE).exists():
        raise UserError(f"{run_root}: no audit log there ({audit.AUDIT_DIR}/); give a run root (run.root) or a"
                        " team folder")
    log = audit.verify(run_root)
    print(f"audit log {run_root / audit.AUDIT_DIR}: {len(log.entries)} genuine entries")
    print("\n".join(f"  {audit.describe(e)}" for e in log.entries) or "  (none)")
    if not log.problems:
        print("intact: every entry was written by the user it names and follows the one before it")
        return 0
    print(f"NOT INTACT: {len(log.problems)} problem(s)")
    print("\n".join(f"  {p}" for p in log.problems))
    return 1


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "audit":
        return show_audit(args.run_root)
    policy = load_policy(args.policy)
    if args.command == "show":
        print(render(policy))
        return 0
    if not enforced(policy):
        raise UserError(f"--policy {args.policy}: the open policy names no group; there is nothing to prepare")
    team = Path(os.path.abspath(args.team))  # not resolved: a link at TEAM is refused, not followed
    for line in layout.prepare(team, policy, policy_file(args.policy).read_text()):
        print(line)
    print(f"run root: run.root={team.parent.resolve() / team.name / layout.RUNS} access={policy.name}")
    return 0


if __name__ == "__main__":
    from dtk.access.check import explain_denied

    run_cli(main, on_denied=explain_denied)
