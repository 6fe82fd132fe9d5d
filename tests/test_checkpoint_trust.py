"""A checkpoint is data, never code: planted pickles in `.metadata` and in DCP bytes items,
with the manifest rewritten to match them, run nothing on resume, `checkpoint list` or
`checkpoint export`; the checkpoint is rejected and the one before it is used. And
`checkpoint delete` tells the newest verified checkpoint by its CRCs, not its sizes."""

from __future__ import annotations

import io
import json
import os
import pickle
import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_checkpoint import corrupt_flip, events, params, resume_fresh, save_three
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from conftest import dtk
from dtk.checkpoint import load as loading
from dtk.checkpoint import manifest as mf
from dtk.checkpoint.__main__ import main as checkpoint_main
from dtk.checkpoint.delete import delete_checkpoint
from dtk.checkpoint.sharded import Comm, _state_dicts
from dtk.checkpoint.trust import METADATA, MetadataUnpickler, check_metadata
from dtk.common.errors import UserError
from dtk.common.rundir import RunDir

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Payload:
    """Unpickled by pickle.load or torch.load(weights_only=False), it runs a shell command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def fix_manifest(folder: Path) -> None:
    """What a writer of the folder can do: make the manifest match whatever the folder holds."""
    manifest = json.loads((folder / mf.MANIFEST).read_text())
    manifest["files"] = {name: mf.describe_file(folder / name) for name in mf.payload_files(folder)}
    (folder / mf.MANIFEST).write_text(json.dumps(manifest))


def plant_metadata(folder: Path, marker: Path) -> None:
    """DCP's real index of the checkpoint with a payload inside it, where a reader would not look."""
    with open(folder / METADATA, "rb") as fh:
        metadata = pickle.load(fh)  # the test's own, freshly written file
    metadata.storage_meta.modules = [Payload(marker)]
    (folder / METADATA).write_bytes(pickle.dumps(metadata))
    fix_manifest(folder)


def test_the_payload_runs_under_plain_pickle(tmp_path):
    # The control: the planted file does run code when read the way torch reads it.
    run, _ = save_three(tmp_path / "run", asynchronous=False)
    marker = tmp_path / "owned"
    plant_metadata(run.checkpoint_dir(3), marker)
    with open(run.checkpoint_dir(3) / METADATA, "rb") as fh:
        pickle.load(fh)
    assert marker.exists()


def test_a_planted_metadata_runs_nothing_and_the_older_checkpoint_is_used(tmp_path):
    run, held = save_three(tmp_path / "run", asynchronous=False)
    marker = tmp_path / "owned"
    plant_metadata(run.checkpoint_dir(3), marker)
    assert mf.verify(run.checkpoint_dir(3), checksums=False)  # sizes and manifest agree: only parsing can tell
    for verify in (mf.verify, lambda path: loading.verify(Comm(None), path)):  # one process; the ranks' collective
        with pytest.raises(mf.Rejected, match="refers to posix.system"):
            verify(run.checkpoint_dir(3))

    step, model = resume_fresh(run)
    assert not marker.exists()
    assert step == 2 and all(torch.equal(a, b) for a, b in zip(params(model), held[2], strict=True))
    (rejected,) = events(run, "checkpoint_rejected")
    assert rejected["step"] == 3
    assert "refers to posix.system, which is not one of DCP's metadata classes" in rejected["reason"]

    # list on a login node: no torch, and the payload is found all the same
    code = ("import sys, runpy; sys.modules['torch'] = None; sys.argv = ['dtk.checkpoint', 'list',"
            f" {str(run.path)!r}]; runpy.run_module('dtk.checkpoint', run_name='__main__')")
    proc = dtk("-c", code)
    assert proc.returncode == 0, proc.stderr
    rows = {int(line.split()[0]): line for line in proc.stdout.splitlines()[1:]}
    assert rows[2].endswith("yes") and "NO: .metadata refers to posix.system" in rows[3]

    out = tmp_path / "model.pt"
    assert checkpoint_main(["export", str(run.path), "--out", str(out)]) == 0
    assert json.loads(out.with_name("model.pt.json").read_text())["step"] == 2
    exported = torch.load(out, weights_only=True)
    assert all(torch.equal(exported[k], v) for k, v in zip(exported, held[2], strict=True))
    for fmt in ("torch", "hf"):  # asked for by its step, the planted checkpoint is refused unread
        planted = tmp_path / f"planted-{fmt}"
        with pytest.raises(UserError, match="--step 3: the checkpoint does not verify.*posix.system"):
            checkpoint_main(["export", str(run.path), "--step", "3", "--format", fmt, "--out", str(planted)])
        assert not planted.exists()
    assert not marker.exists()


