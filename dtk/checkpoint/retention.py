"""Which checkpoint folders to delete after a commit. No torch: rank 0 and tools call it."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterable
from typing import Any

from dtk.checkpoint.storage import Storage, checkpoint_steps
from dtk.common.rundir import RunDir


def doomed(found: list[tuple[int, Any, bool]], *, keep: int, current_step: int, protect: Iterable[int] = ()) -> list[Any]:
    """The folders to delete, given (step, folder, committed) oldest first, right after the
    checkpoint of `current_step` was committed.

    - Committed checkpoints up to `current_step`: the newest `keep` stay, and so does every
      step in `protect` (the newest verified one: the one just committed, or the one this
      run resumed from).
    - Folders without a manifest older than the newest committed one: saves that were killed.
    - Folders newer than `current_step`: the future of an abandoned timeline - checkpoints
      that were rejected on resume, or a killed save of a step this run has not reached
      again. Keeping them would let a count-based rule delete good checkpoints in their favour.
    """
    assert keep >= 1
    keep_steps = set(protect) | {current_step}
    committed = [step for step, _, ok in found if ok and step <= current_step]
    keep_steps |= set(committed[-keep:])
    out = []
    for step, path, ok in found:
        if step > current_step:
            out.append(path)
        elif ok and step not in keep_steps:
            out.append(path)
        elif not ok and step < current_step:
            out.append(path)
    return out


def prune(run: RunDir | Storage, *, keep: int, current_step: int, protect: Iterable[int] = ()) -> list[Any]:
    """Rank 0 only: delete what `doomed` names (in the run directory, or in a checkpoint
    store: dtk.checkpoint.storage); returns the deleted folders."""
    found = run.checkpoint_steps() if isinstance(run, RunDir) else checkpoint_steps(run)
    paths = doomed(found, keep=keep, current_step=current_step, protect=protect)
    for p in paths:
        if isinstance(p, Storage):
            with contextlib.suppress(OSError):
                p.delete()
        else:
            shutil.rmtree(p, ignore_errors=True)
    return paths
