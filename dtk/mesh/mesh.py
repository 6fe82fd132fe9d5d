"""The one named DeviceMesh every scheme runs on.

Ranks are laid out on a 5-D grid, outermost axis first:

    world = arange(dp_replicate x pp x dp_shard x cp x tp).view(dp_replicate, pp, dp_shard, cp, tp)

    axis           neighbours are ...          traffic per step
    dp_replicate   across nodes (outermost)    one gradient all-reduce (HSDP / DDP)
    pp             across nodes or inside one  activations, point to point, per micro-batch
    dp_shard       inside a node if it fits    FSDP all-gather + reduce-scatter per block
    cp             inside a node if it fits    keys and values all-gathered in every block
    tp             inside a node (innermost)   all-reduce / all-gather inside every block

Example, 2 nodes x 4 workers, dp_replicate=2 x pp=1 x dp_shard=2 x tp=2:

                 dp_shard=0   dp_shard=1
    node 0:      [ 0  1 ]     [ 2  3 ]      <- dp_replicate=0; pairs are tp groups
    node 1:      [ 4  5 ]     [ 6  7 ]      <- dp_replicate=1

The innermost axis changes fastest with the rank, and consecutive ranks share a node, so
the chattiest axis (tp) stays on one node's fast links and the least chatty (the replica
all-reduce, once per step) crosses the slowest links. `dp` is the flattened
(dp_replicate, dp_shard) pair: ranks that see different samples. `dp_shard_cp` is the
flattened (dp_shard, cp) pair FSDP shards over: context-parallel ranks see different tokens
of the same samples, so their gradients are partial sums, reduced with the shards'.

Expert parallelism (scheme.ep, dtk.parallel.ep) is carved out of dp_shard x cp rather than
added to the grid: `expert_mesh` views the same ranks as (dp_replicate, pp,
dp_shard_mod_ep, ep, tp), an ep group being ep consecutive ranks of the flattened
(dp_shard, cp) pair, inside a node where they fit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dtk.mesh.groups import give_world_timeout
from dtk.plan.degrees import CARVED_FROM, DATA_AXES, DP, Axis, CarvedAxis, Degrees

SHARD_CP = "dp_shard_cp"
"""The flattened (dp_shard, cp) mesh: FSDP's shard dimension."""
EP_SHARD = "dp_shard_mod_ep"
"""The expert mesh's other dimension: the ranks of dp_shard x cp holding the same experts, which
FSDP shards the experts' parameters over."""


