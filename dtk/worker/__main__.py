import os
import sys

# The caching allocator's expandable segments (before torch starts CUDA): fewer out-of-memory
# errors from fragmentation when micro-batch shapes vary. A setting of the user's wins.
from dtk.worker.allocator import allocator_env

os.environ.update(allocator_env(os.environ))

# Before anything imports torch (seconds): a time-limit USR2 or a SIGTERM that arrives while
# the worker starts is recorded, not fatal (dtk.worker.signals).
from dtk.worker.signals import stop_flag

stop_flag()

from dtk.errors import UserError  # noqa: E402
from dtk.worker.codes import EXIT_CONFIG  # noqa: E402
from dtk.worker.main import main  # noqa: E402

try:
    code = main(sys.argv[1:])
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
