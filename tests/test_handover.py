"""python -m dtk.handover RUN_DIR --out DIR: the folder a team operates a setup by."""

from __future__ import annotations

import json

import pytest

from conftest import dtk, only_run_dir, run_main
from dtk.config.compose import compose
from dtk.handover import main as handover_main
from dtk.plan.plan import Plan, make_plan

ARTIFACTS = ("README.md", "plan.md", "config/config.yaml", "config/plan.json", "config/overrides.txt", "plan.txt", "access.md",
             "recovery.md", "operations.md", "acceptance.md", "reference.md", "access-guide.md", "report/report.txt",
             "report/report.json", "status.json", "audit.txt")


def test_mistakes_are_one_error_line_and_write_nothing(tmp_path):
    proc = dtk("dtk.handover", str(tmp_path), "--out", str(tmp_path / "h"))  # the real entry point, python -m dtk.handover
    assert proc.returncode == 2 and proc.stderr.startswith("error: RUN_DIR=") and "no plan.json" in proc.stderr
    assert not (tmp_path / "h").exists()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "plan.json").write_text("{}")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    proc = run_main("dtk.handover", str(tmp_path / "run"), "--out", str(tmp_path / "full"))
    assert proc.returncode == 2 and "--out" in proc.stderr and "not an empty folder" in proc.stderr


@pytest.mark.slow
def test_the_handover_folder_has_every_artifact_and_its_plan_matches_the_run(tmp_path):
    overrides = ["train.steps=8", "checkpoint.every=4", "optim.lr=2e-3", "train.global_batch=32"]
    proc = dtk("dtk.submit", *overrides, f"run.root={tmp_path / 'runs'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    run = only_run_dir(tmp_path / "runs")
    out = tmp_path / "handover"
    assert handover_main([str(run), "--out", str(out)]) == 0
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


def _recorded_run(root, overrides, *, search=None, steps=4):
    """A run directory as dtk.submit and a finished job leave it (plan, config, records),
    written here without training: handover reads only these files."""
    from dtk.config.compose import SearchPath, to_yaml

    search = search or SearchPath()
    cfg = compose([*overrides, f"run.root={root}"], search=search)
    plan = make_plan(cfg, import_path=search.modules)
    run = root / plan.run_name
    run.mkdir(parents=True)
    (run / "plan.json").write_text(plan.to_json())
    (run / "config.yaml").write_text(to_yaml(plan.config))
    (run / "plan.md").write_text("# the topology scheme\n")
    events = [{"time": 10.0, "event": "submitted", "cluster": "local"}, {"time": 11.0, "event": "started", "restart": 0},
              {"time": 12.0, "event": "ready"}, {"time": 12.0 + steps, "event": "finished", "step": steps}]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "time": 12.0 + s, "loss": 5.0 - s, "restart": 0,
                                                           "step_time_s": 1.0, "world_size": 2}) + "\n"
                                       for s in range(1, steps + 1)))
    (run / "summary.json").write_text(json.dumps({"status": "finished", "final_step": steps, "final_loss": 5.0 - steps}))
    return run, plan


