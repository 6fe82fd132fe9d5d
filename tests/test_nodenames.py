"""A node name from any source passes the one check (dtk/launch/nodenames.py) before it may
reach a batch script: the exclusions of runs under the root (reputation), the run's own,
cluster.exclude_from, nodes Slurm names (a lost node, a spare), `dtk.nodes --readmit`, and
the driver's resubmission. A name that fails is left out with a warning and shown escaped
as invalid by dtk.nodes and dtk.watch; render_sbatch refuses a line break in any flag. The
lab test with the real sbatch is tests/test_nodenames_lab.py."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from conftest import run_main
from dtk.common.errors import UserError
from dtk.common.rundir import RunDir
from dtk.config.compose import compose
from dtk.driver.exclusions import add_exclusions, invalid_exclusions, read_exclusions
from dtk.launch import reputation
from dtk.launch.nodenames import is_node_name, shown
from dtk.launch.sbatch import SubmitInputs, render_sbatch, sbatch_text
from dtk.plan.plan import make_plan

POISON = "node1\ntouch /tmp/dtk-injected\n#"
"""A name that, on a #SBATCH line, ends it and runs `touch` as whoever submits next."""
ESCAPED = r"'node1\ntouch /tmp/dtk-injected\n#'"


def run_dir(root: Path, name: str) -> RunDir:
    path = root / name
    path.mkdir(parents=True)
    (path / "plan.json").write_text(json.dumps({"steps": 1, "config": {"cluster": {}}}))
    (path / "events.jsonl").write_text("")
    return RunDir(path)


def poison(run: RunDir, *names: str) -> None:
    """Exclusions as anyone who may write the run directory can write them."""
    entries = [{"node": n, "job_id": "1", "reason": "left", "time": time.time()} for n in names]
    (run.path / "excluded_nodes.json").write_text(json.dumps(entries))


def test_the_grammar_is_slurms_hostlist_for_one_name():
    for good in ("node1", "gpu-a100.rack_3", "node[1-3,5]", "n[01-16]-ib", "a"):
        assert is_node_name(good), good
    for bad in ("", "node1\nid", "node1\0", "node1 node2", "node1,node2", "-node1", "[1-3]", "nod\u00e91",
                "node'1", "node;id", "node[1-]", "node[a-b]", "x" * 256, 7, None):
        assert not is_node_name(bad), bad
    assert shown("node2") == "node2" and shown(POISON) == ESCAPED


@pytest.mark.parametrize("key", ["exclude", "job-name", "reservation"])
@pytest.mark.parametrize("bad", ["a\nb", "a\rb", "a\0b"])
def test_render_sbatch_refuses_a_line_break_or_nul_in_any_flag(key, bad):
    with pytest.raises(UserError, match=f"sbatch --{key}="):
        render_sbatch({key: bad, "nodes": "1"}, setup=[], command="true")
    with pytest.raises(UserError, match="sbatch --"):
        render_sbatch({bad: True}, setup=[], command="true")


def test_an_invalid_name_reaching_the_exclude_flag_is_an_internal_error(tmp_path):
    plan = make_plan(compose(["cluster=lab", "nodes=1", f"run.root={tmp_path}"]))
    with pytest.raises(AssertionError, match="invalid node name"):
        sbatch_text(plan, SubmitInputs(exclude=("node2", POISON)))


def test_poisoned_exclusions_under_the_root_never_reach_the_script(tmp_path):
    """Two runs of the root 'exclude' a name with newlines (reputation would make it
    suspect), the run itself another: the dry run shows the intended script, the names
    escaped in one warning line."""
    for name in ("a", "b"):
        poison(run_dir(tmp_path, name), POISON, "node2")
    own = run_dir(tmp_path, "third")
    poison(own, "node3", "node4\nid")
    assert read_exclusions(own) == ["node3"] and invalid_exclusions(own) == ["node4\nid"]
    assert reputation.suspects(tmp_path) == {"node2": ["a", "b"]}
    assert reputation.invalid_of(reputation.exclusions_under(tmp_path)) == {ESCAPED: ["a", "b"], r"'node4\nid'": ["third"]}
    shown_run = run_main("dtk.submit", "cluster=lab", "nodes=1", f"run.root={tmp_path}", "run.name=third",
                         "submit.dry_run=true")
    assert shown_run.returncode == 0, shown_run.stderr
    out = shown_run.stdout
    assert not any(ln.startswith(("touch", "id", "#'")) for ln in out.splitlines()), out
    (warned,) = [ln for ln in out.splitlines() if ln.startswith("warning: ignoring")]
    assert ESCAPED in warned and r"'node4\nid' (in third)" in warned
    # The script is the one the valid exclusions alone give: every #SBATCH line, and no
    # shell line besides the setup and the command.
    plan = make_plan(compose(["cluster=lab", "nodes=1", f"run.root={tmp_path}", "run.name=third"]))
    intended = sbatch_text(plan, SubmitInputs(exclude=("node2", "node3"), signal_lead_s=plan.config.fault.signal_lead_floor_s))
    assert "#SBATCH --exclude=node2,node3\n" in intended and out.rstrip("\n").endswith(intended.rstrip("\n")), out


def test_exclude_from_refuses_a_name_outside_the_grammar(tmp_path):
    listed = tmp_path / "bad_nodes.txt"
    listed.write_text("node2\nnod\u00e93  # an accented letter is no hostname\n")
    proc = run_main("dtk.submit", "cluster=lab", "nodes=1", f"cluster.exclude_from={listed}", "submit.dry_run=true",
                    f"run.root={tmp_path}")
    assert proc.returncode == 2 and proc.stderr == (
        f"error: cluster.exclude_from={listed}: 'nod\\xe93' is not a node name; one name per line\n")
    assert not (tmp_path / "audit").exists() and proc.stdout == ""


