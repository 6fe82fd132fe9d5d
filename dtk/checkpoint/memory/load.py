"""The memory tier's shards as DCP sees a checkpoint: a snapshot's pieces loaded, resharded to
the ranks and layout of now, by DCP's own load planner (the one a disk resume uses).

A shard holds, for each key of the flattened model and optimizer state (DCP's keys: the
parameters' original names, `optim.state.<name>.exp_avg`, ...), this rank's local piece of
the tensor; its layout says where the piece sits in the whole tensor (dtype, global size,
offsets, lengths), as DCP's `.metadata` would. `metadata_of` joins the layouts of every old
rank into one DCP `Metadata`; a rank then plans its read against it (`needed`), gets the
shards it needs (dtk.checkpoint.memory.tier) and `MemoryReader` serves DCP the pieces from
them, with no file read.
"""

from __future__ import annotations

import io
import json
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.tensor import DTensor
from torch.futures import Future

from dtk.checkpoint.safe import SafeLoadPlanner

Layout = dict[str, Any]


def pieces(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any], Layout]:
    """This rank's flattened state split into CPU copies of its tensor pieces, the other values
    (plain: the optimizer's param groups), and their layout. On the training thread: the copy
    is what makes the snapshot the state of its step."""
    flat, _ = flatten_state_dict(state)
    tensors: dict[str, torch.Tensor] = {}
    objects: dict[str, Any] = {}
    layout: dict[str, Any] = {}
    for key, value in flat.items():
        if isinstance(value, DTensor):
            (chunk,) = value.__create_chunk_list__()
            local = value.to_local()
            offsets, lengths = list(chunk.offsets), list(chunk.sizes)
        elif isinstance(value, torch.Tensor):
            local, offsets, lengths = value, [0] * value.dim(), list(value.shape)
        else:
            objects[key] = value
            continue
        tensors[key] = local.detach().to("cpu", copy=True)
        layout[key] = {"dtype": str(value.dtype).removeprefix("torch."), "size": list(value.shape),
                       "offsets": offsets, "lengths": lengths}
    return tensors, objects, {"tensors": layout, "objects": sorted(objects)}


def layout_bytes(layout: Layout) -> bytes:
    return json.dumps(layout, sort_keys=True).encode()


def parse_layout(data: bytes) -> Layout:
    layout = json.loads(data)
    for entry in layout["tensors"].values():
        if not isinstance(getattr(torch, entry["dtype"], None), torch.dtype):
            raise ValueError(f"not a dtype: {entry['dtype']!r}")
    return layout


def metadata_of(layouts: dict[int, Layout]) -> tuple[Metadata, dict[MetadataIndex, list[int]]]:
    """One DCP Metadata of every old rank's pieces, and for each piece the old ranks holding
    it (several where it is replicated: DDP's parameters, a TP-replicated norm)."""
    entries: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    holders: dict[MetadataIndex, list[int]] = {}
    for old in sorted(layouts):
        for key, t in layouts[old]["tensors"].items():
            entry = entries.get(key)
            if entry is None:
                entry = entries[key] = TensorStorageMetadata(
                    properties=TensorProperties(dtype=getattr(torch, t["dtype"])), size=torch.Size(t["size"]),
                    chunks=[])
            assert isinstance(entry, TensorStorageMetadata)
            index = MetadataIndex(key, torch.Size(t["offsets"]))
            if index not in holders:
                entry.chunks.append(ChunkStorageMetadata(offsets=torch.Size(t["offsets"]),
                                                         sizes=torch.Size(t["lengths"])))
            holders.setdefault(index, []).append(old)
        for key in layouts[old]["objects"]:
            entries.setdefault(key, BytesStorageMetadata())
            holders.setdefault(MetadataIndex(key), []).append(old)
    return Metadata(state_dict_metadata=entries), holders


def needed(state: dict[str, Any], metadata: Metadata, storage: dict[MetadataIndex, int]) -> set[int]:
    """The old ranks whose shards this rank's load reads (DCP's own plan of the load)."""
    planner = SafeLoadPlanner()
    planner.set_up_planner(state, metadata, True)
    return {storage[item.storage_index] for item in planner.create_local_plan().items}


class MemoryReader(StorageReader):
    """DCP's reader over shards already in memory: `storage` says which old rank's shard each
    piece is read from, `shards` holds those shards (torch.load'ed with weights_only)."""

    def __init__(self, metadata: Metadata, storage: dict[MetadataIndex, int], shards: dict[int, dict[str, Any]]):
        super().__init__()
        self.metadata, self.storage, self.shards = metadata, storage, shards

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for item in plan.items:
            shard = self.shards[self.storage[item.storage_index]]
            key = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                buf = io.BytesIO()
                torch.save(shard["objects"][key], buf)
                buf.seek(0)
                planner.load_bytes(item, buf)  # SafeLoadPlanner: plain values of dtk's keys only
                continue
            piece = narrow_tensor_by_index(shard["tensors"][key], item.storage_offsets, item.lengths)
            target = planner.resolve_tensor(item).detach()
            if target.size() != piece.size():
                raise ValueError(f"{key}: the snapshot's piece is {tuple(piece.size())}, the load wants"
                                 f" {tuple(target.size())}")
            target.copy_(piece)
            planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False