def test_an_empty_out_folder_keeps_its_owner_group_and_mode_and_nothing_beside_it_is_touched(tmp_path):
    import os

    run, _ = _recorded_run(tmp_path / "runs", ["train.steps=4"])
    out = tmp_path / "team" / "handover"
    out.mkdir(parents=True)
    out.chmod(0o2750)
    gid = 1 if os.geteuid() == 0 else os.getgid()  # another group where this user may give one
    os.chown(out, -1, gid)
    before = out.stat()
    theirs = tmp_path / "team" / ".handover.tmp"  # someone's folder, named as dtk's temporary once was
    theirs.mkdir()
    (theirs / "keep").write_text("mine")
    assert handover_main([str(run), "--out", str(out)]) == 0
    after = out.stat()
    assert (after.st_ino, after.st_mode, after.st_uid, after.st_gid) == (before.st_ino, before.st_mode, before.st_uid,
                                                                          before.st_gid)
    assert (out / "README.md").is_file() and (theirs / "keep").read_text() == "mine"
    assert sorted(p.name for p in (tmp_path / "team").iterdir()) == [".handover.tmp", "handover"]
    new = tmp_path / "team" / "new"
    assert handover_main([str(run), "--out", str(new)]) == 0
    assert new.stat().st_mode & 0o777 == 0o777 & ~_umask()  # a folder of its own: the usual mode, not 0700
    assert run_main("dtk.handover", str(run), "--out", str(tmp_path / "nowhere" / "h")).stderr.startswith(
        f"error: --out {tmp_path / 'nowhere' / 'h'}: no folder")


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_the_handover_folder_is_a_baseline_and_its_config_folder_is_not_one(tmp_path):
    run, _ = _recorded_run(tmp_path / "runs", ["train.steps=4"])
    out = tmp_path / "handover"
    assert handover_main([str(run), "--out", str(out)]) == 0
    assert {p.name for p in (out / "run").iterdir()} >= {"metrics.jsonl", "events.jsonl", "summary.json", "plan.json"}
    report = (out / "report" / "report.txt").read_text()
    assert "  report/loss.png" in report and str(tmp_path) + "/." not in report  # no temporary folder's paths
    again, _ = _recorded_run(tmp_path / "again", ["train.steps=4"], steps=4)
    proc = run_main("dtk.report", str(again), "--baseline", str(out), "--no-plots")
    assert proc.returncode == 0, proc.stderr
    assert "against baseline" in proc.stdout and "step time (s)" in proc.stdout and "same" in proc.stdout
    proc = run_main("dtk.report", str(again), "--baseline", str(out / "config"), "--no-plots")
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: --baseline {out / 'config'}: holds no logged step")
    assert len(proc.stderr.splitlines()) == 1


@pytest.mark.slow
def test_a_run_of_the_users_own_project_is_repeated_from_the_handover_folder(tmp_path):
    """The project (python -m dtk.init), a git checkout; its run handed over; the overrides
    composed with the handover folder's conf/ from elsewhere give the run's hash and name."""
    import subprocess

    from dtk.config.compose import search_path

    project = tmp_path / "proj"
    assert run_main("dtk.init", str(project)).returncode == 0
    git = ["git", "-C", str(project), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "project"], check=True)
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    search = search_path([str(project)], cwd=tmp_path)
    run, plan = _recorded_run(tmp_path / "runs", ["model.width=32", "optim.lr=1e-3"], search=search)
    out = tmp_path / "handover"
    assert handover_main([str(run), "--out", str(out)]) == 0
    assert (out / "conf" / "model" / "proj.yaml").read_text() == (project / "conf" / "model" / "proj.yaml").read_text()
    assert f"{project}  {commit}" in (out / "project.txt").read_text()
    overrides = (out / "config" / "overrides.txt").read_text().split()
    assert "model.width=32" in overrides
    again = make_plan(compose([*overrides, f"run.root={tmp_path / 'runs'}"], search=search_path([str(out)], cwd=tmp_path)),
                      import_path=(str(project),))
    assert (again.config_hash, again.run_name) == (plan.config_hash, plan.run_name)


@pytest.mark.slow
def test_a_hugging_face_run_is_repeated_from_the_handover_folder(tmp_path):
    from dtk.config.compose import SearchPath

    hf = tmp_path / "tiny-llama"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64}))
    run, plan = _recorded_run(tmp_path / "runs", ["model=hf", f"model.config={hf}", "model.seq_len=32"])
    out = tmp_path / "handover"
    assert handover_main([str(run), "--out", str(out)]) == 0
    overrides = (out / "config" / "overrides.txt").read_text().split()
    assert "model=hf" in overrides
    again = make_plan(compose([*overrides, f"run.root={tmp_path / 'runs'}"], search=SearchPath()))
    assert (again.config_hash, again.run_name) == (plan.config_hash, plan.run_name)


