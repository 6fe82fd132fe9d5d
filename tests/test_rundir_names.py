"""Every name in a run directory is defined once, in dtk/common/rundir.py: a writer and its readers
(login node, driver, workers, report, benchmarks) cannot drift apart. Checked over dtk and
benchmarks/ with `ast`, and on planted literals. The tests spell the names themselves on
purpose: they hold the files on disk to what users and their tools read."""

from __future__ import annotations

import ast

import pytest

from conftest import REPO

# Files that may spell one of the names for another purpose, each with its reason.
ELSEWHERE = {
    ("dtk/data/hdf5.py", "manifest.json"): "a dataset folder's own manifest, not a checkpoint's",
    ("dtk/lab/files.py", "lock"): "the lab directory's lock, not a run's",
    # dtk/driver/ is being unified (one core for both backends) in a parallel change, which
    # takes these from dtk.common.rundir; until it lands the driver keeps its own spelling.
    ("dtk/driver/supervisor.py", "plan.json"): "the driver's copy of the plan in a start's log folder",
    ("dtk/driver/exclusions.py", "excluded_nodes.json"): "dtk.common.rundir.EXCLUDED_NODES, once the driver imports it",
    ("dtk/driver/exclusions.py", "excluded_nodes.lock"): "dtk.common.rundir.EXCLUDED_NODES_LOCK, likewise",
    ("dtk/driver/logs.py", "srun.log"): "dtk.common.rundir.SRUN_LOG, likewise",
    ("dtk/driver/resize.py", "health"): "dtk.common.rundir.HEALTH_DIR, likewise",
}


def rundir_names() -> set[str]:
    """The values of dtk/common/rundir.py's module-level string constants."""
    tree = ast.parse((REPO / "dtk" / "common" / "rundir.py").read_text())
    return {
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
        and all(isinstance(t, ast.Name) and t.id.isupper() for t in node.targets)
    }


def restated_names(source: str, where: str, names: set[str]) -> list[str]:
    """Where `source` spells a run-directory name itself: in a path (`run / "metrics.jsonl"`),
    as a module constant (`EVAL_LOG = "eval.jsonl"`), or anywhere for a name with a suffix
    (`open("summary.json")`, a dict key)."""
    found = []
    tree = ast.parse(source)
    constants = {id(n.value) for n in tree.body if isinstance(n, ast.Assign)
                 and all(isinstance(t, ast.Name) and t.id.isupper() for t in n.targets)}
    in_path = {id(n.right) for n in ast.walk(tree) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div)}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names):
            continue
        if (where, node.value) in ELSEWHERE:
            continue
        if id(node) in constants or id(node) in in_path or "." in node.value:
            found.append(f"{where}:{node.lineno}: {node.value!r} is dtk.common.rundir's; import its constant")
    return found


def test_run_directory_names_are_defined_once():
    names = rundir_names()
    assert {"metrics.jsonl", "events.jsonl", "heartbeat", "stop_request.json", "summary.json"} <= names
    found = []
    for path in sorted([*(REPO / "dtk").rglob("*.py"), *(REPO / "benchmarks").rglob("*.py")]):
        where = str(path.relative_to(REPO))
        if where != "dtk/common/rundir.py":
            found += restated_names(path.read_text(), where, names)
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "planted",
    [
        "path = run.path / 'metrics.jsonl'",
        "HEARTBEAT = 'heartbeat'",
        "summary = json.loads(open('summary.json').read())",
        "files = {'plan.md': text}",
        "def f(run):\n    return run / 'checkpoints' / 'step_1'",
    ],
)
def test_the_name_rule_catches_a_planted_literal(planted):
    assert restated_names(planted, "dtk/planted.py", rundir_names())


def test_the_name_rule_lets_other_strings_through():
    clean = "record = {'checkpoints': 3, 'heartbeat': True}\nevent = 'heartbeat'\nname = run.path / METRICS"
    assert restated_names(clean, "dtk/clean.py", rundir_names()) == []
