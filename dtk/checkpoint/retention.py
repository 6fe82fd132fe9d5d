"""Which checkpoint folders to delete after a commit. No torch: rank 0 and tools call it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

from dtk.common.rundir import RunDir
from dtk.common.storage import Storage, checkpoint_steps, checkpoints_of


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


def prune(run: RunDir | Storage, *, keep: int, current_step: int, protect: Iterable[int] = ()) -> list[Storage]:
    """Rank 0 only: delete what `doomed` names in a checkpoint store (dtk.common.storage; a
    run's: where its checkpoint.dir puts them); returns the deleted folders."""
    store = checkpoints_of(run) if isinstance(run, RunDir) else run
    folders: list[Storage] = doomed(checkpoint_steps(store), keep=keep, current_step=current_step, protect=protect)
    for folder in folders:
        with contextlib.suppress(OSError):
            folder.delete()
    return folders
