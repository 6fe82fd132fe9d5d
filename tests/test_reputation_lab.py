"""Node reputation on the lab: two runs of a run root excluded node3 (their exclusion
records written by the driver's own writer, dtk.driver.exclusions, as after a node failure
each), so a third submission there leaves it out (the job's ExcNodeList on the real
Slurm, and one line at submit); after `python -m dtk.nodes RUN_ROOT --readmit node3` the
next one does not. The rule's unit tests are tests/test_reputation.py."""

from __future__ import annotations

import subprocess

import pytest

from conftest import dtk
from dtk.common.rundir import RunDir
from dtk.driver.exclusions import add_exclusions

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def submit(root, name: str) -> tuple[str, str]:
    proc = dtk("dtk.submit", "cluster=lab", "nodes=1", "tasks_per_node=1", "train.steps=5", f"run.name={name}",
               f"run.root={root}", cwd=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = proc.stdout.split("submitted job ", 1)[1].split()[0]
    try:
        info = subprocess.run(["scontrol", "show", "job", job, "-o"], capture_output=True, text=True).stdout
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    return proc.stdout, info


def test_a_node_two_runs_excluded_stays_out_of_new_submissions_until_readmitted(lab, tmp_path):
    for name, job in (("first", "101"), ("second", "102")):
        run = RunDir(tmp_path / name)
        run.path.mkdir()
        run.event("started", restart=0, job_id=job, nodes=["node2", "node3"])
        add_exclusions(run, ["node3"], job_id=job, reason="node(s) node3 left the job")
    said, info = submit(tmp_path, "third")
    assert "leaving out 1 suspect node(s)" in said and "node3 (excluded by first, second)" in said, said
    assert "ExcNodeList=node3" in info, info

    back = dtk("dtk.nodes", str(tmp_path), "--readmit", "node3")
    assert back.returncode == 0 and back.stdout.startswith(f"node3 re-admitted to {tmp_path}"), back.stderr
    said, info = submit(tmp_path, "fourth")
    assert "suspect" not in said and "ExcNodeList=(null)" in info, info
