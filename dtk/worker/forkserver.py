"""`python -m dtk.worker.forkserver`: the local driver's worker factory. It imports what every
worker imports (torch, DCP, the training stack: about 2.3 s of CPU, dtk/worker/main.py) once,
then forks each worker of the run from itself when the driver asks, so a start of N workers
and every relaunch costs a fork per worker instead of an interpreter and its imports.

It runs no torch operation and starts no thread (the children would inherit neither a thread
pool nor CUDA safely); a child sets its environment, log and session and then runs the
worker exactly as `python -m dtk.worker` does (dtk.worker.entry).

The driver (dtk.driver.forkserver) talks to it in JSON lines: on stdin requests
`{"id": N, "args": [...], "env": {...}, "log": PATH}`; on stdout `{"ready": PID}` once, then
`{"id": N, "pid": PID}` for each fork and `{"exit": PID, "code": C, "at": T}` when a child
ends (C as Popen's returncode: negative for a signal; T when the server learnt of the end,
woken by the child's pidfd: see `serve`). End of stdin (the driver closed it, or died) ends
it; its children get SIGTERM when it goes (PR_SET_PDEATHSIG), as they would from the driver.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a child (before exec, or in this server and its forks): get SIGTERM when the parent
    dies, even by SIGKILL, so no orphaned worker goes on writing into a run that a new driver
    may start again. Linux only; elsewhere a child outlives a killed parent. The local driver
    (dtk.driver.local) uses it for its workers and this server."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _child(request: dict[str, Any]) -> NoReturn:
    try:
        os.setsid()  # a session of its own, as the driver gives its workers: a Ctrl-C reaches the driver alone
        die_with_parent()
        for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["dtk.worker", *request["args"]]
        from dtk.worker.entry import run

        run(list(request["args"]))
    except BaseException:  # noqa: BLE001 - a child never returns into the server's loop
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def _say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main() -> None:
    die_with_parent()
    t0 = time.perf_counter()
    import dtk.worker.main  # noqa: F401 - the imports every worker needs, made once here

    print(f"fork server {os.getpid()}: imported the worker's modules in {time.perf_counter() - t0:.2f} s",
          file=sys.stderr, flush=True)
    serve(_child)


def serve(child: Callable[[dict[str, Any]], NoReturn]) -> None:
    """Answer requests on stdin until it ends: fork, and in the fork run `child(request)`.

    A child's end is reported as soon as the kernel says it ended (a pidfd per child in the
    selector), so that the order of the reports is the order of the deaths: when one worker
    is killed and its peers fail on the broken connection a few milliseconds later, the
    driver blames the first. Where pidfds are missing (Linux before 5.3) a sweep every
    0.05 s finds the ends, and deaths within one sweep are reported as simultaneous."""
    _say({"ready": os.getpid()})
    selector = selectors.DefaultSelector()
    stdin = sys.stdin.fileno()
    selector.register(stdin, selectors.EVENT_READ)
    pending = b""
    children: set[int] = set()
    while True:
        ready = selector.select(timeout=0.05)
        woke = time.time()
        ended: set[int] = set()  # children whose pidfd says they ended when the select returned
        for key, _events in ready:
            if key.data is not None:
                ended.add(key.data)
                _unwatch(selector, key.data)
                continue
            data = os.read(stdin, 1 << 20)
            if not data:
                return
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush()  # nothing buffered for a child to inherit
                pid = os.fork()
                if pid == 0:
                    try:
                        for key in selector.get_map().values():  # the child's copies of its siblings' pidfds
                            if key.data is not None:
                                os.close(key.fd)
                        selector.close()
                        child(request)
                    finally:
                        os._exit(1)  # never back into this loop
                children.add(pid)
                _watch(selector, pid)
                _say({"id": request["id"], "pid": pid})
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            _unwatch(selector, pid)  # reaped before its pidfd was seen: the end came after the select
            _say({"exit": pid, "code": os.waitstatus_to_exitcode(status), "at": woke if pid in ended else time.time()})


def _watch(selector: selectors.BaseSelector, pid: int) -> None:
    """Have the selector wake when child `pid` ends (its pidfd turns readable; the key's data is the pid)."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        return  # no pidfds here: the sweep finds its end
    selector.register(fd, selectors.EVENT_READ, pid)


def _unwatch(selector: selectors.BaseSelector, pid: int) -> None:
    """Unregister and close child `pid`'s pidfd, if it has one still."""
    for key in list(selector.get_map().values()):
        if key.data == pid:
            selector.unregister(key.fd)
            os.close(key.fd)


if __name__ == "__main__":
    main()
