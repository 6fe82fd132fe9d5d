"""A resume reads each checkpoint file once: its CRC-32 is computed from the bytes the load
reads (dtk.checkpoint.reading), and only files no rank read whole are read again for it.
Corruption is still a rejection, wherever the flipped byte lands."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_checkpoint import events, make_parts, manager, params, resume_fresh, save_three, train_step

from dtk.checkpoint import manifest as mf
from dtk.checkpoint.hashing import HashingWriter
from dtk.checkpoint.reading import HashingReader
from dtk.checkpoint.safe import SafeLoadPlanner
from dtk.common.rundir import RunDir

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


def test_a_resume_allocates_the_optimizer_state_from_the_metadata_instead_of_a_zero_gradient_step(tmp_path,
                                                                                                  monkeypatch):
    """A fresh AdamW has no state to load into; the load gives it tensors shaped as the
    checkpoint lists them (dtk.checkpoint.load.allocate_optimizer_state) rather than letting
    torch run an optimizer step on zero gradients, and the state it ends with is the saved
    one, value for value."""
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    model, optimizer, scheduler = make_parts()
    ckpt = manager(run, model, optimizer, scheduler, asynchronous=False)
    for _ in (1, 2):
        train_step(model, optimizer, scheduler)
    ckpt.save(2)
    ckpt.close()
    steps: list[int] = []
    fresh, fresh_opt, fresh_sched = make_parts(seed=99)
    fresh_opt.register_step_pre_hook(lambda *_: steps.append(1))
    resumer = manager(run, fresh, fresh_opt, fresh_sched, asynchronous=False)
    assert resumer.resume() == 2
    resumer.close()
    assert steps == []  # no optimizer step ran to create the state
    saved, loaded = optimizer.state_dict(), fresh_opt.state_dict()
    assert saved["state"].keys() == loaded["state"].keys()
    for index, entries in saved["state"].items():
        assert entries.keys() == loaded["state"][index].keys()
        for key, value in entries.items():
            assert torch.equal(value, loaded["state"][index][key]), (index, key)
            assert value.device == loaded["state"][index][key].device


def test_the_optimizer_state_is_left_to_torch_where_the_checkpoint_lacks_a_parameters_state(tmp_path):
    """A trainable parameter without state in the checkpoint: nothing is allocated."""
    from torch.distributed.checkpoint.metadata import Metadata

    from dtk.checkpoint.load import allocate_optimizer_state

    model, optimizer, _ = make_parts()
    assert not allocate_optimizer_state(model, optimizer, Metadata(state_dict_metadata={}))
    assert not optimizer.state
