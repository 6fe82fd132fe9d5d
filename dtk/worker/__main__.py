from dtk.errors import run_cli
from dtk.worker.main import main

run_cli(main)
