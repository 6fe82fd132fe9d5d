"""A real MLflow tracking server for the tracker tests: `mlflow server` on a free port with
a SQLite store in a temporary folder, up until the test ends; and what it holds, read back
through the MLflow client (one run, every step once)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from conftest import require


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def mlflow_server(folder: Path, host: str = "127.0.0.1") -> Iterator[str]:
    """The server's tracking URI while it runs; stopped (its process group) afterwards."""
    import importlib.util

    require(importlib.util.find_spec("mlflow") is not None, "mlflow is not installed (pip install -e .[dev])")
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port(host)
    log = open(folder / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", host, "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}", "--default-artifact-root", str(folder / "art")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        # No job runner (its consumer processes): tracking is all the tests use.
        env=dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false"))
    uri = f"http://{host}:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (folder / "server.log").read_text()[-3000:]
            time.sleep(0.2)
        yield uri
    finally:  # the whole group at once: SQLite committed every request, nothing is left to save
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()


def the_one_run(uri: str, run_dir: Path) -> tuple[str, Counter]:
    """The one MLflow run of a dtk run directory (there must be exactly one: by its tag or
    its name) and how often each step appears in its loss history."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])
            if r.data.tags.get("dtk.run_dir") == str(run_dir) or r.info.run_name == run_dir.name]
    assert len(runs) == 1, [(r.info.run_id, r.info.run_name, r.data.tags) for r in runs]
    run = runs[0]
    assert run.info.run_name == run_dir.name and run.data.tags["dtk.run_dir"] == str(run_dir), run.data.tags
    history = client.get_metric_history(run.info.run_id, "loss")
    return run.info.run_id, Counter(m.step for m in history)
