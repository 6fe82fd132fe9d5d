"""python -m dtk.report RUN_DIR [RUN_DIR ...] [--json] [--baseline RUN_DIR] [--out DIR]

No torch: a report of finished or running runs is read on the login node.
"""

from __future__ import annotations

import json

from dtk.common.errors import check_out, run_cli
from dtk.report.assemble import build_parser, render, report


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.out is not None:
        check_out(args.out, folder=True)
    out = report(args)
    print(json.dumps(out, indent=2, default=str) if args.json else render(out))
    return 0


if __name__ == "__main__":
    run_cli(main)
