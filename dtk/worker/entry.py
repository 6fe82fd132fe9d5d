"""A worker's life from its first line to its exit code: what `python -m dtk.worker RUN_DIR`
runs, and what a worker forked from the local fork server (dtk.worker.forkserver) runs.

Kept free of torch at import: `run` sets what must be set before torch starts (the CUDA
allocator's settings, the stop flag's signal handlers), then imports the worker."""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def run(argv: list[str]) -> NoReturn:
    # The caching allocator's expandable segments (before torch starts CUDA): fewer out-of-memory
    # errors from fragmentation when micro-batch shapes vary. A setting of the user's wins.
    from dtk.worker.allocator import allocator_env

    os.environ.update(allocator_env(os.environ))

    # Before anything imports torch (seconds): a time-limit USR2 or a SIGTERM that arrives while
    # the worker starts is recorded, not fatal (dtk.worker.signals).
    from dtk.worker.signals import stop_flag

    stop_flag()

    from dtk.common.errors import UserError
    from dtk.worker.codes import EXIT_CONFIG
    from dtk.worker.main import main

    try:
        code = main(argv)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = EXIT_CONFIG
    # Everything that matters is on disk (the checkpoint committed, the summary written), and
    # the process group is destroyed. Leave without interpreter teardown: background threads
    # of torch's C++ side (gloo, async checkpoint staging) occasionally abort the process in
    # their destructors at exit ("terminate called without an active exception"), which would
    # turn a finished run into a failed exit code. An exception above still exits with its
    # traceback and code 1.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
