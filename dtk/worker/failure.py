"""The record a worker leaves when it dies of an exception, for the driver's decision.

A bug in the user's code (a non-contiguous `view` in a loss) fails every start the same
way: relaunching it only spends `fault.max_restarts` starts (a queue wait each on Slurm)
before the error is shown. So a worker that dies of an exception writes what it died of
to its start's log folder (RUN_DIR/logs/start_NN/error_rank_R.json, dtk.common.rundir's
WORKER_ERROR) before the traceback: the exception's type and message, and the innermost
frame of the traceback outside dtk, torch, the standard library and installed packages:
the user's file and line (none when every frame is theirs, as for a lost peer). The
driver (dtk/driver/decide.py) compares the record of a start with the previous start's.

A user's data function (`data._target_`) that raises before the run's first step (no step
completed, no checkpoint: a missing file) is a configuration error instead
(`data_function_errors`): one `error:` line, exit 2, no relaunch; later, its failure is a
crash like any other (a flaky read is relaunched; a repeated one is the rule above).

No torch here: what is excluded is found from the modules' own paths.
"""

from __future__ import annotations

import site
import sys
import sysconfig
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

from dtk.common.errors import UserError
from dtk.common.rundir import RunDir, write_json_atomic
from dtk.config.choices import DataKind


def _library_roots() -> tuple[str, ...]:
    """Folders whose frames are not the user's: dtk, torch, the standard library and the
    installed packages (site-packages, where torch, numpy and h5py live)."""
    roots = {Path(__file__).resolve().parents[1]}  # dtk/
    torch_file = getattr(sys.modules.get("torch"), "__file__", None)
    if torch_file:
        roots.add(Path(torch_file).parent)
    paths = sysconfig.get_paths()
    roots.update(Path(paths[key]) for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths)
    roots.update(Path(p) for p in site.getsitepackages())
    return tuple(str(r.resolve()) + "/" for r in roots)


def user_frame(tb: TracebackType | None) -> tuple[str, int] | None:
    """(file, line) of the innermost frame outside the library roots; None when there is none."""
    roots = _library_roots()
    for frame in reversed(traceback.extract_tb(tb)):
        name = frame.filename
        if name.startswith("<"):  # <frozen importlib._bootstrap>, <string>
            continue
        if not str(Path(name).resolve()).startswith(roots):
            return name, frame.lineno or 0
    return None


def exception_record(exc: BaseException) -> dict[str, Any]:
    """The record's fields: type (qualified outside builtins), message, file, line."""
    kind = type(exc)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    where = user_frame(exc.__traceback__)
    return {"type": name, "message": str(exc), "file": where[0] if where else None,
            "line": where[1] if where else None}


def record_exception(run: RunDir, *, start: int, rank: int, exc: BaseException) -> None:
    """Write this rank's record; a record that cannot be written only costs the decision."""
    try:
        write_json_atomic(run.worker_error(start, rank), {"rank": rank, "start": start, **exception_record(exc)})
    except OSError as err:
        print(f"worker {rank}: could not record the exception for the driver: {err}", file=sys.stderr)


@contextmanager
def data_function_errors(data: Any, *, first: bool) -> Iterator[None]:
    """Around building the datasets: an exception of a user's data function before the run's
    first step (`first`) is a configuration error, one line naming the function,
    the exception and the user's file:line. Nothing was trained, so there is nothing to
    resume, and starting again reads the same missing file."""
    try:
        yield
    except UserError:
        raise
    except Exception as exc:
        if not first or data.kind != DataKind.user:
            raise
        record = exception_record(exc)
        message = (record["message"].strip().splitlines() or [""])[0]
        where = f" at {record['file']}:{record['line']}" if record["file"] else ""
        raise UserError(f"data._target_={data._target_} failed before the run's first step: {record['type']}:"
                        f" {message}{where}") from exc
