import sys

from dtk.worker.entry import run

run(sys.argv[1:])
