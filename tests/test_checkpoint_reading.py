"""A resume reads each checkpoint file once: its CRC-32 is computed from the bytes the load
reads (dtk.checkpoint.reading), and only files no rank read whole are read again for it.
Corruption is still a rejection, wherever the flipped byte lands."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_checkpoint import events, params, resume_fresh, save_three

from dtk.checkpoint import manifest as mf
from dtk.checkpoint.hashing import HashingWriter
from dtk.checkpoint.reading import HashingReader
from dtk.checkpoint.safe import SafeLoadPlanner

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def held_equal(model, held: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(params(model), held, strict=True))


def test_a_resume_checksums_the_shards_from_the_bytes_it_loads(tmp_path, monkeypatch):
    run, held = save_three(tmp_path / "run", asynchronous=False)
    separately: list[str] = []
    checksum = mf.file_checksum

    def spy(path: Path) -> str:
        separately.append(path.name)
        return checksum(path)

    monkeypatch.setattr(mf, "file_checksum", spy)
    step, model = resume_fresh(run)
    assert step == 3 and held_equal(model, held[3])
    # The shard was read once, by DCP's load, and .metadata once, checked before it was
    # parsed; only the small files DCP does not read are read for their CRC alone.
    assert "__0_0.distcp" not in separately
    assert set(separately) == {"rng_00000.pt", "trainer.json"}


def flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["record header", "tensor bytes", "last byte"])
def test_a_flipped_byte_anywhere_in_a_shard_is_a_rejection_not_a_load_failure(tmp_path, where):
    """A byte of the first record's zip signature makes torch.load fail; one in a tensor loads quietly:
    both are a corrupt file, rejected, and the previous checkpoint loads."""
    run, held = save_three(tmp_path / "run", asynchronous=False)
    shard = run.checkpoint_dir(3) / "__0_0.distcp"
    size = shard.stat().st_size
    flip(shard, {"record header": 0, "tensor bytes": size // 2, "last byte": size - 1}[where])
    step, model = resume_fresh(run)
    assert step == 2 and held_equal(model, held[2])
    (rejected,) = events(run, "checkpoint_rejected")
    assert rejected["step"] == 3 and "__0_0.distcp crc32" in rejected["reason"]


def test_a_file_read_in_part_is_left_to_the_check_after_the_load(tmp_path):
    state = {"big": torch.arange(1 << 16, dtype=torch.float32), "small": torch.arange(4, dtype=torch.float32)}
    writer = HashingWriter(str(tmp_path), sync_files=False, thread_count=1)
    dcp.save(state, storage_writer=writer, no_dist=True)
    files = writer.hashed()
    want, meta = files["__0_0.distcp"]["crc32"], files[".metadata"]["crc32"]

    part = {"small": torch.zeros(4)}
    reader = HashingReader(tmp_path, manifest={"files": files})
    dcp.load(part, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    assert torch.equal(part["small"], state["small"])
    assert reader.crcs == {".metadata": meta}  # under half of the shard read: no CRC claimed for it

    whole = {"big": torch.zeros(1 << 16), "small": torch.zeros(4)}
    reader = HashingReader(tmp_path, manifest={"files": files})
    dcp.load(whole, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    assert torch.equal(whole["big"], state["big"]) and torch.equal(whole["small"], state["small"])
    assert reader.crcs == {"__0_0.distcp": want, ".metadata": meta}
    manifest = {"files": {"__0_0.distcp": {"crc32": want}}}
    assert reader.mismatches(manifest) == []
    manifest["files"]["__0_0.distcp"]["crc32"] = "00000000"
    assert reader.mismatches(manifest) == [f"__0_0.distcp crc32 {want}, manifest says 00000000"]
    assert json.dumps(reader.crcs)  # plain strings: gathered between ranks as objects