def test_a_metadata_changed_behind_the_manifest_is_refused_by_its_checksum_before_parsing(tmp_path):
    run, _ = save_three(tmp_path / "run", asynchronous=False)
    marker = tmp_path / "owned"
    folder = run.checkpoint_dir(3)
    manifest = json.loads((folder / mf.MANIFEST).read_text())
    plant_metadata(folder, marker)
    size = (folder / METADATA).stat().st_size
    manifest["files"][METADATA]["size"] = size  # the size matches, the CRC does not
    (folder / mf.MANIFEST).write_text(json.dumps(manifest))
    step, _ = resume_fresh(run)
    assert step == 2 and not marker.exists()
    assert f"{METADATA} crc32" in events(run, "checkpoint_rejected")[0]["reason"]


@pytest.mark.parametrize("name", ["builtins.eval", "os.system", "torch.load", "subprocess.Popen", "builtins.setattr"])
def test_the_unpickler_admits_dcp_metadata_only(name):
    module, attr = name.rsplit(".", 1)
    data = b"\x80\x04c" + f"{module}\n{attr}\n".encode() + b"\x8c\x04echo\x85R."  # GLOBAL, ('echo',), REDUCE
    for resolve in (True, False):
        with pytest.raises(mf.Rejected, match=f"refers to {name}, which is not one of DCP's"):
            MetadataUnpickler(io.BytesIO(data), resolve=resolve).load()


def _by_getattr(target: object, name: str) -> bytes:
    """A pickle of `getattr(target, name)`, as Python 3.11.0-3.11.3 and 3.12+ pickle an Enum member."""
    class ByGetattr:
        def __reduce__(self):
            return getattr, (target, name)
    return pickle.dumps(ByGetattr(), protocol=4)


def test_an_enum_member_pickled_by_getattr_is_admitted_and_nothing_else_is():
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    data = _by_getattr(_MEM_FORMAT_ENCODING, "TORCH_CONTIGUOUS_FORMAT")
    assert MetadataUnpickler(io.BytesIO(data), resolve=True).load() is _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
    assert MetadataUnpickler(io.BytesIO(data), resolve=False).load() is not None  # no torch needed to check it
    for target, name in [(torch.Size, "__class__"), (os.system, "__call__"), (_MEM_FORMAT_ENCODING, "__init__"),
                         (_MEM_FORMAT_ENCODING, "__class__")]:
        for resolve in (True, False):
            with pytest.raises(mf.Rejected):
                MetadataUnpickler(io.BytesIO(_by_getattr(target, name)), resolve=resolve).load()


@pytest.mark.parametrize(("field", "value", "reason"), [
    ("relative_path", "../../../etc/passwd", "points at '../../../etc/passwd', which is not a shard listed"),
    ("length", 1 << 40, "points at bytes 0\\+1099511627776 of __0_0.distcp, which has"),
    ("transform_descriptors", ["zstd"], "asks for stream transforms"),
])
def test_an_index_that_points_outside_the_checkpoint_is_refused(tmp_path, field, value, reason):
    run, _ = save_three(tmp_path / "run", asynchronous=False)
    folder = run.checkpoint_dir(3)
    with open(folder / METADATA, "rb") as fh:
        metadata = pickle.load(fh)
    info = next(iter(metadata.storage_data.values()))
    setattr(info, field, value)
    (folder / METADATA).write_bytes(pickle.dumps(metadata))
    fix_manifest(folder)
    manifest = mf.read_manifest(folder)
    with pytest.raises(mf.Rejected, match=reason):
        check_metadata(folder, manifest)
    step, _ = resume_fresh(run)
    assert step == 2
    assert re.search(reason, events(run, "checkpoint_rejected")[0]["reason"])


