"""Compressing DDP's every-step gradient all-reduce (`scheme.grad_compression`) with torch's
own DDP communication hooks (torch.distributed.algorithms.ddp_comm_hooks):

    none      no hook: DDP's float32 all-reduce
    bf16      bf16_compress_hook: each bucket cast to bfloat16, all-reduced, cast back and
              divided by the world size: half the bytes, no state
    powersgd  powerSGD_hook: each gradient matrix approximated by a rank-`powersgd_rank`
              product P Q^T, of which only P and Q are all-reduced; what the approximation
              missed is added to the next step's gradient (error feedback). The steps
              until the learning rate's warm-up ends (optim.warmup_steps, at least
              POWERSGD_WARMUP) all-reduce uncompressed (torch's start_powerSGD_iter: "no
              less than the number of warm-up steps").

PowerSGD's state (the iteration count, each bucket's error and warm-started Q, and the
random stream that draws Q) differs from rank to rank; `state_tensors` and
`load_state_tensors` turn it into plain tensors and back, which the checkpoint keeps with
each rank's random streams (dtk.checkpoint.rng.keep_rank_state), restored where the world
size is unchanged. On another world size the state starts afresh, as on the first step.

torch keeps that state per bucket, laid out in the bucket's order of gradients, and DDP lays
its buckets out anew after the first step of a process (in the order gradients became
ready). A bucket's state read back into a new process would meet another layout, so the
state is kept per parameter (`PowerSGD`): each parameter's piece of its bucket's error and
Q, cut by the hook's own rules, and put together again in the layout each bucket has when
the hook first meets it after a restore.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel

from dtk.config.choices import GradCompression

POWERSGD_WARMUP = 10
"""The fewest steps of uncompressed all-reduce before PowerSGD (torch's start_powerSGD_iter;
>= 2 with error feedback); a longer learning-rate warm-up moves the start (`PowerSGD.start_after`)."""


# The hooks below carry no annotations: DDP reads the `bucket` parameter's annotation and
# refuses any but the class itself, which this module's postponed (string) annotations are not.
def _bf16(group, bucket):
    """bf16_compress_hook under a name of its own: DDP refuses the hook by its name unless the
    backend is NCCL, but gloo all-reduces bfloat16 too (the CPU runs and tests use it)."""
    return default_hooks.bf16_compress_hook(group, bucket)


HOOKS = {
    GradCompression.none: None,
    GradCompression.bf16: _bf16,
    GradCompression.powersgd: powersgd.powerSGD_hook,
}
"""torch's hook of each scheme.grad_compression (tests/test_choices.py holds it to the Enum);
PowerSGD's runs through `_powersgd`, which keeps its state per parameter."""


def _segments(grads: list[torch.Size], rank: int, min_rate: float) -> tuple[list[int], list[tuple[int, int, int]]]:
    """The hook's layout of one bucket (powerSGD_hook's own rules): each gradient's length in
    the error (the bucket's order), and (gradient, Q length, P length) for the compressed
    ones in Q's order (grouped by matrix shape, first seen first)."""
    errors = [math.prod(shape) for shape in grads]
    by_shape: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for i, shape in enumerate(grads):
        n = shape[0] if len(shape) else 1
        m = math.prod(shape) // max(n, 1)
        r = min(n, m, rank)
        if powersgd._should_compress(n, m, r, min_rate)[0]:
            by_shape.setdefault((n, m), []).append((i, m * r, n * r))
    return errors, [seg for group in by_shape.values() for seg in group]