def _user_data_project(tmp_path):
    """A project (python -m dtk.init) with a data function of its own, chosen by its defaults."""
    project = tmp_path / "proj"
    assert run_main("dtk.init", str(project)).returncode == 0
    (project / "tokens.py").write_text(
        "import numpy as np\n\n\ndef load(n: int = 64, seq_len: int = 16):\n"
        "    return np.random.default_rng(0).integers(0, 64, size=(n, seq_len + 1))\n")
    (project / "conf" / "data" / "tokens.yaml").write_text("_target_: tokens.load\nn: 96\nval_fraction: 0.25\n")
    default = project / "conf" / "project" / "default.yaml"
    default.write_text(default.read_text().replace("override /data: proj", "override /data: tokens"))
    return project


@pytest.mark.slow
def test_a_run_of_a_project_with_its_own_data_gets_its_overrides_and_says_where_its_data_is(tmp_path):
    from dtk.config.compose import search_path

    project = _user_data_project(tmp_path)
    search = search_path([str(project)], cwd=tmp_path)
    run, plan = _recorded_run(tmp_path / "runs", ["optim.lr=1e-3"], search=search)
    assert plan.config.data._target_ == "tokens.load"
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "data_version": "1a2b3c4d-5e6f"}))
    out = tmp_path / "handover"
    assert handover_main([str(run), "--out", str(out)]) == 0
    overrides = (out / "config" / "overrides.txt").read_text().split()
    assert "data=tokens" in overrides and "data=user" not in overrides
    again = make_plan(compose([*overrides, f"run.root={tmp_path / 'runs'}"], search=search_path([str(out)], cwd=tmp_path)),
                      import_path=(str(project),))
    assert (again.config_hash, again.run_name) == (plan.config_hash, plan.run_name)
    readme = (out / "README.md").read_text()
    assert "## The data" in readme and "python -m dtk.submit --config-dir THIS_FOLDER" in readme
    data = readme.split("## The data")[1]
    assert "tokens.load" in data and '"n": 96' in data and "1a2b3c4d-5e6f" in data


def test_the_handover_of_a_prepared_dataset_names_its_folder_and_version(tmp_path):
    from dtk.data.prepare import prepare

    text = tmp_path / "corpus.txt"
    text.write_text("a small corpus of text, " * 400)
    m = prepare(text, tmp_path / "data", seq_len=16, tokenizer="chars", val_fraction=0.1)
    run, _ = _recorded_run(tmp_path / "runs", ["data=hdf5", f"data.path={tmp_path / 'data'}", "model.seq_len=16"])
    out = tmp_path / "handover"
    assert handover_main([str(run), "--out", str(out)]) == 0
    data = (out / "README.md").read_text().split("## The data")[1]
    assert f"`{tmp_path / 'data'}`" in data and m["version"] in data and "chars" in data
    assert "val_00000.h5" in data


@pytest.mark.slow
def test_a_data_function_named_on_the_command_line_is_repeated_with_its_arguments(tmp_path):
    from dtk.config.compose import search_path

    project = _user_data_project(tmp_path)
    (project / "more.py").write_text("from tokens import load as load_more\n")
    search = search_path([str(project)], cwd=tmp_path)
    run, plan = _recorded_run(tmp_path / "runs", ["data=user", "data._target_=more.load_more", "+data.kwargs.n=80"],
                              search=search)
    out = tmp_path / "handover"
    assert handover_main([str(run), "--out", str(out)]) == 0
    overrides = (out / "config" / "overrides.txt").read_text().split()
    assert {"data=user", "data._target_=more.load_more", "+data.kwargs.n=80"} <= set(overrides)
    again = make_plan(compose([*overrides, f"run.root={tmp_path / 'runs'}"], search=search_path([str(out)], cwd=tmp_path)),
                      import_path=(str(project),))
    assert (again.config_hash, again.run_name) == (plan.config_hash, plan.run_name)
