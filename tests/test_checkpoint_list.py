"""`python -m dtk.checkpoint list` takes the folder a user has at hand: the run's folder,
its checkpoints/ folder (not read as a run directory holding another checkpoints/), or one
step folder (that checkpoint only); any other folder is one error line saying what it takes."""

from __future__ import annotations

import pytest
from test_checkpoint import corrupt_flip, save_three

from conftest import run_main

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def rows(stdout: str) -> dict[int, str]:
    lines = stdout.splitlines()
    assert lines[0].split() == ["step", "size", "world", "verified"], stdout
    return {int(line.split()[0]): line for line in lines[1:]}


def test_list_takes_the_run_folder_its_checkpoints_folder_or_one_step_folder(tmp_path):
    run, _ = save_three(tmp_path / "run", asynchronous=False)
    corrupt_flip(run.checkpoint_dir(2))
    whole = run_main("dtk.checkpoint", "list", str(run.path))
    assert whole.returncode == 0, whole.stderr
    assert sorted(rows(whole.stdout)) == [1, 2, 3]

    of_folder = run_main("dtk.checkpoint", "list", str(run.checkpoints))
    assert of_folder.returncode == 0, of_folder.stderr
    assert of_folder.stdout == whole.stdout

    one = run_main("dtk.checkpoint", "list", str(run.checkpoint_dir(2)))
    assert one.returncode == 0, one.stderr
    assert rows(one.stdout) == {2: rows(whole.stdout)[2]} and "NO:" in one.stdout

    as_json = run_main("dtk.checkpoint", "list", "--json", str(run.checkpoint_dir(3)) + "/")
    assert as_json.returncode == 0 and len(as_json.stdout.splitlines()) == 1
    assert '"step": 3' in as_json.stdout and '"verified": true' in as_json.stdout


def test_list_of_a_folder_that_is_no_run_says_what_it_takes(tmp_path):
    other = tmp_path / "notes"
    other.mkdir()
    proc = run_main("dtk.checkpoint", "list", str(other))
    assert proc.returncode == 2 and proc.stdout == ""
    line = proc.stderr.strip()
    assert line.startswith(f"error: RUN_DIR {other}: not a run directory") and "\n" not in line
    assert "its checkpoints/ folder, or one step folder" in line


def test_export_and_delete_take_the_same_folders(tmp_path):
    import torch

    run, held = save_three(tmp_path / "run", asynchronous=False)
    out = tmp_path / "from_folder.pt"
    proc = run_main("dtk.checkpoint", "export", str(run.checkpoints), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"{out}: step 3,")
    one = tmp_path / "step_2.pt"
    proc = run_main("dtk.checkpoint", "export", str(run.checkpoint_dir(2)), "--out", str(one))
    assert proc.returncode == 0 and proc.stdout.startswith(f"{one}: step 2,"), proc.stderr
    state = torch.load(one, weights_only=True)
    assert all(torch.equal(a, b) for a, b in zip(state.values(), held[2], strict=True))

    proc = run_main("dtk.checkpoint", "delete", str(run.checkpoint_dir(1)), "--step", "2")
    assert proc.returncode == 2 and proc.stderr.strip().startswith(
        f"error: RUN_DIR {run.checkpoint_dir(1)} is the folder of step 1, but --step 2 names another")
    assert run.checkpoint_dir(1).is_dir() and run.checkpoint_dir(2).is_dir()
    proc = run_main("dtk.checkpoint", "delete", str(run.checkpoint_dir(1)), "--step", "1")
    assert proc.returncode == 0, proc.stderr
    assert not run.checkpoint_dir(1).exists() and run.checkpoint_dir(2).is_dir()
