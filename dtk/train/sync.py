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

A checkpoint between two synchronizations must hold what differs between replicas: each
replica's parameters and inner optimizer state are saved under keys of its own
(`replica0.`, `replica1.`, ...: `ReplicaModel`), beside the anchor and the outer optimizer's
state, which every replica holds alike (`synced.`: `Anchor`). A resume on the same number
of replicas is therefore bitwise; on another number it is refused with one line (the
manifest's `sync_replicas`, dtk.checkpoint.manager), since one replica's state has no place
among another number of replicas.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from dtk.config.choices import SyncDtype, SyncMode
from dtk.config.schema import SyncConfig
from dtk.dist.mesh import ParallelMesh
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


class Anchor(nn.Module):
    """The parameters as of the last synchronization (`synced.<name>`, dots as `/`), equal on
    every replica: diloco's outer optimizer updates them, and a checkpoint holds them with
    that optimizer's state."""

    def __init__(self, params: list[tuple[str, nn.Parameter]]) -> None:
        super().__init__()
        self.synced = nn.ParameterDict({name.replace(".", "/"): nn.Parameter(p.detach().clone()) for name, p in params})


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
        self._same_start()
        self.anchor = Anchor(named)
        self.synced = [self.anchor.synced[name.replace(".", "/")] for name, _ in named]  # the params' order
        # local_sgd has no outer step: an SGD that is never stepped keeps the (empty) outer
        # state of a checkpoint's (module, optimizer) pair.
        if self.mode == SyncMode.diloco:
            self.outer = torch.optim.SGD(self.synced, lr=sync.outer_lr, momentum=sync.outer_momentum,
                                         nesterov=sync.outer_nesterov)
        else:
            self.outer = torch.optim.SGD(self.synced, lr=1.0)
        self.syncs = 0  # synchronizations made by this process (tests count them)

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

    @torch.no_grad()
    def after_step(self, step: int, _result: Any = None) -> None:
        """After `step` optimizer steps: synchronize when it is a multiple of sync.every, or the last."""
        if step % self.every and step != self.total_steps:
            return
        own = [_local(p) for p in self.params]
        anchor = [_local(a) for a in self.synced]
        if self.mode == SyncMode.local_sgd:
            self._unflatten(self._mean(own), own)
            for a, p in zip(anchor, own, strict=True):
                a.copy_(p)
        else:
            delta = self._mean([a - p for a, p in zip(anchor, own, strict=True)], self.sent)
            for a in self.synced:
                a.grad = torch.zeros_like(a)
            self._unflatten(delta, [_local(a.grad) for a in self.synced])
            self.outer.step()
            self.outer.zero_grad(set_to_none=True)
            for a, p in zip(anchor, own, strict=True):
                p.copy_(a)
        self.syncs += 1

    def checkpoint_parts(self, parts: list[tuple[nn.Module, Any]], *, replica: int) -> list[tuple[nn.Module, Any]]:
        """The (module, optimizer) pairs a checkpoint holds: each model part under its
        replica's name with its inner optimizer, then the anchor with the outer optimizer."""
        return [(ReplicaModel(module, replica), optimizer) for module, optimizer in parts] + [(self.anchor, self.outer)]



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
