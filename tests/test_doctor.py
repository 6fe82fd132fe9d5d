"""python -m dtk.doctor: the slow-node verdict (pure), the list dtk.submit reads back, the
sbatch script of its job, and a real run on this machine's ranks (slow tier)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import dtk
from dtk.config.compose import compose
from dtk.doctor.__main__ import request, sbatch_script
from dtk.doctor.report import analyze, exclude_text, render, slow_links
from dtk.launch.launch import read_exclude_file


def results(p2p: dict[str, float], flops: dict[str, list[float]]) -> dict:
    names = list(flops)
    return {"nodes": [{"node": n, "num_cpus": 2, "gpus": [], "ib_ports": [], "interfaces": []} for n in names],
            "p2p_gbs": p2p, "matmul_tflops": flops, "fabric": ["transport   socket"], "backend": "gloo",
            "device": "cpu", "tasks_per_node": 1,
            "groups": [{"group": "world", "ranks": len(names),
                        "rows": [{"size_mb": 1.0, "time_ms": 2.0, "algbw_gbs": 0.5, "busbw_gbs": 0.5}]}]}


def test_a_node_with_a_slow_link_either_way_is_flagged_and_the_others_are_not():
    flops = {"a": [0.1], "b": [0.11], "c": [0.1]}
    out = {"a->b": 1.0, "a->c": 1.1, "b->a": 1.0, "b->c": 0.9, "c->a": 0.2, "c->b": 0.25}
    flagged = analyze(results(out, flops), slow_factor=1.5)
    assert [f["node"] for f in flagged] == ["c"]
    assert flagged[0]["why"] == "sending 0.25 GB/s is 4.0x below the median 1 (doctor.slow_factor=1.5)"
    into = {"a->b": 1.0, "a->c": 0.2, "b->a": 1.0, "b->c": 0.2, "c->a": 1.0, "c->b": 1.0}
    assert [f["node"] for f in analyze(results(into, flops), slow_factor=1.5)] == ["c"]
    # within the factor: nobody
    assert analyze(results({**out, "c->a": 0.8, "c->b": 0.8}, flops), slow_factor=1.5) == []


def test_a_node_limited_in_what_it_sends_is_flagged_on_three_nodes_at_the_docs_factor():
    """The figures of a 3-node lab with node2 limited to 20 mbit on its way out (tc on its
    egress): its sends are ~450x slower than the others', what it receives is not. Pooled
    with its receiving, that was "1.8x below the median" and nothing at slow_factor=4;
    judged per direction it is the sending figure, and only node2 is flagged."""
    flops = {"node1": [0.1], "node2": [0.1], "node3": [0.1]}
    p2p = {"node1->node2": 1.12, "node1->node3": 1.08, "node2->node1": 0.00239, "node2->node3": 0.00251,
           "node3->node1": 1.15, "node3->node2": 1.1}
    flagged = analyze(results(p2p, flops), slow_factor=4)
    assert [f["node"] for f in flagged] == ["node2"]
    assert flagged[0]["why"] == "sending 0.00251 GB/s is 446.2x below the median 1.12 (doctor.slow_factor=4)"
    assert slow_links(results(p2p, flops), slow_factor=4, flagged=flagged) == []  # explained by node2's egress


def test_four_nodes_a_slow_receiver_is_flagged_and_a_slow_link_is_listed_not_blamed():
    flops = {n: [0.1] for n in "abcd"}
    fast = {f"{x}->{y}": 1.0 for x in "abcd" for y in "abcd" if x != y}
    into_d = {**fast, "a->d": 0.1, "b->d": 0.12, "c->d": 0.09}  # d's ingress is slow
    flagged = analyze(results(into_d, flops), slow_factor=4)
    assert [(f["node"], f["why"].split()[0]) for f in flagged] == [("d", "receiving")]
    assert slow_links(results(into_d, flops), slow_factor=4, flagged=flagged) == []
    one_link = {**fast, "b->c": 0.05}  # one bad link: neither b's sending nor c's receiving is slow
    flagged = analyze(results(one_link, flops), slow_factor=4)
    assert flagged == []
    assert slow_links(results(one_link, flops), slow_factor=4, flagged=flagged) == [
        "b->c 0.05 GB/s is 20.0x below the median link 1 (doctor.slow_factor=4)"]
    report = render(results(one_link, flops) | {"flagged": [], "slow_links": ["b->c 0.05 GB/s is 20.0x"]},
                    out=Path("/nonexistent"))
    assert "## Slow links (neither end slow in that direction)\n\n- b->c 0.05 GB/s is 20.0x" in report


def test_two_nodes_a_far_slower_one_is_flagged_and_a_slow_device_too():
    flagged = analyze(results({"a->b": 1.0, "b->a": 0.2}, {"a": [0.1], "b": [0.1]}), slow_factor=1.5)
    assert [f["node"] for f in flagged] == ["b"] and "sending" in flagged[0]["why"]
    flagged = analyze(results({"a->b": 1.0, "b->a": 1.0}, {"a": [0.1, 0.1], "b": [0.02, 0.1]}), slow_factor=1.5)
    assert flagged == []  # the median of b's devices is 0.06: 1.3x below the median 0.08, within 1.5
    flagged = analyze(results({"a->b": 1.0, "b->a": 1.0}, {"a": [0.1], "b": [0.02]}), slow_factor=1.5)
    assert [f["node"] for f in flagged] == ["b"] and flagged[0]["why"].startswith("matmul")
    assert analyze(results({}, {"a": [0.1]}), slow_factor=1.5) == []  # one node: no median to compare with


def test_the_exclude_list_reads_back_as_the_flagged_nodes(tmp_path):
    p2p = {"node1->node2": 1.0, "node2->node1": 0.1}
    flagged = analyze(results(p2p, {"node1": [1.0], "node2": [1.0]}), slow_factor=1.5)
    listed = tmp_path / "exclude.txt"
    listed.write_text(exclude_text(flagged))
    assert read_exclude_file(str(listed)) == ("node2",)
    report = render(results(p2p, {"node1": [1.0], "node2": [1.0]}) | {"flagged": flagged}, out=tmp_path)
    assert "**node2**" in report and f"cluster.exclude_from={listed}" in report
    assert "| node2 | 0.100 | - |" in report and "| 1 | 2.000 | 0.500 | 0.500 |" in report


def test_request_sizes_and_the_sbatch_script(tmp_path):
    cfg = compose(["cluster=lab", "nodes=3", "doctor.max_mb_cpu=16"])
    req = request(cfg, gpus=False)
    assert req["sizes_mb"] == [1.0, 4.0, 16.0] and req["p2p_mb"] == 16.0
    assert request(compose([]), gpus=True)["sizes_mb"] == [1, 4, 16, 64, 256, 1024]  # 1 MB - 1 GB
    script = sbatch_script(cfg, out=tmp_path, nodes=3, tasks=1, exclude=("node2",))
    assert "#SBATCH --nodes=3" in script and "#SBATCH --exclude=node2" in script
    assert script.rstrip().endswith(f"-m dtk.doctor.worker {tmp_path}")


def test_bad_doctor_settings_are_one_error_line(tmp_path):
    proc = dtk("dtk.doctor", "doctor.min_mb=128", f"run.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("error: doctor.min_mb=128: must be > 0 and <= ")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.dist
def test_doctor_on_this_machine_writes_its_report(tmp_path):
    proc = dtk("dtk.doctor", "doctor.max_mb_cpu=4", "doctor.repeats=2", "doctor.matmul_n=128", f"run.root={tmp_path}",
               cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (out,) = tmp_path.glob("doctor-*")
    found = json.loads((out / "doctor.json").read_text())
    groups = {g["group"]: g for g in found["groups"]}
    assert set(groups) == {"world"}  # one node: the world is the group inside it
    rows = groups["world"]["rows"]
    assert [r["size_mb"] for r in rows] == [1.0, 4.0]
    for r in rows:  # the nccl-tests definitions
        assert r["algbw_gbs"] == pytest.approx(r["size_mb"] * 1e6 / (r["time_ms"] / 1e3) / 1e9)
        assert r["busbw_gbs"] == pytest.approx(r["algbw_gbs"] * 2 * (2 - 1) / 2)
    assert len(next(iter(found["matmul_tflops"].values()))) == 2 and found["flagged"] == []
    assert "## All-reduce per process group" in (out / "report.md").read_text()
    assert read_exclude_file(str(out / "exclude.txt")) == ()
    assert Path(out / "topology" / "node_00.json").is_file()
    # the planner's step time reads the links it measured (plan.doctor=FOLDER)
    from dtk.plan.cost.steptime import doctor_links

    assert doctor_links(str(out)) == (rows[-1]["busbw_gbs"], None)


@pytest.mark.slow
@pytest.mark.slurm
def test_doctor_on_the_lab_measures_every_pair_of_nodes(lab, tmp_path):
    proc = dtk("dtk.doctor", "cluster=lab", "nodes=3", "tasks_per_node=1", "doctor.max_mb_cpu=4", "doctor.repeats=2",
               "doctor.matmul_n=128", f"run.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (out,) = tmp_path.glob("doctor-*")
    found = json.loads((out / "doctor.json").read_text())
    names = [n["node"] for n in found["nodes"]]
    assert sorted(names) == ["node1", "node2", "node3"]
    assert sorted(found["p2p_gbs"]) == sorted(f"{a}->{b}" for a in names for b in names if a != b)
    assert {g["group"] for g in found["groups"]} == {"world", "across nodes (first rank of each)"}
    assert all(bw > 0 for bw in found["p2p_gbs"].values())
    # whatever it flagged (a shared 2-core machine is noisy) is what exclude.txt lists
    assert read_exclude_file(str(out / "exclude.txt")) == tuple(f["node"] for f in found["flagged"])


def test_a_timed_batch_fills_about_25_ms_and_never_less_than_one():
    from dtk.doctor.measure import BATCH_S, MAX_BATCH, batch_size

    assert batch_size(0.002) == 13  # a 1 MB gloo all-reduce: 13 back to back spread the barrier's skew
    assert batch_size(BATCH_S) == 1 and batch_size(3.0) == 1
    assert batch_size(0.0) == MAX_BATCH and batch_size(1e-5) == MAX_BATCH
