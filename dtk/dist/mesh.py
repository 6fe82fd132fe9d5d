"""The one named DeviceMesh every scheme runs on.

Ranks are laid out on a 4-D grid, outermost axis first:

    world = arange(dp_replicate x pp x dp_shard x tp).view(dp_replicate, pp, dp_shard, tp)

    axis           neighbours are ...          traffic per step
    dp_replicate   across nodes (outermost)    one gradient all-reduce (HSDP / DDP)
    pp             across nodes or inside one  activations, point to point, per micro-batch
    dp_shard       inside a node if it fits    FSDP all-gather + reduce-scatter per block
    tp             inside a node (innermost)   all-reduce / all-gather inside every block

Example, 2 nodes x 4 workers, dp_replicate=2 x pp=1 x dp_shard=2 x tp=2:

                 dp_shard=0   dp_shard=1
    node 0:      [ 0  1 ]     [ 2  3 ]      <- dp_replicate=0; pairs are tp groups
    node 1:      [ 4  5 ]     [ 6  7 ]      <- dp_replicate=1

The innermost axis changes fastest with the rank, and consecutive ranks share a node, so
the chattiest axis (tp) stays on one node's fast links and the least chatty (the replica
all-reduce, once per step) crosses the slowest links. `dp` is the flattened
(dp_replicate, dp_shard) pair: ranks that see different samples.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dtk.plan.degrees import DATA_AXES, DP, Axis, Degrees


@dataclass(frozen=True)
class ParallelMesh:
    """The world mesh plus the flattened `dp` mesh (kept here: torch wants it bookkept)."""

    world: DeviceMesh
    dp: DeviceMesh

    def __getitem__(self, axis: Axis | str | tuple[str, ...]) -> DeviceMesh:
        if isinstance(axis, tuple):
            return self.world[axis]
        name = str(axis)
        return self.dp if name == DP else self.world[Axis(name).value]

    def rank(self, axis: Axis | str) -> int:
        return self[axis].get_local_rank()

    def size(self, axis: Axis | str) -> int:
        return self[axis].size()

    def group(self, axis: Axis | str):
        return self[axis].get_group()

    @property
    def data_parallel_2d(self) -> DeviceMesh:
        """(dp_replicate, dp_shard): FSDP2 replicates over the first and shards over the second."""
        return self.world[tuple(a.value for a in DATA_AXES)]


def build_mesh(degrees: Degrees, device_type: str) -> ParallelMesh:
    """Every axis exists, degree 1 included, so code can always ask for `mesh["tp"]`. The
    grid's order is Axis's order (dtk/plan/degrees.py), outermost first."""
    shape = tuple(degrees.of(axis) for axis in Axis)
    names = tuple(axis.value for axis in Axis)
    world = init_device_mesh(device_type, shape, mesh_dim_names=names)
    dp = world[tuple(a.value for a in DATA_AXES)]._flatten(DP)
    return ParallelMesh(world=world, dp=dp)
