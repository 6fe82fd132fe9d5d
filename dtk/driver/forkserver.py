"""The local driver's side of the worker fork server (dtk.worker.forkserver): one server per
run, started at the first start, kept through relaunches, closed at the end.

`ForkServer.spawn` has `spawn_worker`'s signature and returns a `ForkedWorker`, which
answers what the driver asks of a worker process (`pid`, `poll`, `wait`, `send_signal`,
`kill`, `returncode`) as a Popen does. The server, not the driver, is the workers' parent: it
reaps them and reports each exit code on its stdout, which a thread here reads.

No torch here; the server imports it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

READY_TIMEOUT_S = 300.0  # the server's imports, on a busy machine
REPLY_TIMEOUT_S = 60.0


class ForkServerFailed(RuntimeError):
    """The fork server did not start or stopped answering; the driver starts its workers as
    processes of their own instead."""


class ForkServer:
    def __init__(self, *, env: dict[str, str], log: Path, pass_fds: tuple[int, ...] = (),
                 preexec_fn: Any = None) -> None:
        self._log = open(log, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dtk.worker.forkserver"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log, env={**env, "PYTHONUNBUFFERED": "1"}, start_new_session=True, preexec_fn=preexec_fn,
            pass_fds=pass_fds)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._stdin: IO[bytes] = self.proc.stdin
        self._changed = threading.Condition()
        self._ready = False
        self._pids: dict[int, int] = {}  # request id -> pid
        self.codes: dict[int, int] = {}  # pid -> exit code, once it ended
        self.ended: dict[int, float] = {}  # pid -> when it ended (the server's clock)
        self._next_id = 0
        self._reader = threading.Thread(target=self._read, args=(self.proc.stdout,), name="dtk-forkserver",
                                        daemon=True)
        self._reader.start()
        with self._changed:
            if not self._changed.wait_for(lambda: self._ready or self.proc.poll() is not None, READY_TIMEOUT_S) \
                    or not self._ready:
                self.close()
                raise ForkServerFailed(f"the worker fork server did not start (see {log})")

    def _read(self, stream: IO[bytes]) -> None:
        for line in stream:
            message = json.loads(line)
            with self._changed:
                if "ready" in message:
                    self._ready = True
                elif "exit" in message:
                    self.codes[message["exit"]] = message["code"]
                    self.ended[message["exit"]] = message["at"]
                else:
                    self._pids[message["id"]] = message["pid"]
                self._changed.notify_all()
        with self._changed:  # the server is gone
            self._changed.notify_all()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def spawn(self, argv: list[str], *, env: dict[str, str], log: Path) -> ForkedWorker:
        """One worker, forked by the server: `argv` is what `spawn_worker` would run
        (`python -m dtk.worker RUN_DIR`); its arguments after the module go to the worker.
        No descriptors to pass: the children inherit the ones the server got at its start."""
        args = argv[argv.index("dtk.worker") + 1:]
        with self._changed:
            request_id = self._next_id
            self._next_id += 1
            try:
                self._stdin.write((json.dumps({"id": request_id, "args": args, "env": env, "log": str(log)})
                                   + "\n").encode())
                self._stdin.flush()
            except (BrokenPipeError, OSError) as exc:
                raise ForkServerFailed(f"the worker fork server is gone ({exc})") from None
            if not self._changed.wait_for(lambda: request_id in self._pids or not self.alive, REPLY_TIMEOUT_S) \
                    or request_id not in self._pids:
                raise ForkServerFailed("the worker fork server did not fork the worker")
            return ForkedWorker(self, self._pids[request_id])

    def exit_code(self, pid: int) -> int | None:
        with self._changed:
            if pid in self.codes:
                return self.codes[pid]
            if self.alive or self._reader.is_alive():
                return None
        # The server died without reporting: its children got SIGTERM (PR_SET_PDEATHSIG).
        try:
            os.kill(pid, 0)
            return None
        except ProcessLookupError:
            return -signal.SIGTERM

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        with self._changed:
            self._changed.wait_for(lambda: pid in self.codes or not self._reader.is_alive(), timeout)
        return self.exit_code(pid)

    def close(self) -> None:
        """End the server (its workers have ended: the driver stopped them first)."""
        try:
            self._stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


class ForkedWorker:
    """A worker the fork server forked, as a Popen answers for it."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.server, self.pid = server, pid

    @property
    def returncode(self) -> int | None:
        return self.server.exit_code(self.pid)

    @property
    def ended_at(self) -> float | None:
        """When it ended, as its parent saw it: which of several workers died first."""
        return self.server.ended.get(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self.server.wait_exit(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