def test_a_lost_or_spare_node_name_from_slurm_is_checked_before_it_is_written(tmp_path, capsys):
    run = run_dir(tmp_path, "r")
    add_exclusions(run, ["node2", POISON], job_id="42", reason="node(s) left the job")
    assert [e["node"] for e in json.loads((run.path / "excluded_nodes.json").read_text())] == ["node2"]
    err = capsys.readouterr().err
    assert err.startswith("warning: left out invalid node name(s) from the nodes to exclude") and ESCAPED in err
    assert "\n" not in err.rstrip("\n")


def test_readmit_refuses_a_name_that_is_no_node_name(tmp_path):
    run = run_dir(tmp_path, "r")
    poison(run, POISON)
    for target in (run.path, tmp_path):
        proc = run_main("dtk.nodes", str(target), "--readmit", POISON)
        assert proc.returncode == 2 and proc.stderr.startswith(f"error: --readmit {ESCAPED}: not a node name"), proc
        assert proc.stderr.count("\n") == 1
    assert invalid_exclusions(run) == [POISON]


def test_dtk_nodes_shows_an_invalid_name_escaped_for_the_run_and_the_root(tmp_path, monkeypatch):
    # No Slurm asked (a node's state is not what this checks): a Slurm installed here whose
    # controller is down would be retried for 30 s.
    monkeypatch.setattr("dtk.nodes._slurm", lambda: None)
    for name in ("a", "b"):
        poison(run_dir(tmp_path, name), POISON, "node2")
    root = run_main("dtk.nodes", str(tmp_path))
    assert root.returncode == 0, root.stderr
    assert root.stdout.splitlines() == [
        f"1 suspect node(s) under {tmp_path} (excluded by 2 or more runs: left out of new submissions):",
        "  node2        excluded by 2 runs: a, b",
        "invalid node names (no node names: left out of every submission, never suspect):",
        f"  {ESCAPED}  in a, b"]
    one = run_main("dtk.nodes", str(tmp_path / "a"))
    assert one.returncode == 0 and one.stdout.splitlines()[0] == "1 node(s) excluded:"
    assert one.stdout.splitlines()[2:] == ["1 invalid node name(s), left out of every submission:",
                                           f"  {ESCAPED}  job 1  reason: left"]
    listed = json.loads(run_main("dtk.nodes", str(tmp_path), "--json").stdout)
    assert listed["invalid"] == [{"node": ESCAPED, "runs": ["a", "b"]}] and [e["node"] for e in listed["nodes"]] == ["node2"]


def test_dtk_watch_alerts_on_an_invalid_name_escaped_and_never_as_a_suspect(tmp_path):
    from dtk import watch

    for name in ("a", "b"):
        poison(run_dir(tmp_path, name), POISON)
    alerts = watch.detect(tmp_path, now=time.time(), job_state=lambda job: None)
    assert [(a.detector, a.details) for a in alerts] == [("invalid_node", {"node": ESCAPED, "runs": ["a", "b"]})]
    assert "\n" not in alerts[0].line() and ESCAPED in alerts[0].line()


def test_the_resubmission_leaves_invalid_names_out(tmp_path, capsys):
    from dtk.driver.resubmit import resubmit_inputs

    for name in ("a", "b"):
        poison(run_dir(tmp_path, name), POISON, "node2")
    plan = make_plan(compose(["cluster=lab", "nodes=1", f"run.root={tmp_path}", "run.name=c"]))
    run = RunDir(Path(plan.run_dir))
    run.path.mkdir()
    inputs = resubmit_inputs(run, plan, "41", exclude=["node3", "node5\nid"])
    assert inputs.exclude == ("node2", "node3") and inputs.after_job == "41"
    assert r"'node5\nid'" in capsys.readouterr().err
    assert "#SBATCH --exclude=node2,node3\n" in sbatch_text(plan, inputs)


def test_dtk_nodes_prints_what_the_file_says_of_a_valid_node_escaped(tmp_path, monkeypatch):
    monkeypatch.setattr("dtk.nodes._slurm", lambda: None)  # as above: the escaping is checked, not Slurm
    run = run_dir(tmp_path, "r")
    entry = {"node": "node2", "job_id": "1", "reason": "left\nforged line", "time": time.time()}
    (run.path / "excluded_nodes.json").write_text(json.dumps([entry]))
    shown_run = run_main("dtk.nodes", str(run.path))
    assert shown_run.returncode == 0 and "forged line" not in shown_run.stdout.splitlines()
    assert shown_run.stdout.splitlines()[1].endswith(r"reason: 'left\nforged line'")


def test_a_configured_flag_with_a_newline_is_one_error_line_and_nothing_written(tmp_path):
    proc = run_main("dtk.submit", "cluster=lab", "nodes=1", f"run.root={tmp_path / 'runs'}", "submit.dry_run=true",
                    "cluster.sbatch_extra=['--comment=a\ntouch /tmp/dtk-injected']")
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr == (
        r"error: sbatch --comment='a\ntouch /tmp/dtk-injected': a newline, carriage return or NUL cannot be part of"
        " a #SBATCH line; give the value on one line without control characters\n")
    assert not (tmp_path / "runs").exists()
