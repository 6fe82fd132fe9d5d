"""Replicas that synchronize every `sync.every` optimizer steps instead of every step
(`+sync=local_sgd` or `+sync=diloco`; docs/schemes.md, "Synchronizing less often").

Between two synchronizations each data-parallel replica (a coordinate of the dp_replicate
axis) trains on its own share of each global batch with its own optimizer (the run's
`optim`, the inner optimizer): the model is not wrapped in DDP, and FSDP, where the scheme
has it, shards over dp_shard inside the replica only (dtk.parallel.parallelize's
`local_replicas`). Every `sync.every` steps the replicas talk once, over dp_replicate:

    local_sgd   the parameters' mean over the replicas replaces each replica's own
    diloco      the mean of the replicas' deltas since the last synchronization (the
                pseudo-gradient, anchor - own) is the gradient of an outer SGD
                (sync.outer_lr, outer_momentum, Nesterov) over the anchor, the parameters
                of the last synchronization; the new anchor replaces each replica's own

Either way one all-reduce of the whole model per `sync.every` steps, instead of one per
step; the run's last step synchronizes too, so a finished run holds one model. Every rank computes the same result from the same reduced bytes, so after a
synchronization the replicas hold identical parameters.

Streaming (`sync.fragments=F`): the parameters are cut into F fragments (`fragments_of`:
whole tensors in the model's order, about equal in elements) and fragment f synchronizes
after the steps s with s % H == f x H/F, so fragment 0 keeps the schedule of F=1 and each
later one follows H/F steps after the one before; each fragment waits H steps between its
synchronizations, and the run's last step synchronizes every fragment. Each all-reduce
carries 1/F of the model. diloco's outer SGD steps only the fragment's anchors (the others
have no gradient, so their momentum is untouched): each fragment has its own outer state.
F=1 is the whole model at once, the same operations as before the key existed.

A checkpoint between two synchronizations must hold what differs between replicas: each
replica's parameters and inner optimizer state are saved under keys of its own
(`replica0.`, `replica1.`, ...: `ReplicaModel`), beside the anchor and the outer optimizer's
state, which every replica holds alike (`synced.`: `Anchor`). A resume on the same number
of replicas is therefore bitwise. On another number (`resume_from`, told by the checkpoint
manager the manifest's `sync_replicas`) replica r loads the state of replica r mod N (N:
the replicas that wrote it), then every replica's parameters are set to the anchor: at a
synchronization (F=1, a step that is a multiple of H) that is the state every replica
held, so nothing is lost but the replicas' own inner optimizer states beyond N; between
synchronizations the replicas' inner progress since each fragment's last synchronization
is dropped (the data position stays: those samples are not read again), said in one line
and the event `sync_replicas_changed`.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from dtk.common.errors import UserError
from dtk.common.rundir import RunDir
from dtk.config.choices import SyncDtype, SyncMode
from dtk.config.schema import SyncConfig
from dtk.mesh.mesh import ParallelMesh
from dtk.plan.degrees import Axis

DTYPES = {SyncDtype.float32: torch.float32, SyncDtype.bfloat16: torch.bfloat16}
"""What diloco's all-reduce sends of each sync.dtype (tests/test_choices.py holds it to the Enum)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's elements of a parameter: an FSDP shard's local tensor, else the tensor (a view: writes reach it)."""
    return t.to_local() if isinstance(t, DTensor) else t


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters the synchronization averages, each once (a tied weight is one parameter)."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


class ReplicaModel(nn.Module):
    """The model under its replica's name, for the checkpoint only: the keys of its
    parameters and of its optimizer's state start with `replica<R>.`, so replicas whose
    state differs between synchronizations never write the same key."""

    def __init__(self, model: nn.Module, replica: int) -> None:
        super().__init__()
        self.add_module(f"replica{replica}", model)

    def named_as(self, replica: int) -> None:
        """Its keys become replica `replica`'s (to load another replica's state, then back)."""
        ((_, model),) = self._modules.items()
        self._modules.clear()
        self.add_module(f"replica{replica}", model)


class Anchor(nn.Module):
    """The parameters as of the last synchronization (`synced.<name>`, dots as `/`), equal on
    every replica: diloco's outer optimizer updates them, and a checkpoint holds them with
    that optimizer's state."""

    def __init__(self, params: list[tuple[str, nn.Parameter]], sync: Synchronizer) -> None:
        super().__init__()
        self.synced = nn.ParameterDict({name.replace(".", "/"): nn.Parameter(p.detach().clone()) for name, p in params})
        self._sync: Synchronizer  # a plain reference, no submodule (nn.Module's setattr would not do)
        object.__setattr__(self, "_sync", sync)

    def before_load(self, manifest: dict[str, Any]) -> None:
        """The checkpoint manager, before it loads a checkpoint of this run: who wrote it."""
        self._sync.resume_from(manifest["sync_replicas"])

    def after_load(self, step: int, run: RunDir | None) -> None:
        """The checkpoint manager, after the load of `step` (`run` on global rank 0 only)."""
        self._sync.resumed(step, run=run)


