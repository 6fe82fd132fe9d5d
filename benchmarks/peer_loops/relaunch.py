"""A small relaunch wrapper, as a user of a plain loop or of Fabric writes one: run the
command; when it fails, run it again (the loop resumes from its last checkpoint), up to
--max-restarts times. PEER_RESTART tells the loop which start it is.

    python relaunch.py --max-restarts 3 -- torchrun --nproc-per-node 2 plain_ddp.py OUT ...
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-restarts", type=int, default=3)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    for restart in range(args.max_restarts + 1):
        code = subprocess.run(command, env={**os.environ, "PEER_RESTART": str(restart)}).returncode
        if code == 0:
            return
        print(f"relaunch: exit {code}, restart {restart + 1}", file=sys.stderr, flush=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