class PowerSGD:
    """torch's PowerSGDState with its bucket state kept per parameter (module doc); its
    `hook` is what DDP calls."""

    def __init__(self, model: DistributedDataParallel, *, rank: int, group: dist.ProcessGroup | None) -> None:
        self.state = powersgd.PowerSGDState(process_group=group, matrix_approximation_rank=rank,
                                            start_powerSGD_iter=POWERSGD_WARMUP, random_seed=0)
        self.params = list(model.parameters())
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.layout: dict[int, list[int]] = {}  # bucket index -> parameter positions, as last met
        self.pending: dict[str, torch.Tensor] = {}  # restored pieces not yet laid into a bucket

    def start_after(self, warmup_steps: int) -> None:
        """Compress from the end of the learning rate's warm-up on (at least POWERSGD_WARMUP
        steps): compressing the steps where the gradients change fastest costs the most loss
        (docs/benchmarks.md, "Why PowerSGD loses loss here")."""
        self.state.start_powerSGD_iter = max(POWERSGD_WARMUP, warmup_steps)

    def _bucket(self, params: list[int]) -> tuple[list[int], list[tuple[int, int, int]]]:
        shapes = [self.params[p].shape for p in params]
        errors, qs = _segments(shapes, self.state.matrix_approximation_rank, self.state.min_compression_rate)
        return errors, [(params[i], q, p) for i, q, p in qs]

    def lay(self, index: int, params: list[int], like: torch.Tensor) -> None:
        """A restored state's pieces, put together in this bucket's layout (P is scratch:
        the hook computes it anew each step, only its size counts)."""
        _, qs = self._bucket(params)
        if not all(f"error.{p}" in self.pending for p in params):
            return  # never compressed before the save: the hook starts this bucket afresh
        self.state.error_dict[index] = torch.cat([self.pending.pop(f"error.{p}") for p in params]).to(like)
        self.state.q_memory_dict[index] = torch.cat(
            [self.pending.pop(f"q.{p}") for p, _, _ in qs] or [like.new_empty(0)]).to(like)
        self.state.p_memory_dict[index] = like.new_empty(sum(size for _, _, size in qs))

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's state as plain tensors (copies: the hook changes its own in place)."""
        kind, keys, pos, has_gauss, cached = self.state.rng.get_state(legacy=True)
        assert kind == "MT19937" and isinstance(keys, np.ndarray), kind
        out = {
            "iter": torch.tensor([self.state.iter], dtype=torch.int64),
            "rng_keys": torch.from_numpy(keys.astype(np.int64)),
            "rng_pos": torch.tensor([pos, has_gauss], dtype=torch.int64),
            "rng_cached": torch.tensor([cached], dtype=torch.float64),
            **{k: t.clone() for k, t in self.pending.items()},
        }
        for index in self.state.error_dict:
            out.update(self.pieces(index))
        return out

    def pieces(self, index: int) -> dict[str, torch.Tensor]:
        """Bucket `index`'s error and Q cut per parameter, by the layout it was last met in."""
        params = self.layout[index]
        errors, qs = self._bucket(params)
        out = {}
        for p, piece in zip(params, self.state.error_dict[index].detach().cpu().split(errors), strict=True):
            out[f"error.{p}"] = piece.clone()
        q = self.state.q_memory_dict[index].detach().cpu()
        for (p, _, _), piece in zip(qs, q.split([size for _, size, _ in qs]), strict=True):
            out[f"q.{p}"] = piece.clone()
        return out

    def relayout(self) -> None:
        """DDP laid its buckets out anew: every bucket's state back to pieces, laid again as each bucket comes."""
        for index in list(self.state.error_dict):
            self.pending.update(self.pieces(index))
        for name in ("error_dict", "p_memory_dict", "q_memory_dict"):
            getattr(self.state, name).clear()

    def load_state_tensors(self, tensors: dict[str, Any]) -> None:
        """Restore what `state_tensors` gave (on this rank, the same world size)."""
        self.state.iter = int(tensors["iter"][0])
        pos, has_gauss = tensors["rng_pos"].tolist()
        self.state.rng.set_state(("MT19937", tensors["rng_keys"].numpy().astype(np.uint32), pos, has_gauss,
                                  float(tensors["rng_cached"][0])))
        for name in ("error_dict", "p_memory_dict", "q_memory_dict"):
            getattr(self.state, name).clear()
        self.pending = {k: t for k, t in tensors.items() if k.startswith(("error.", "q."))}


def apply_compression(
    model: DistributedDataParallel, *, compression: GradCompression, powersgd_rank: int,
    group: dist.ProcessGroup | None,
) -> PowerSGD | None:
    """Register the hook of `compression` on a DDP module; returns PowerSGD's state, else None."""
    hook = HOOKS[compression]
    if hook is None:
        return None
    if compression != GradCompression.powersgd:
        model.register_comm_hook(group, hook)
        return None
    state = PowerSGD(model, rank=powersgd_rank, group=group)
    model.register_comm_hook(state, _powersgd)
    return state


def _powersgd(state: PowerSGD, bucket):  # no annotation on bucket: see _bf16
    """powerSGD_hook, after noting the bucket's layout and laying a restored state into it."""
    params = [state.index[id(p)] for p in bucket.parameters()]
    if state.layout.get(bucket.index(), params) != params:  # DDP rebuilt its buckets (after a process's first step)
        state.relayout()
    state.layout[bucket.index()] = params
    if state.pending and bucket.index() not in state.state.error_dict:
        state.lay(bucket.index(), params, bucket.buffer())
    return powersgd.powerSGD_hook(state.state, bucket)
