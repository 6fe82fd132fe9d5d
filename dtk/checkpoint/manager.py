"""When to save, what to resume from, what to keep: the checkpoint policy of one worker."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any

from dtk.checkpoint import load as loading
from dtk.checkpoint import sharded as ckpt
from dtk.checkpoint.manifest import Rejected
from dtk.checkpoint.retention import prune
from dtk.common.errors import UserError
from dtk.common.rundir import RunDir
from dtk.common.storage import LocalStorage, checkpoint_folder, checkpoint_steps, run_storage
from dtk.config.schema import CheckpointConfig
from dtk.mesh.mesh import ParallelMesh

LOAD_DELAY_ENV = "DTK_TEST_LOAD_DELAY_S"
"""Seconds each rank waits before loading a checkpoint at a start: for tests of a load that
outlasts fault.startup_timeout_s (tests/test_liveness.py). Unset in real runs."""


class CheckpointManager:
    """Every rank holds one; all its methods are collective unless they say otherwise."""

    def __init__(
        self,
        run: RunDir,
        *,
        checkpoint: CheckpointConfig,
        parts: ckpt.Parts,
        scheduler: Any,
        mesh: ParallelMesh,
        global_batch: int,
        total_steps: int,
        identity: dict[str, Any],
        memory: Callable[[ckpt.Parts, Any, dict[str, Any]], Any] | None = None,
        busy: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
    ) -> None:
        self.run = run
        self.store = run_storage(run, checkpoint.dir)  # the run's checkpoints/, or an object store's prefix
        self.busy = busy  # wraps a long save or wait: the heartbeat beats through it
        self.every = checkpoint.every
        self.every_s = 60.0 * checkpoint.every_minutes
        self.keep = checkpoint.keep
        self.max_failures = checkpoint.max_failures
        self.failures = 0  # saves failed in a row (every rank counts the same: failures are agreed)
        self.parts = parts  # (model part, its optimizer): one pair, or one per pipeline stage held
        self.scheduler = scheduler
        self.rank = mesh.global_rank
        self.world_size = mesh.world_size
        self.global_batch = global_batch
        self.total_steps = total_steps
        # config hash, data version, scheme, mesh degrees: recorded in every checkpoint
        self.identity = {**identity, "mesh": dataclasses.asdict(mesh.degrees)}
        self.comm = ckpt.Comm.create()
        # The minutes-based trigger needs all ranks to agree on a step; it votes on a group of
        # its own because the checkpoint group may be busy with a background save.
        self._vote = ckpt.Comm.create() if self.every_s > 0 else None
        self._saver = ckpt.Saver(self.comm, asynchronous=checkpoint.async_save, on_commit=self._committed,
                                 process=checkpoint.async_mode == "process")
        if checkpoint.async_save:
            self._guard_state(parts)
        self._last_save_t = time.monotonic()
        self.verified_step: int | None = None  # newest checkpoint known good: retention never deletes it
        self.rng_restored = False
        self._last_step: int | None = None  # the step of the newest save started by this process
        self._inflight: int | None = None  # the step of the save not yet known committed or failed
        self._rejected: set[int] = set()  # committed folders that failed verification on resume
        # checkpoint.memory_every: the in-memory tier (dtk.checkpoint.memory.tier), built by the worker
        self.memory_every = checkpoint.memory_every
        self._resumed_once = False
        self._last_snapshot: int | None = None
        self._snapshot_failures_seen = 0
        # What a snapshot must share with this start to be restored: the run and its data, as
        # for a disk checkpoint; the mesh and scheme may differ (the restore reshards).
        same_run = {k: self.identity.get(k) for k in ("config_hash", "data_version")}
        self.memory = memory(parts, scheduler, same_run) if memory is not None and self.memory_every else None

    def _guard_state(self, parts: ckpt.Parts) -> None:
        """An async save copies the state in the background while training goes on: what
        changes the state in place waits for the copy first. Parameters and optimizer state
        change only in the optimizer step; buffers that are saved (a BatchNorm's running
        statistics) may change in any forward, so a model that has them waits before it."""
        for module, optimizer in parts:
            optimizer.register_step_pre_hook(lambda *_: self._staged())
            if any(name not in m._non_persistent_buffers_set
                   for m in module.modules() for name, b in m._buffers.items() if b is not None):
                module.register_forward_pre_hook(lambda *_: self._staged())

    def _staged(self) -> None:
        # The wait for the copy is part of the save (the first one pins its host buffers:
        # tens of GB take tens of seconds): busy time, not a hang.
        if self._saver.staging:
            with self.busy():
                self._saver.staged()

    # --- resume -------------------------------------------------------------------------

    def resume(self) -> int:
        """Load the newest checkpoint that verifies and return its step (0: none, start fresh).

        Folders are tried newest first; one that fails verification (no manifest, a missing,
        short or changed file) is logged as `checkpoint_rejected` and the previous one is
        tried. If committed checkpoints exist but none verifies, the job stops: starting
        from scratch would silently throw away the run. A load that fails for another reason
        (memory, I/O) stops the job on every rank with its cause (CheckpointLoadError) and
        rejects nothing (dtk.checkpoint.load).
        """
        # checkpoint.resume=false is refused at submission where committed checkpoints exist
        # (dtk.launch.launch.check_run_dir), and the run lock keeps other jobs out: what is
        # found here was written by this submission's own earlier starts, so it resumes.
        names = self.comm.broadcast([(step, folder.name, committed) for step, folder, committed
                                     in checkpoint_steps(self.store)] if self.rank == 0 else None)
        found = [(step, self.store.child(name), committed) for step, name, committed in names]
        memory_fallback = None
        if self.memory is not None and not self._resumed_once:  # a rollback's resume goes to the disk
            self._resumed_once = True
            disk_step = max((step for step, _, committed in found if committed), default=0)
            choice, tiers, seconds = self.memory.restore(disk_step=disk_step)
            if choice.step is not None:
                return self._restored(choice, tiers, seconds)
            memory_fallback = choice.reason
        reasons = []
        for step, path, committed in reversed(found):
            t0 = time.perf_counter()
            if os.environ.get(LOAD_DELAY_ENV):  # a test hook: a checkpoint that takes long to load
                time.sleep(float(os.environ[LOAD_DELAY_ENV]))
            try:
                if not committed:
                    raise Rejected("no manifest.json: the save did not finish, or the manifest was deleted")
                manifest = loading.verify(self.comm, path, checksums=False)  # sizes; CRCs while loading
                verified_t = time.perf_counter()
                self._check_identity(manifest, path)
                state, self.rng_restored = self._load(path, manifest)
            except Rejected as exc:
                self._reject(step, path, str(exc))
                if committed:
                    reasons.append(f"step {step}: {exc}")
                    self._rejected.add(step)  # a save of this step may replace it
                continue
            self.scheduler.load_state_dict(state["scheduler"])
            for module, _ in self.parts:  # told the step it resumed (+sync: another replica count)
                if (after_load := getattr(module, "after_load", None)) is not None:
                    after_load(state["step"], self.run if self.rank == 0 else None)
            assert state["samples_consumed"] == state["step"] * self.global_batch, "data position and step disagree"
            self.verified_step = self._last_step = step
            self._last_save_t = time.monotonic()
            if self.rank == 0:
                self.run.event(
                    "checkpoint_loaded",
                    step=state["step"],
                    path=str(path),
                    from_world_size=state["world_size"],
                    samples_consumed=state["samples_consumed"],
                    seconds=round(time.perf_counter() - t0, 6),
                    # the manifest and file sizes, then the load that checks every file's CRC as
                    # it reads it (files it did not read whole after it): where a slow start went
                    verify_seconds=round(verified_t - t0, 6),
                    load_seconds=round(time.perf_counter() - verified_t, 6),
                    tier="disk",
                    **({"memory_fallback": memory_fallback} if memory_fallback else {}),
                )
            return state["step"]
        if memory_fallback and not reasons and self.rank == 0:  # nothing on disk either: from scratch
            self.run.event("memory_fallback", step=0, reason=memory_fallback)
        if reasons:
            raise UserError(
                f"checkpoints exist in {self.store} but none verifies ({'; '.join(reasons)});"
                " the run stops instead of starting from scratch: restore a checkpoint,"
                " or start a new run (another run.name)"
            )
        return 0

    def _restored(self, choice: Any, tiers: dict[int, str], seconds: float) -> int:
        """The bookkeeping of a start from the memory tier (dtk.checkpoint.memory.tier)."""
        step = choice.step
        # the snapshot's world size: every rank's own streams; another: fresh ones, as from disk
        self.rng_restored = choice.from_world == self.world_size
        self._last_save_t = time.monotonic()
        if self.rank == 0:
            peers = sorted(r for r, tier in tiers.items() if tier == "peer")
            self.run.event("checkpoint_loaded", step=step, tier="peer" if peers else "memory", peer_ranks=peers,
                           from_world_size=choice.from_world, samples_consumed=step * self.global_batch,
                           seconds=round(seconds, 6))
        return step

    def _load(self, path, manifest: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        try:
            return loading.load(path, parts=self.parts, comm=self.comm, manifest=manifest)
        except loading.CheckpointLoadError as exc:  # every rank, same cause: the checkpoint is kept
            raise loading.CheckpointLoadError(
                f"{exc}; the checkpoint verified and is kept (not rejected): the job stops instead of"
                " falling back to an older one. Fix the cause, then run the same command again"
            ) from exc

    def _check_identity(self, manifest: dict[str, Any], path) -> None:
        """A checkpoint of another configuration or dataset is the user's problem, not a
        corrupt file: falling back to an older one would have the same mismatch."""
        for key in ("config_hash", "data_version"):
            have, want = manifest.get(key), self.identity.get(key)
            if have is not None and want is not None and have != want:
                hint = (
                    "the dataset changed since this run started; resuming on other data would not"
                    " reproduce the run - restore the dataset, or start a new run (another run.name)"
                    if key == "data_version"
                    else "the run directory holds another configuration; choose another run.name"
                )
                raise UserError(f"{key}: checkpoint {path.name} was written with {have}, this job has {want}: {hint}")
        written = manifest.get("global_batch")
        if written is not None and written != self.global_batch:
            raise UserError(
                f"train.global_batch={self.global_batch}: checkpoint {path.name} was written with"
                f" global batch {manifest['global_batch']}; the data position would not match"
            )
        for module, _ in self.parts:  # a part that adapts its keys to the checkpoint (+sync: dtk.train.sync.Anchor)
            if (before_load := getattr(module, "before_load", None)) is not None:
                before_load(manifest)

    def _reject(self, step: int, path, reason: str) -> None:
        if self.rank == 0:
            print(f"checkpoint {path.name} rejected: {reason}", file=sys.stderr, flush=True)
            self.run.event("checkpoint_rejected", step=step, path=str(path), reason=reason)

    # --- save ---------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether the step interval (or the last step) asks for a save. Local, no collective."""
        return step == self.total_steps or bool(self.every and step % self.every == 0)

    def _minutes_due(self) -> bool:
        """Collective: whether any rank's clock says `every_minutes` have passed."""
        if self._vote is None:
            return False
        return self._vote.any(time.monotonic() - self._last_save_t >= self.every_s)

    def save(self, step: int) -> None:
        """Start a checkpoint of `step` (asynchronous unless checkpoint.async_save=false). The
        previous one is committed first. Saving a step already saved is a no-op. A save that
        fails does not stop training (`checkpoint_failed`; the next interval tries again)
        until checkpoint.max_failures failed in a row."""
        if step == self._last_step:
            return
        self._settle()
        self._last_step = step
        path = checkpoint_folder(self.store, step)
        samples = step * self.global_batch  # the loader's whole state: global samples consumed
        state = {
            "step": step,
            "samples_consumed": samples,
            "global_batch": self.global_batch,
            "scheduler": self.scheduler.state_dict(),
            "world_size": self.world_size,
            **self.identity,
        }
        header = {
            "step": step,
            "samples_consumed": samples,
            "global_batch": self.global_batch,
            "world_size": self.world_size,
            **self.identity,
        }
        self._last_save_t = time.monotonic()
        self._inflight = step
        try:
            with self.busy():
                self._saver.start(path, parts=self.parts, trainer_state=state, header=header,
                                  replace_committed=step in self._rejected)
        except ckpt.SaveFailed as exc:
            self._failed(str(exc))
            return
        if not self._saver.asynchronous:
            self._settle()

    def _settle(self) -> None:
        """Collective: wait for the save in flight and count how it ended."""
        try:
            with self.busy():
                self._saver.wait()
        except ckpt.SaveFailed as exc:
            self._failed(str(exc))
            return
        if self._inflight is not None:
            self.verified_step, self._inflight, self.failures = self._inflight, None, 0

    def _failed(self, reason: str) -> None:
        step, self._inflight = self._inflight, None
        self.failures += 1
        if self.rank == 0:
            try:  # torch words a full disk obscurely ("unexpected pos"): say how much room is left
                if isinstance(self.store, LocalStorage):  # an object store has no free space to tell
                    reason += f" ({shutil.disk_usage(self.store.path).free / 2**20:.1f} MiB free on the checkpoint storage)"
            except OSError:
                pass
            print(f"checkpoint of step {step} failed: {reason}", file=sys.stderr, flush=True)
            try:
                self.run.event("checkpoint_failed", step=step, reason=reason, failures_in_a_row=self.failures)
            except OSError:  # the storage of the run directory itself is gone: the line above says it
                pass
        if self.failures >= self.max_failures:
            raise UserError(
                f"checkpoint.max_failures={self.max_failures}: {self.failures} saves in a row failed (the last, of"
                f" step {step}: {reason}); the run stops. The newest verified checkpoint"
                f" (step {self.verified_step or 'none'}) is intact: fix the checkpoint storage, then run the same"
                " command again to resume from it"
            )

    def _committed(self, manifest: dict[str, Any]) -> None:
        """Rank 0, in the finisher thread, right after the manifest of a save was written."""
        step = manifest["step"]
        prune(self.store, keep=self.keep, current_step=step, protect=[step])
        self.run.event(
            "checkpoint_saved",
            step=step,
            path=str(checkpoint_folder(self.store, step)),
            seconds=manifest["save_seconds"],
            blocked_seconds=manifest["blocked_seconds"],
            staging_seconds=manifest["staging_seconds"],  # async: the copy to host memory, beside training
            bytes=sum(f["size"] for f in manifest["files"].values()),
            asynchronous=self._saver.asynchronous,
        )

    def after_step(self, step: int, _result: Any = None) -> None:
        """The checkpoint policy: a save when the step interval or the minutes ask for one."""
        if self.due(step) or self._minutes_due():
            self.save(step)
        if self.memory is not None and step % self.memory_every == 0 and step != self.total_steps:
            self.memory.snapshot(step)  # the previous snapshot is finished first
            self._last_snapshot = step
            self._report_snapshot_failures()

    def _report_snapshot_failures(self) -> None:
        """Rank 0: a `memory_snapshot_failed` event for each snapshot no rank kept (every rank
        has the same reasons: the tier's gather shares them); training goes on."""
        if self.memory is None:
            return
        new = self.memory.failures[self._snapshot_failures_seen:]
        self._snapshot_failures_seen += len(new)
        if self.rank != 0:
            return
        for step, reason in new:
            try:
                self.run.event("memory_snapshot_failed", step=step, reason=reason)
            except OSError:  # the run directory's storage is gone: the worker's log says it
                pass

    @property
    def last_started(self) -> int | None:
        """The step of the newest save started (or loaded) by this process; every rank agrees."""
        return self._last_step

    @property
    def last_kept(self) -> int | None:
        """The newest step a save or a memory snapshot started at (every rank agrees): a relaunch
        may resume there, so the metrics of the steps before it are written then."""
        return max((s for s in (self._last_step, self._last_snapshot) if s is not None), default=None)

    @property
    def saving(self) -> bool:
        """Whether a save is still being written or committed in the background (this rank)."""
        return self._saver.busy

    def wait(self) -> None:
        """Block until the save in flight is committed or counted as failed."""
        self._settle()

    def close(self) -> None:
        """Commit the save still in flight; after this the manager saves nothing more."""
        try:
            self._settle()
        finally:
            self._saver.close()
            if self.memory is not None:  # durable on disk (finished, stopped): the store goes
                self.memory.close(discard=self.verified_step is not None and self.verified_step == self._last_step)
                self._report_snapshot_failures()