def fragments_of(sizes: list[int], count: int) -> list[list[int]]:
    """Positions 0..len(sizes)-1 (the parameters in the model's order, `sizes` their elements)
    cut into `count` contiguous runs: a fragment closes at the first parameter where the
    running total reaches its share (k/count of all elements), or where each later fragment
    has exactly one parameter left; none is empty."""
    if count > len(sizes):
        raise UserError(f"sync.fragments={count}: the model has {len(sizes)} trainable tensors and a fragment holds"
                        f" whole tensors; use sync.fragments <= {len(sizes)} that divides sync.every")
    total, running, start = sum(sizes), 0, 0
    cut: list[list[int]] = []
    for i, n in enumerate(sizes):
        running += n
        k = len(cut)
        if k < count - 1 and (running * count >= total * (k + 1) or len(sizes) - i - 1 == count - k - 1):
            cut.append(list(range(start, i + 1)))
            start = i + 1
    cut.append(list(range(start, len(sizes))))
    return cut


class Synchronizer:
    """Every rank holds one; `after_step` is collective over the dp_replicate group."""

    def __init__(self, *, sync: SyncConfig, model: nn.Module, group: dist.ProcessGroup, replicas: int,
                 total_steps: int | None = None) -> None:
        self.mode = sync.mode
        self.every = sync.every
        self.total_steps = total_steps  # the last step synchronizes too: the run ends with one model
        self.sent = DTYPES[sync.dtype]  # diloco's deltas on the wire (the plan keeps local_sgd at float32)
        self.group = group
        self.replicas = replicas
        named = trainable(model)
        self.params = [p for _, p in named]
        self.fragments = fragments_of([p.numel() for p in self.params], sync.fragments)
        self.stride = sync.every // sync.fragments  # steps between two fragments' synchronizations
        self._same_start()
        self.anchor = Anchor(named, self)
        self.synced = [self.anchor.synced[name.replace(".", "/")] for name, _ in named]  # the params' order
        # local_sgd has no outer step: an SGD that is never stepped keeps the (empty) outer
        # state of a checkpoint's (module, optimizer) pair.
        if self.mode == SyncMode.diloco:
            self.outer = torch.optim.SGD(self.synced, lr=sync.outer_lr, momentum=sync.outer_momentum,
                                         nesterov=sync.outer_nesterov)
        else:
            self.outer = torch.optim.SGD(self.synced, lr=1.0)
        self.syncs = 0  # synchronizations (of a fragment, or of the whole model) made by this process
        self.replica = 0  # this rank's dp_replicate coordinate (checkpoint_parts)
        self.replica_models: list[ReplicaModel] = []  # this rank's checkpoint parts (checkpoint_parts)
        self.written_by: int | None = None  # the replicas that wrote the checkpoint resumed (resume_from)

    @torch.no_grad()
    def _same_start(self) -> None:
        """Replica 0's initial parameters on every replica, as DDP broadcasts them when it wraps."""
        src = dist.get_global_rank(self.group, 0)
        flat = torch.cat([_local(p).reshape(-1) for p in self.params])
        dist.broadcast(flat, src=src, group=self.group)
        self._unflatten(flat, [_local(p) for p in self.params])

    @staticmethod
    def _unflatten(flat: torch.Tensor, into: list[torch.Tensor]) -> None:
        offset = 0
        for t in into:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view_as(t))
            offset += n

    def _mean(self, tensors: list[torch.Tensor], sent: torch.dtype = torch.float32) -> torch.Tensor:
        """The mean over the replicas of these local tensors, flat, in float32: one all-reduce in `sent`."""
        flat = torch.cat([t.reshape(-1).to(sent) for t in tensors])
        dist.all_reduce(flat, group=self.group)
        return flat.float().div_(self.replicas)

    def due(self, step: int) -> list[int]:
        """The fragments that synchronize after `step` optimizer steps (module doc)."""
        if step == self.total_steps:
            return list(range(len(self.fragments)))
        phase = step % self.every
        return [phase // self.stride] if phase % self.stride == 0 else []

    def last_sync(self, fragment: int, step: int) -> int:
        """The last step <= `step` after which `fragment` synchronized (0: the start)."""
        offset = fragment * self.stride
        return 0 if step < offset else step - (step - offset) % self.every

    @torch.no_grad()
    def after_step(self, step: int, _result: Any = None) -> None:
        """After `step` optimizer steps: synchronize the fragments due (module doc)."""
        for fragment in self.due(step):
            self._synchronize(self.fragments[fragment])

    def _synchronize(self, positions: list[int]) -> None:
        own = [_local(self.params[i]) for i in positions]
        anchor = [_local(self.synced[i]) for i in positions]
        if self.mode == SyncMode.local_sgd:
            self._unflatten(self._mean(own), own)
            for a, p in zip(anchor, own, strict=True):
                a.copy_(p)
        else:
            delta = self._mean([a - p for a, p in zip(anchor, own, strict=True)], self.sent)
            for i in positions:  # the other fragments' anchors get no gradient: SGD leaves them and their momentum
                self.synced[i].grad = torch.zeros_like(self.synced[i])
            self._unflatten(delta, [_local(self.synced[i].grad) for i in positions])
            self.outer.step()
            self.outer.zero_grad(set_to_none=True)
            for a, p in zip(anchor, own, strict=True):
                p.copy_(a)
        self.syncs += 1

    def checkpoint_parts(self, parts: list[tuple[nn.Module, Any]], *, replica: int) -> list[tuple[nn.Module, Any]]:
        """The (module, optimizer) pairs a checkpoint holds: each model part under its
        replica's name with its inner optimizer, then the anchor with the outer optimizer."""
        self.replica = replica
        self.replica_models = [ReplicaModel(module, replica) for module, _ in parts]
        return [(m, optimizer) for m, (_, optimizer) in zip(self.replica_models, parts, strict=True)] + [
            (self.anchor, self.outer)]

    def resume_from(self, written_by: int) -> None:
        """The checkpoint about to be loaded was written by `written_by` replicas (the
        checkpoint manager says so before each load it tries): on another number, this
        replica loads the state of replica `replica mod written_by`."""
        self.written_by = written_by
        for m in self.replica_models:
            m.named_as(self.replica % written_by if written_by != self.replicas else self.replica)

    @torch.no_grad()
    def resumed(self, step: int, *, run: RunDir | None) -> None:
        """After the checkpoint of `step` loaded (0: none): on another replica count every
        replica continues from the anchor, said on rank 0 (`run`) in one line and an event."""
        if not step or self.written_by in (None, self.replicas):
            return
        for m in self.replica_models:
            m.named_as(self.replica)  # its own keys again for the next save
        for p, a in zip(self.params, self.synced, strict=True):
            _local(p).copy_(_local(a))
        synced_at = min(self.last_sync(f, step) for f in range(len(self.fragments)))
        if run is None:
            return
        dropped = step - synced_at
        print(f"note: +sync checkpoint of step {step} was written by {self.written_by} replicas and this job has"
              f" {self.replicas}: every replica continues from the last synchronized parameters"
              f" ({f'the inner steps since step {synced_at} dropped' if dropped else 'nothing dropped'}),"
              f" replica r with the inner optimizer state of replica r mod {self.written_by}", file=sys.stderr,
              flush=True)
        run.event("sync_replicas_changed", step=step, from_replicas=self.written_by, replicas=self.replicas,
                  synced_at=synced_at, inner_steps_dropped=dropped)


def synchronizer(sync: SyncConfig | None, *, model: nn.Module, mesh: ParallelMesh,
                 total_steps: int) -> Synchronizer | None:
    """This rank's Synchronizer for a `+sync` run (collective: every rank builds one), else None."""
    if sync is None:
        return None
    group = mesh.group(Axis.dp_replicate)
    assert group is not None, "the plan refuses +sync with one replica"
    return Synchronizer(sync=sync, model=model, group=group, replicas=mesh.size(Axis.dp_replicate),
                        total_steps=total_steps)


def checkpointed(sync: Synchronizer | None, parts: list[tuple[nn.Module, Any]], *,
                 mesh: ParallelMesh) -> tuple[list[tuple[nn.Module, Any]], dict[str, Any]]:
    """The checkpoint's (module, optimizer) pairs and what its manifest adds to the identity:
    for a `+sync` run each replica's own keys, the anchor, and the number of replicas."""
    if sync is None:
        return parts, {}
    return sync.checkpoint_parts(parts, replica=mesh.rank(Axis.dp_replicate)), {"sync_replicas": sync.replicas}
