"""python -m dtk.handover RUN_DIR --out DIR: the folder a team operates a setup by."""

from __future__ import annotations

import json

import pytest

from conftest import dtk, only_run_dir
from dtk.config.compose import compose
from dtk.plan.plan import Plan, make_plan

ARTIFACTS = ("README.md", "plan.md", "config/config.yaml", "config/plan.json", "config/overrides.txt", "plan.txt", "access.md",
             "recovery.md", "operations.md", "acceptance.md", "reference.md", "access-guide.md", "report/report.txt",
             "report/report.json", "status.json", "audit.txt")


def test_mistakes_are_one_error_line_and_write_nothing(tmp_path):
    proc = dtk("dtk.handover", str(tmp_path), "--out", str(tmp_path / "h"))
    assert proc.returncode == 2 and proc.stderr.startswith("error: RUN_DIR=") and "no plan.json" in proc.stderr
    assert not (tmp_path / "h").exists()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "plan.json").write_text("{}")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    proc = dtk("dtk.handover", str(tmp_path / "run"), "--out", str(tmp_path / "full"))
    assert proc.returncode == 2 and "--out" in proc.stderr and "not an empty folder" in proc.stderr


@pytest.mark.slow
def test_the_handover_folder_has_every_artifact_and_its_plan_matches_the_run(tmp_path):
    overrides = ["train.steps=8", "checkpoint.every=4", "optim.lr=2e-3", "train.global_batch=32"]
    proc = dtk("dtk.submit", *overrides, f"run.root={tmp_path / 'runs'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    run = only_run_dir(tmp_path / "runs")
    out = tmp_path / "handover"
    proc = dtk("dtk.handover", str(run), "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "missing" not in proc.stdout
    for name in ARTIFACTS:
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert sorted(p.suffix for p in (out / "report").glob("*.png")), "the report's plots"
    readme = (out / "README.md").read_text()
    assert "| `plan.md` |" in readme and "MISSING" not in readme
    assert (out / "plan.md").read_text() == (run / "plan.md").read_text()  # the topology scheme, as the run has it
    assert (out / "config" / "config.yaml").read_text() == (run / "config.yaml").read_text()
    # The plan handed over is the run's: as the run recorded it, and as the overrides compose it again.
    plan = Plan.from_json((run / "plan.json").read_text())
    assert (out / "plan.txt").read_text() == plan.describe() + "\n"
    again = (out / "config" / "overrides.txt").read_text().split()
    assert {o.split('=')[0] for o in overrides} <= {o.split('=')[0] for o in again}
    replanned = make_plan(compose([*again, f"run.root={tmp_path / 'runs'}"]), cwd=tmp_path)
    assert replanned.config_hash == plan.config_hash and replanned.describe() == plan.describe()
    assert json.loads((out / "status.json").read_text())["state"] == "finished"
    assert "submit" in (out / "audit.txt").read_text()
    assert "access policy open" in (out / "access.md").read_text()
