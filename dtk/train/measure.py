"""Measured memory of a rank, to hold against the plan's prediction.

- states: the bytes of the parameter, gradient and optimizer-state tensors this rank holds
  (local shards of DTensors), counted from the tensors themselves;
- activations: `LiveActivations`, a dispatch mode that records the storage of every tensor
  an op creates outside backward, by weak reference, and reports the peak of those still
  alive. What stays alive past forward is what autograd saved for backward, whoever saved
  it: saved-tensor hooks see what autograd's own nodes pack, but not the outputs that
  selective activation checkpointing caches in its own storage, and this sees both (a test
  checks that it equals the saved-tensor-hook count where hooks see everything). Storages
  that existed before (parameters, the batch, buffers allocated once) are not counted.

On a GPU the real peak comes from the caching allocator instead
(`torch.cuda.max_memory_allocated`), which counts everything at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's own elements (a DTensor's local shard)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def state_bytes(parts: Iterable[torch.nn.Module], optimizers: Iterable) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state held by this rank."""
    params = grads = 0
    for part in parts:
        for p in part.parameters():
            params += tensor_bytes(p)
            if p.grad is not None:
                grads += tensor_bytes(p.grad)
    optimizer = 0
    for opt in optimizers:
        inner = getattr(opt, "local", opt)  # ZeRO-1 keeps its state in a local optimizer
        for state in inner.state.values():
            optimizer += sum(tensor_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return {"params": params, "grads": grads, "optimizer": optimizer}


class LiveActivations(TorchDispatchMode):
    """Peak bytes of tensors created by forward ops and still alive (see the module doc).

    Use as a context manager around forward and backward; `peak` is the largest total seen
    after any op, `live()` the total now."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._refs: dict[int, StorageWeakRef] = {}
        self._exclude = {t.untyped_storage()._cdata for t in exclude}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch._C._current_autograd_node() is None:  # forward (backward's ops make gradients)
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    # a DTensor's op runs its local ops outside this mode: count its local shard
                    self._track(getattr(t, "_local_tensor", t))
        self.peak = max(self.peak, self.live())
        return out

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._exclude:
            return
        old = self._refs.get(key)
        if old is not None and not old.expired():
            return  # a view of a storage already counted
        self._refs[key] = StorageWeakRef(storage)

    def live(self) -> int:
        """Bytes of the recorded storages still alive (at their current size: FSDP frees a
        gathered parameter by resizing its storage to 0)."""
        total = 0
        for key, ref in list(self._refs.items()):
            if ref.expired():
                del self._refs[key]
                continue
            storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
            total += storage.nbytes() if storage is not None else 0
        return total


class StepMemory:
    """This rank's real memory, measured once per start at almost no cost.

    On a GPU: `torch.cuda.max_memory_allocated` at the end (`result`). On the CPU: one step
    (`index`: the second of the start when it has two, so that what a pipeline allocates
    once exists already) runs under LiveActivations; at the end of its backward the
    gradients are counted, and at the end of the run the parameters and the optimizer
    state. Only that one step pays for the dispatch mode. A compiled model is not traced
    by a dispatch mode: there the activations are not measured (`activations: None`).

    `around(step)` is what the trainer wraps each step's forward and backward in."""

    def __init__(self, *, device: torch.device, parts: list[torch.nn.Module], optimizers: list, index: int,
                 trace: bool = True) -> None:
        self.device, self.parts, self.optimizers, self.index = device, parts, optimizers, index
        self.trace = trace and device.type == "cpu"
        self.activations: int | None = None
        self.grads: int | None = None

    @contextlib.contextmanager
    def around(self, step: int) -> Iterator[None]:
        if step != self.index:
            yield
            return
        if not self.trace:
            yield
        else:
            tracker = LiveActivations(exclude=[p for part in self.parts for p in part.parameters()])
            with tracker:
                yield
            self.activations = tracker.peak
        self.grads = state_bytes(self.parts, [])["grads"]

    def result(self) -> dict[str, int | None]:
        """Bytes by kind and `total`, the figure held against the plan (None: not measured)."""
        states = state_bytes(self.parts, self.optimizers)
        if self.device.type == "cuda":
            return {**states, "grads": self.grads, "total": torch.cuda.max_memory_allocated(self.device)}
        measured: dict[str, int | None] = {**states, "grads": self.grads, "activations": self.activations}
        grads, activations = self.grads, self.activations
        known = grads is not None and activations is not None
        measured["total"] = states["params"] + states["optimizer"] + (grads or 0) + (activations or 0) if known else None
        return measured
