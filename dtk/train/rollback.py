"""The rollback of a divergence (dtk.train.divergence), inside the running worker: every
rank reached the same verdict at the same step. The save in flight is settled; rank 0
picks the newest committed checkpoint before the first bad step; the memory tier, if on,
finishes its snapshot in flight and every node removes its snapshots newer than that step
(the memory tier's generation goes up: dtk.checkpoint.memory.store); then rank 0 removes
the newer disk checkpoints from the run's store (RUN_DIR/checkpoints/ or checkpoint.dir's object
store: they hold the abandoned steps, a later resume must not start from them), records the
skipped data window in RUN_DIR/data_skips.json (which counts the generation for a later
start) and writes `rolled_back`; then every rank loads that checkpoint and reads the new
order. The steps from there to the rollback are redone: lost work in the goodput account.

The snapshots go first: a crash after them and before the skip record leaves a run whose
newest state on either tier is the rollback's checkpoint, and one after the record finds
only snapshots of the old generation, which no restore takes.
"""

from __future__ import annotations

from typing import Any

from dtk.common.rundir import RunDir
from dtk.common.storage import checkpoint_folder, checkpoint_steps, committed_steps
from dtk.config.schema import FaultConfig
from dtk.train.divergence import Diverged, DivergenceWatch, Rollback, diverged_line, read_skips, record_skip


def divergence_watch(fault: FaultConfig, run: RunDir, *, start_step: int, comm: Any) -> DivergenceWatch:
    """Collective. The watch of a start: the rollbacks made so far, and after a resume the
    window and bad steps of its checkpoint's step (rank 0 reads metrics.jsonl, all get it)."""
    watch = DivergenceWatch(spike_factor=fault.spike_factor, spike_window=fault.spike_window,
                            rollback_after=fault.rollback_after, rollback_window=fault.rollback_window,
                            max_rollbacks=fault.max_rollbacks, rollbacks_done=len(read_skips(run.path)))
    if start_step:
        # Enough steps back for a full window of good losses around the bad ones of a rollback window.
        since = start_step - 2 * (fault.spike_window + fault.rollback_window)
        records = comm.broadcast({s: r for s, r in run.latest_metrics().items() if since < s <= start_step}
                                 if comm.rank == 0 else None)
        watch.restore(records, up_to=start_step)
    return watch


def roll_back(rollback: Rollback, run: RunDir, checkpoints: Any, batches: Any, trainer: Any, *, rank0: bool) -> int:
    """Collective. Returns the step training goes on from."""
    bad = rollback.bad
    first, last = bad[0].step, bad[-1].step
    checkpoints.wait()  # the save in flight is committed (or failed) before the choice
    to_step = None
    store = checkpoints.store  # RUN_DIR/checkpoints/ or the object store's prefix (checkpoint.dir)
    if rank0:
        before = [s for s in committed_steps(store) if s < first]
        to_step = before[-1] if before else None
    to_step = checkpoints.comm.broadcast(to_step)
    if checkpoints.memory is not None and to_step is not None:
        checkpoints.memory.rolled_back(to_step)
    if rank0:
        if to_step is not None:
            for step, folder, _ in checkpoint_steps(store):
                if step > to_step:
                    folder.retire("rolled-back", ignore_errors=True)  # no listing sees half a folder
            window = [batches.data_step(first - 1), batches.data_step(last - 1)]
            skip = {"from_step": first, "num_steps": last - first + 1, "data_window": window,
                    "checkpoint_step": to_step, "steps": [b.step for b in bad],
                    "causes": [b.cause for b in bad], "batch_hashes": [b.batch_hash for b in bad]}
            record_skip(run.path, skip)
            run.event("rolled_back", step=first, last_bad_step=last, cause=bad[0].cause, to_step=to_step,
                      checkpoint=str(checkpoint_folder(store, to_step)), data_window=window,
                      batch_hashes=skip["batch_hashes"], rollback=trainer.watch.rollbacks_done,
                      redone_steps=first - 1 - to_step)
    checkpoints.comm.barrier()  # the record is written before any rank goes on
    if to_step is None:
        if rank0:
            run.event("diverged", step=last, steps=[b.step for b in bad], batch_hashes=[b.batch_hash for b in bad])
        raise Diverged(diverged_line(bad, rollbacks=trainer.watch.rollbacks_done - 1,
                                     reason=f"no verified checkpoint before step {first} to roll back to"))
    start = checkpoints.resume()  # the newest that verifies: the rollback's checkpoint, or one before it
    batches.set_skips(read_skips(run.path))
    trainer.watch.rolled_back(start)
    return start
