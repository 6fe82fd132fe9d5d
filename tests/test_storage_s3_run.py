"""A run whose checkpoints go to S3 (`checkpoint.dir=s3://BUCKET/PREFIX`), against an
S3-compatible server started on 127.0.0.1 (moto's server mode): `python -m dtk.submit` with
2 gloo workers, killed with SIGKILL, resumed by the same command from the objects in the
bucket, and its losses bitwise those of an uninterrupted run on local disk. Then the
login-node commands on the S3 run, and the submission's checks of a bad location."""

from __future__ import annotations

import json

import pytest
import torch
from test_resume import events, finish, kill_workers, launch, records, step_reached, wait_for

from conftest import new_bucket, run_main, s3_server
from dtk.common.storage import checkpoint_steps, open_storage


@pytest.mark.slow
@pytest.mark.dist
def test_a_run_checkpointing_to_s3_is_killed_and_resumes_bitwise(tmp_path):
    (tmp_path / "ref").mkdir()
    finish(tmp_path / "ref")
    reference = records(tmp_path / "ref" / "r")
    assert sorted(reference) == list(range(1, 41))
    with s3_server():
        url = f"s3://{new_bucket()}/team/ckpts"
        root = tmp_path / "s3"
        root.mkdir()
        run = root / "r"
        driver = launch(root, f"checkpoint.dir={url}")
        wait_for("step 14", lambda: step_reached(run, 0, 14), driver)
        kill_workers(run, driver)
        store = open_storage(url).child("r")
        committed = [step for step, _, ok in checkpoint_steps(store) if ok]
        assert committed and max(committed) >= 12, committed
        assert not list((run / "checkpoints").glob("step_*"))  # nothing on the local disk

        finish(root, f"checkpoint.dir={url}")
        got = records(run)
        assert sorted(got) == list(range(1, 41))
        assert {s: r["loss"] for s, r in got.items()} == {s: r["loss"] for s, r in reference.items()}
        assert {s: r["batch_hash"] for s, r in got.items()} == {s: r["batch_hash"] for s, r in reference.items()}
        [loaded] = events(run, "checkpoint_loaded")
        assert loaded["path"] == f"{url}/r/step_{loaded['step']:08d}"
        assert loaded["step"] in committed
        # checkpoint.keep=2 held in the bucket: the two newest, the last step's among them
        assert [(s, ok) for s, _, ok in checkpoint_steps(store)] == [(36, True), (40, True)]

        listed = run_main("dtk.checkpoint", "list", "--json", str(run))
        assert listed.returncode == 0, listed.stderr
        rows = [json.loads(line) for line in listed.stdout.splitlines()]
        assert [(r["step"], r["verified"], r["path"]) for r in rows] == [
            (36, True, f"{url}/r/step_00000036"), (40, True, f"{url}/r/step_00000040")]

        out = tmp_path / "model.pt"
        exported = run_main("dtk.checkpoint", "export", str(run), "--out", str(out))
        assert exported.returncode == 0, exported.stderr
        assert json.loads(out.with_name("model.pt.json").read_text())["checkpoint"] == f"{url}/r/step_00000040"
        local = tmp_path / "ref.pt"
        assert run_main("dtk.checkpoint", "export", str(tmp_path / "ref" / "r"), "--out", str(local)).returncode == 0
        mine, theirs = torch.load(out, weights_only=True), torch.load(local, weights_only=True)
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
