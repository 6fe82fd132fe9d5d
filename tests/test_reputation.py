"""Node reputation across the runs of a run root (dtk/launch/reputation.py): the one rule that
dtk.watch's suspect_node and every submission's --exclude ask, and dtk.nodes RUN_ROOT.
The exclusion records are written by the driver's own writer (dtk.driver.exclusions); the
lab test of a real submission is tests/test_reputation_lab.py."""

from __future__ import annotations

import json
import time
from pathlib import Path

from conftest import run_main
from dtk.common.rundir import RunDir
from dtk.config.schema import ClusterConfig
from dtk.driver.exclusions import add_exclusions, readmit
from dtk.launch import reputation


def run_dir(root: Path, name: str, *, suspect_after: int | None = None) -> RunDir:
    path = root / name
    path.mkdir(parents=True)
    cluster = {} if suspect_after is None else {"suspect_after": suspect_after}
    (path / "plan.json").write_text(json.dumps({"steps": 1, "config": {"cluster": cluster}}))
    (path / "events.jsonl").write_text("")
    return RunDir(path)


def test_a_node_excluded_by_k_runs_is_suspect_until_readmitted_to_the_root(tmp_path):
    a, b, c = (run_dir(tmp_path, n) for n in "abc")
    add_exclusions(a, ["node2", "node3"], job_id="1", reason="node(s) node2 left the job")
    add_exclusions(b, ["node2"], job_id="2", reason="node(s) node2 left the job")
    add_exclusions(c, ["node3"], job_id="3", reason="hang")
    assert ClusterConfig().suspect_after == reputation.DEFAULT_AFTER == 2
    assert reputation.suspects(tmp_path) == {"node2": ["a", "b"], "node3": ["a", "c"]}
    assert reputation.suspects(tmp_path, after=3) == {} and reputation.suspects(tmp_path, after=0) == {}
    # Given back to one run: that run no longer counts against it.
    readmit(c, "node3", by="op", reason="repaired")
    assert reputation.suspects(tmp_path) == {"node2": ["a", "b"]}
    # Given back to the root: only exclusions after it count, the runs keep their own lists.
    reputation.readmit(tmp_path, ["node2"], by="op", reason="dtk.nodes --readmit")
    assert reputation.suspects(tmp_path) == {}
    time.sleep(0.01)
    add_exclusions(c, ["node2"], job_id="4", reason="node(s) node2 left the job")
    assert reputation.suspects(tmp_path, after=1) == {"node2": ["c"], "node3": ["a"]} and reputation.suspects(tmp_path) == {}


def test_the_root_threshold_is_the_smallest_any_run_was_submitted_with():
    assert reputation.threshold([]) == reputation.DEFAULT_AFTER
    plans = [{"config": {"cluster": {"suspect_after": k}}} for k in (3, 1)] + [{}]
    assert reputation.threshold(plans) == 1


def test_watch_and_a_submission_see_the_same_suspects(tmp_path):
    from dtk import watch
    from dtk.config.compose import compose
    from dtk.launch.sbatch import sbatch_text
    from dtk.plan.plan import make_plan
    from dtk.submit.start import submit_inputs

    for name in ("a", "b"):
        add_exclusions(run_dir(tmp_path, name), ["node2"], job_id=name, reason="node(s) node2 left the job")
    (alert,) = watch.detect(tmp_path, now=time.time(), job_state=lambda job: None)
    assert alert.detector == "suspect_node" and alert.details == {"node": "node2", "runs": ["a", "b"]}
    plan = make_plan(compose(["cluster=lab", "nodes=1", f"run.root={tmp_path}", "run.name=third"]))
    inputs = submit_inputs(plan, RunDir(Path(plan.run_dir)))
    assert inputs.exclude == ("node2",) and "#SBATCH --exclude=node2" in sbatch_text(plan, inputs)
    assert inputs.note.startswith("leaving out 1 suspect node(s)") and "node2 (excluded by a, b)" in inputs.note
    off = make_plan(compose(["cluster=lab", "nodes=1", f"run.root={tmp_path}", "run.name=third",
                             "cluster.suspect_after=0"]))
    assert submit_inputs(off, RunDir(Path(off.run_dir))).exclude == ()


def test_dtk_nodes_lists_a_roots_suspects_and_readmits_them(tmp_path):
    for name in ("a", "b"):
        add_exclusions(run_dir(tmp_path, name), ["node2"], job_id=name, reason="left")
    add_exclusions(RunDir(tmp_path / "a"), ["node3"], job_id="a", reason="left")
    shown = run_main("dtk.nodes", str(tmp_path))
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines()[:2] == [
        f"1 suspect node(s) under {tmp_path} (excluded by 2 or more runs: left out of new submissions):",
        "  node2        excluded by 2 runs: a, b"]
    wrong = run_main("dtk.nodes", str(tmp_path), "--readmit", "node3")
    assert wrong.returncode == 2 and wrong.stderr.strip() == (
        f"error: --readmit node3: no suspect node node3 under {tmp_path} (suspect now: node2)")
    done = run_main("dtk.nodes", str(tmp_path), "--readmit", "all")
    assert done.returncode == 0 and done.stdout.startswith(f"node2 re-admitted to {tmp_path}")
    assert reputation.suspects(tmp_path) == {}
    listed = json.loads(run_main("dtk.nodes", str(tmp_path), "--json").stdout)
    assert [e["node"] for e in listed["nodes"]] == ["node3"] and listed["readmitted"]["node2"]["reason"] == "dtk.nodes --readmit"
