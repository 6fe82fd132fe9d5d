"""Deleting one checkpoint by hand (`python -m dtk.checkpoint delete`). No torch.

The checkpoint is taken away so that a resume or a listing never sees half of it
(`Storage.retire`): a local folder is first renamed out of the `step_NNNNNNNN` pattern, in
one atomic step, then removed; in an object store (checkpoint.dir=s3://...) its manifest,
the commit, goes first. The newest verified checkpoint, the one a resume starts from, is
kept unless the caller insists. Verified means what a resume checks: sizes, CRCs and a
`.metadata` of DCP metadata only; sizes alone would take a corrupt newest checkpoint for the
good one and let the only usable one go.
"""

from __future__ import annotations

import os
from pathlib import Path

from dtk.checkpoint.manifest import Listing, Rejected, list_checkpoints, verify
from dtk.common import audit
from dtk.common.errors import UserError
from dtk.common.rundir import RunDir
from dtk.common.storage import LocalStorage, checkpoint_folder, checkpoints_of


def delete_checkpoint(run_dir: Path, *, step: int, force: bool = False) -> str:
    """Delete the checkpoint of `step`, record who did it; returns what was done."""
    run = RunDir(Path(run_dir))
    if not run.path.is_dir():
        raise UserError(f"RUN_DIR {run_dir}: no such run directory")
    store = checkpoints_of(run)  # checkpoint.dir: the run's checkpoints/ folder, or an object store
    found = {c.step: c for c in list_checkpoints(store, checksums=False)}
    if step not in found:
        have = ", ".join(str(s) for s in sorted(found)) or "none"
        raise UserError(f"--step {step}: no checkpoint of that step in {store} (steps: {have})")
    verified = [] if force else newest_verified(found, num=2)  # --force needs no verdict
    if verified and step == verified[0]:
        earlier = f"step {verified[1]}" if len(verified) > 1 else "the start"
        raise UserError(f"--step {step} is the newest verified checkpoint, the one a resume starts from; deleting it"
                        f" sends the next resume back to {earlier}. Add --force to delete it anyway")
    folder = checkpoint_folder(store, step)
    if isinstance(store, LocalStorage) and isinstance(folder, LocalStorage):
        check_local_writable(store.path, folder.path)
    try:
        folder.retire("deleting")
    except PermissionError as exc:  # an object store's refusal (a local one is checked above)
        raise UserError(f"cannot delete {folder} as user {audit.current_user()['name']}: {exc}") from None
    audit.record_run(run.path, "delete_checkpoint", step=step, forced=force)
    return f"deleted checkpoint step {step} ({folder})"


def check_local_writable(checkpoints: Path, folder: Path) -> None:
    """Every folder that loses an entry must be writable, or rmtree would stop half-way."""
    blocked = [d for d in [checkpoints, folder, *(p for p in folder.rglob("*") if p.is_dir())]
               if not os.access(d, os.W_OK | os.X_OK)]
    if blocked:
        raise UserError(f"cannot delete {folder} as user {audit.current_user()['name']}: {blocked[0]} is not"
                        " writable for you; deleting checkpoints takes the maintainer role (see docs/access.md)")


def newest_verified(found: dict[int, Listing], *, num: int) -> list[int]:
    """The `num` newest steps that verify in full (CRCs read), newest first. Candidates are
    those whose sizes match, read newest first until `num` verify: a delete reads only the
    checkpoints it must."""
    out: list[int] = []
    for s in sorted((s for s, c in found.items() if c.verified), reverse=True):
        if len(out) == num:
            break
        try:
            verify(found[s].path)
        except Rejected:
            continue
        out.append(s)
    return out