def test_a_tensor_declared_as_pickled_bytes_is_refused_unread(tmp_path):
    # An index that says a model weight is a bytes item would have DCP torch.load it with
    # weights_only=False; dtk stores only the optimizer's param groups as bytes.
    run, _ = save_three(tmp_path / "run", asynchronous=False)
    folder = run.checkpoint_dir(3)
    with open(folder / METADATA, "rb") as fh:
        metadata = pickle.load(fh)
    key = "model.0.weight"
    (index, info), = [(i, s) for i, s in metadata.storage_data.items() if i.fqn == key]
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    metadata.storage_data[MetadataIndex(key)] = info
    (folder / METADATA).write_bytes(pickle.dumps(metadata))
    fix_manifest(folder)
    step, _ = resume_fresh(run)
    assert step == 2
    assert f"stores '{key}' as pickled bytes" in events(run, "checkpoint_rejected")[0]["reason"]


def test_a_payload_in_a_param_group_bytes_item_runs_nothing(tmp_path):
    run, _ = save_three(tmp_path / "run", asynchronous=False)
    folder, marker = run.checkpoint_dir(3), tmp_path / "owned"
    # Rewrite the shards with a pickled object where a learning rate belongs, through DCP itself.
    from test_checkpoint import make_parts

    model, optimizer, _ = make_parts()
    model_sd, optim_sd, _ = _state_dicts([(model, optimizer)])
    (lr,) = [k for k in optim_sd if k.startswith("param_groups.") and k.endswith(".lr")][:1]
    optim_sd[lr] = Payload(marker)
    for p in [*folder.glob("*.distcp"), folder / METADATA]:
        p.unlink()
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder), no_dist=True)
    fix_manifest(folder)
    step, _ = resume_fresh(run)
    assert not marker.exists()
    assert step == 2
    reason = events(run, "checkpoint_rejected")[0]["reason"]
    assert f"bytes item 'optim.{lr}' does not load as plain data (it refers to posix.system)" in reason


def test_delete_tells_the_newest_verified_checkpoint_by_its_checksums(tmp_path):
    run, _ = save_three(tmp_path / "run", asynchronous=False)
    corrupt_flip(run.checkpoint_dir(3))  # the sizes still match the manifest
    with pytest.raises(UserError, match="--step 2 is the newest verified checkpoint.*back to step 1"):
        delete_checkpoint(run.path, step=2)
    assert run.checkpoint_dir(2).is_dir()
    assert delete_checkpoint(run.path, step=3).startswith("deleted checkpoint step 3")
    step, _ = resume_fresh(run)
    assert step == 2
    assert delete_checkpoint(run.path, step=2, force=True).startswith("deleted checkpoint step 2")


@pytest.mark.slow
@pytest.mark.dist
def test_a_planted_metadata_in_a_real_run_runs_nothing_and_the_run_resumes_from_the_older_one(tmp_path):
    job = ["+scheme=fsdp", "tasks_per_node=2", "train.steps=4", "checkpoint.every=2", "run.name=r",
           f"run.root={tmp_path}"]
    proc = dtk("dtk.submit", *job, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    run = RunDir(tmp_path / "r")
    marker = tmp_path / "owned"
    plant_metadata(run.checkpoint_dir(4), marker)

    proc = dtk("dtk.checkpoint", "list", str(run.path))
    assert proc.returncode == 0 and "NO: .metadata refers to posix.system" in proc.stdout, proc.stderr
    out = tmp_path / "model.pt"
    proc = dtk("dtk.checkpoint", "export", str(run.path), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.with_name("model.pt.json").read_text())["step"] == 2

    # As after a start killed between its last commit and its summary: the next command resumes.
    run.summary.unlink()
    proc = dtk("dtk.submit", *job, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert not marker.exists()
    (rejected,) = [e for e in run.events_list() if e["event"] == "checkpoint_rejected"]
    assert rejected["step"] == 4 and "refers to posix.system" in rejected["reason"]
    loaded = [e for e in run.events_list() if e["event"] == "checkpoint_loaded"]
    assert [e["step"] for e in loaded] == [2]
    assert json.loads(run.summary.read_text())["final_step"] == 4
    assert mf.verify(run.checkpoint_dir(4))  # saved again by the resumed run, over the planted one
