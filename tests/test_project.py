"""A project folder of the user's own: `python -m dtk.init DIR` writes it, and dtk's
commands find its config groups before dtk's own (from the folder, --config-dir,
DTK_CONFIG_PATH) and its modules on the import path. Fast: compose and plan only, plus the
commands run in-process (run_main) for the error contract."""

from __future__ import annotations

import pytest

from conftest import run_main
from dtk.common.errors import UserError
from dtk.config.compose import compose, pop_config_dirs, search_path
from dtk.init import init
from dtk.plan.plan import Plan, make_plan


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.delenv("DTK_CONFIG_PATH", raising=False)
    folder = tmp_path / "proj"
    init(folder)
    return folder


def test_init_writes_the_starter_folder(project):
    files = {str(p.relative_to(project)) for p in project.rglob("*") if p.is_file()}
    assert files == {
        "README.md", ".gitignore", "proj.py", "conf/project/default.yaml", "conf/model/proj.yaml",
        "conf/data/proj.yaml", "conf/cluster/site.yaml",
    }
    readme = (project / "README.md").read_text()
    for command in ("python -m dtk.submit\n", "python -m dtk.submit cluster=site", "python -m dtk.status runs/"):
        assert command in readme
    assert "__MODULE__" not in readme and "__NAME__" not in readme
    ignored = (project / ".gitignore").read_text().split()
    assert "data/" in ignored and "runs/" in ignored
    assert (project / "conf/model/proj.yaml").read_text().count("_target_: proj.build") == 1


def test_project_folder_groups_come_first(project, monkeypatch):
    monkeypatch.chdir(project)
    # The folder's own transformer.yaml replaces dtk's (same group, same name).
    (project / "conf/model/transformer.yaml").write_text("defaults:\n  - transformer_schema\n  - _self_\ndim: 48\n")
    search = search_path()
    assert search.config == (project / "conf",) and search.modules == (project,)
    cfg = compose(["model=transformer"], search=search)
    assert cfg.model.kwargs["dim"] == 48
    # conf/project/default.yaml makes the project's model, data the defaults ...
    cfg = compose([], search=search)
    assert cfg.model._target_ == "proj.build" and cfg.data.num_samples == 4096
    # ... the site file is a cluster option next to dtk's, and the command line wins.
    cfg = compose(["cluster=site", "cluster.partition=gpu"], search=search)
    assert cfg.cluster.kind == "slurm" and cfg.cluster.partition == "gpu"


def test_config_dir_and_env_from_elsewhere(project, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    dirs, rest = pop_config_dirs(["--config-dir", str(project), "train.steps=3", f"--config-dir={project}/conf"])
    assert rest == ["train.steps=3"] and dirs == [str(project), f"{project}/conf"]
    for search in (search_path(dirs), search_path([f"{project}/conf"])):
        assert search.config == (project / "conf",) and search.modules == (project,)
    monkeypatch.setenv("DTK_CONFIG_PATH", str(project))
    search = search_path()
    assert search.modules == (project,)
    plan = make_plan(compose([], search=search), cwd=tmp_path, import_path=search.modules)
    assert plan.config.model._target_ == "proj.build"
    assert Plan.from_json(plan.to_json()).import_path == (str(project),)


def test_no_project_without_a_conf_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("DTK_CONFIG_PATH", raising=False)
    monkeypatch.chdir(tmp_path)
    assert search_path().config == ()
    assert compose([]).model._target_ == "dtk.models.transformer.build"


def test_init_refuses_a_folder_with_files_and_bad_names(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(UserError, match="not an empty folder"):
        init(tmp_path / "full")
    with pytest.raises(UserError, match="already importable"):
        init(tmp_path / "torch")
    with pytest.raises(UserError, match="not a Python module name"):
        init(tmp_path / "p", name="my-model")
    assert not (tmp_path / "torch").exists() and not (tmp_path / "p").exists()
    init(tmp_path / "empty_ok", name="mine")  # an empty folder is fine, and --name names the module
    assert (tmp_path / "empty_ok" / "mine.py").is_file()


def test_cli_errors_are_one_line(tmp_path):
    proc = run_main("dtk.plan", "--config-dir", str(tmp_path / "missing"), cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --config-dir") and proc.stderr.count("\n") == 1
    init(tmp_path / "proj")
    proc = run_main("dtk.init", str(tmp_path / "proj"), cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("error: DIR ") and "Traceback" not in proc.stderr
    # model=transformer: the project folder is on the import path without its model being
    # counted in a torch subprocess (test_plan_gate counts a user model).
    proc = run_main("dtk.plan", "--json", "model=transformer", cwd=tmp_path / "proj", env={"DTK_CONFIG_PATH": ""})
    assert proc.returncode == 0, proc.stderr
    assert '"import_path": [' in proc.stdout and str(tmp_path / "proj") in proc.stdout