@dataclass(frozen=True)
class ParallelMesh:
    """The named mesh, handed whole to every stage that talks over it (the trainer, the
    evaluator, the checkpoint manager, the data split): the degrees, the world mesh and the
    flattened `dp` mesh, and the ranks, sizes and groups they ask for. A stage asks for an
    axis by name; none is passed a loose group.

    `single()` is one process without a process group (a unit test, a benchmark): every
    degree 1, ranks 0, groups None."""

    degrees: Degrees
    world: DeviceMesh | None
    dp: DeviceMesh | None
    experts: DeviceMesh | None = None
    """With ep > 1: (dp_replicate, pp, dp_shard_mod_ep, ep, tp), the same ranks as `world` with
    dp_shard x cp flattened and cut into ep-sized blocks of consecutive ranks (`expert_mesh`)."""

    @staticmethod
    def single() -> ParallelMesh:
        return ParallelMesh(degrees=Degrees(**{a.value: 1 for a in Axis}), world=None, dp=None)

    def __getitem__(self, axis: Axis | str | tuple[str, ...]) -> DeviceMesh:
        assert self.world is not None and self.dp is not None, "a one-process mesh has no DeviceMesh"
        if isinstance(axis, tuple):
            return self.world[axis]
        name = str(axis)
        return self.dp if name == DP else self.world[Axis(name).value]

    def rank(self, axis: Axis | str) -> int:
        """This rank's coordinate on `axis` (or on the flattened `dp`)."""
        return 0 if self.world is None else self[axis].get_local_rank()

    def size(self, axis: Axis | CarvedAxis | str) -> int:
        name = str(axis)
        if name in CarvedAxis.values():
            return self.degrees.of(CarvedAxis(name))
        return self.degrees.dp if name == DP else self.degrees.of(Axis(name))

    def group(self, axis: Axis | CarvedAxis | str) -> dist.ProcessGroup | None:
        """The process group of `axis` (a carved one's from the expert mesh); None when it
        has one rank (nothing to talk to)."""
        if self.world is None or self.size(axis) == 1:
            return None
        if str(axis) in CarvedAxis.values():
            assert self.experts is not None, "build_mesh makes the expert mesh when ep > 1"
            return self.experts[str(axis)].get_group()
        return self[axis].get_group()

    # The questions the stages ask, named once.
    @property
    def global_rank(self) -> int:
        return dist.get_rank() if self.world is not None else 0

    @property
    def world_size(self) -> int:
        return self.degrees.world

    @property
    def dp_rank(self) -> int:
        """Which share of each global batch this rank reads (tensor and pipeline peers read the same)."""
        return self.rank(DP)

    @property
    def dp_size(self) -> int:
        return self.degrees.dp

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """Ranks that see different samples: the loss mean, the gradient reduction, ZeRO-1."""
        return self.group(DP)

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        """Pipeline stages: the loss (on the last stage) and gradient norms are summed over it."""
        return self.group(Axis.pp)

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        """Context-parallel ranks: parts of the same sequences (keys and values, the loss)."""
        return self.group(Axis.cp)

    @property
    def fsdp_shard(self) -> DeviceMesh:
        """What FSDP shards over: dp_shard, times cp when the sequence is split (dp_shard_cp)."""
        assert self.world is not None
        return self.world[SHARD_CP] if self.degrees.cp > 1 else self.world[Axis.dp_shard.value]

    @property
    def data_parallel_2d(self) -> DeviceMesh:
        """(dp_replicate, dp_shard) - dp_shard x cp under context parallelism: FSDP2 replicates
        over the first and shards over the second."""
        assert self.world is not None
        shard = SHARD_CP if self.degrees.cp > 1 else Axis.dp_shard.value
        return self.world[(Axis.dp_replicate.value, shard)]


def build_mesh(degrees: Degrees, device_type: str) -> ParallelMesh:
    """Every axis exists, degree 1 included, so code can always ask for `mesh["tp"]`. The
    grid's order is Axis's order (dtk/plan/degrees.py), outermost first."""
    shape = tuple(degrees.of(axis) for axis in Axis)
    names = tuple(axis.value for axis in Axis)
    world = init_device_mesh(device_type, shape, mesh_dim_names=names)
    dp = world[tuple(a.value for a in DATA_AXES)]._flatten(DP)
    groups = [world.get_group(name) for name in names] + [dp.get_group()]
    if degrees.cp > 1:
        groups.append(world[(Axis.dp_shard.value, Axis.cp.value)]._flatten(SHARD_CP).get_group())
    experts = expert_mesh(degrees, device_type) if degrees.ep > 1 else None
    if experts is not None:
        groups += [experts.get_group(name) for name in experts.mesh_dim_names or ()]
    # The axes' groups come from new_group/split_group: without this, torch's default timeouts.
    give_world_timeout(groups)
    return ParallelMesh(degrees=degrees, world=world, dp=dp, experts=experts)


def expert_mesh(degrees: Degrees, device_type: str) -> DeviceMesh:
    """The grid with the axes ep is carved out of (dp_shard, cp) flattened and split into
    (dp_shard_mod_ep, ep): an ep group is ep consecutive ranks of dp_shard x cp, inside a node
    where they fit. A root mesh of its own, so FSDP (over dp_shard_mod_ep) and the experts'
    DTensors (over ep) share it."""
    carved = CARVED_FROM[CarvedAxis.ep]
    outer = [a for a in Axis if Axis.values().index(a.value) < Axis.values().index(carved[0].value)]
    inner = [a for a in Axis if Axis.values().index(a.value) > Axis.values().index(carved[-1].value)]
    ep = degrees.ep
    shape = (*(degrees.of(a) for a in outer), degrees.parent(CarvedAxis.ep) // ep, ep, *(degrees.of(a) for a in inner))
    names = (*(a.value for a in outer), EP_SHARD, CarvedAxis.ep.value, *(a.value for a in inner))
    return DeviceMesh(device_type, torch.arange(degrees.world).view(shape), mesh_dim_names=names)
