"""python -m dtk.access {show,prepare}: access policies (conf/access/*.yaml).

    python -m dtk.access show team                       roles, groups, members, what each may do
    python -m dtk.access prepare /shared/team --policy team
                                                         the team folder and run root (as root)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dtk.access import layout
from dtk.access.policy import ROLE_MAY, ROLES, enforced, group_members, load_policy, policy_file
from dtk.config.access import AccessConfig
from dtk.errors import ArgumentParser, UserError, run_cli


def render(policy: AccessConfig) -> str:
    """The policy as a team reads it: who holds each role today and what it may do."""
    lines = [f"access policy {policy.name}"]
    if not enforced(policy):
        return lines[0] + ": open (no group is checked; run directories keep each user's umask)"
    for role in ROLES:
        group = getattr(policy, role).group
        try:
            members = ", ".join(sorted(group_members(group))) or "nobody"
        except UserError:
            members = "(the group does not exist on this machine)"
        lines.append(f"  {role:<10}  group {group:<14}  may {ROLE_MAY[role]}")
        lines.append(f"  {'':<10}  members: {members}")
    slurm = [f"{key} {getattr(policy.submitter, key)}" for key in ("partition", "account", "qos")
             if getattr(policy.submitter, key)]
    if slurm:
        lines.append(f"  submitters' jobs: {', '.join(slurm)}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m dtk.access", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="a policy's roles, groups, members and what each may do")
    show.add_argument("policy", help="a policy name (conf/access/NAME.yaml) or a YAML file")
    prep = sub.add_parser("prepare", help="create or repair the team folder and run root of a policy")
    prep.add_argument("team", type=Path, help="the team folder; the run root is TEAM/runs")
    prep.add_argument("--policy", required=True, help="a policy name (conf/access/NAME.yaml) or a YAML file")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    policy = load_policy(args.policy)
    if args.command == "show":
        print(render(policy))
        return 0
    if not enforced(policy):
        raise UserError(f"--policy {args.policy}: the open policy names no group; there is nothing to prepare")
    for line in layout.prepare(args.team.resolve(), policy, policy_file(args.policy).read_text()):
        print(line)
    print(f"run root: run.root={args.team.resolve() / layout.RUNS} access={policy.name}")
    return 0


if __name__ == "__main__":
    run_cli(main)
