"""The fabric at start, as the worker runs it: records published and gathered through the
run directory, the environment chosen and set before the process group, and the transport
check after it on real gloo ranks, fed NCCL's recorded report of real machines.

With InfiniBand present (recorded) and NCCL reporting a socket transport (recorded log
lines), every rank stops with the same `error:` naming the node and fabric.require.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dtk.topology.discover import discover
from dtk.topology.source import RecordedSource
from dtk.topology.start import decide, gather, node_file, publish
from multirank import run_on_ranks

FIXTURES = Path(__file__).parent / "fixtures"
DEGREES = {"dp_replicate": 2, "pp": 1, "dp_shard": 1, "tp": 1}


def ib_nodes():
    return [discover(RecordedSource(FIXTURES / "topology" / "ib" / n)) for n in ("gpu-a01", "gpu-a02")]


def test_records_meet_in_the_run_directory_in_node_rank_order(tmp_path):
    a01, a02 = ib_nodes()
    publish(tmp_path, 1, a02)
    with pytest.raises(RuntimeError, match=r"node\(s\) 0 of this start published no topology record"):
        gather(tmp_path, 2, timeout_s=0.0)
    publish(tmp_path, 0, a01)
    assert [n.node for n in gather(tmp_path, 2, timeout_s=0.0)] == ["gpu-a01", "gpu-a02"]
    assert json.loads(node_file(tmp_path, 1).read_text())["node"] == "gpu-a02"


def test_each_rank_sets_its_nodes_ports_and_the_nccl_report_file(tmp_path):
    nodes = ib_nodes()
    fabric = decide(nodes, node_rank=1, rank=9, backend="nccl", degrees=DEGREES, tasks_per_node=8,
                    cluster_env={}, environ={}, report_dir=tmp_path)
    assert fabric.node == "gpu-a02"
    assert fabric.env["NCCL_IB_HCA"] == "=mlx5_0:1,mlx5_2:1,mlx5_3:1"  # a02's active ports, not a01's
    assert fabric.env["GLOO_SOCKET_IFNAME"] == "ib0" and fabric.env["MASTER_ADDR"] == "10.10.0.11"
    assert fabric.nccl_log == tmp_path / "gpu-a02.rank9.log"
    assert fabric.env["NCCL_DEBUG"] == "INFO" and fabric.env["NCCL_DEBUG_FILE"] == str(fabric.nccl_log)
    doc = json.loads(json.dumps(fabric.document()))
    assert [n["node"] for n in doc["nodes"]] == ["gpu-a01", "gpu-a02"]
    assert doc["rank_nodes"] == doc["layout"]["rank_nodes"] == ["gpu-a01"] * 8 + ["gpu-a02"] * 8
    assert doc["env"]["gpu-a01"]["NCCL_IB_HCA"] == "=mlx5_0:1,mlx5_1:1,mlx5_2:1"
    assert any("NCCL_IB_HCA" in line and "detected" in line for line in doc["describe"])


def test_cluster_env_and_a_hand_set_debug_file_win(tmp_path):
    fabric = decide(ib_nodes(), node_rank=0, rank=0, backend="nccl", degrees=DEGREES, tasks_per_node=8,
                    cluster_env={"NCCL_SOCKET_IFNAME": "=eth0", "NCCL_IB_HCA": "=mlx5_1"},
                    environ={"NCCL_DEBUG": "INFO"}, report_dir=tmp_path)
    assert fabric.env["NCCL_SOCKET_IFNAME"] == "=eth0" and fabric.env["NCCL_IB_HCA"] == "=mlx5_1"
    assert fabric.choice.setting("NCCL_IB_HCA", "gpu-a01").source == "cluster.env"
    assert fabric.nccl_log is None and "NCCL_DEBUG_FILE" not in fabric.env  # the user's NCCL_DEBUG=INFO stands
    own_file = decide(ib_nodes(), node_rank=0, rank=0, backend="nccl", degrees=DEGREES, tasks_per_node=8,
                      cluster_env={"NCCL_DEBUG_FILE": "/tmp/nccl.%h.%p"}, environ={}, report_dir=tmp_path)
    assert own_file.nccl_log is None and "NCCL_DEBUG" not in own_file.env
    gloo = decide(ib_nodes(), node_rank=0, rank=0, backend="gloo", degrees=DEGREES, tasks_per_node=1,
                  cluster_env={}, environ={}, report_dir=tmp_path)
    assert "NCCL_IB_HCA" not in gloo.env and gloo.nccl_log is None and gloo.env["GLOO_SOCKET_IFNAME"] == "ib0"


def _check_on_ranks(rank: int, world: int, logs: dict, plan, run_dir: Path):
    """What the worker runs right after its process group starts (dtk.worker.fabric)."""
    import dataclasses

    import torch

    from dtk.common.errors import UserError
    from dtk.common.rundir import RunDir
    from dtk.worker.env import WorkerEnv
    from dtk.worker.fabric import after_process_group

    env = WorkerEnv("dtk", rank, 0, world, 1, rank, "127.0.0.1", 0)
    run = RunDir(run_dir)
    fabric = decide(ib_nodes(), node_rank=rank, rank=rank, backend="nccl", degrees=DEGREES, tasks_per_node=1,
                    cluster_env={}, environ={}, report_dir=run_dir)
    if rank == 0:
        (run_dir / "topology.json").write_text(json.dumps(fabric.document()))
    fabric = dataclasses.replace(fabric, nccl_log=logs.get(fabric.node))
    try:
        after_process_group(fabric, plan, env, run, device=torch.device("cpu"))
    except UserError as exc:
        return str(exc)
    return None


def _plan(require: str):
    from dtk.config.compose import compose
    from dtk.plan.plan import make_plan

    return make_plan(compose([f"fabric.require={require}"]))


def _logs(tmp_path: Path, **files: str) -> dict:
    out = {}
    for node, name in files.items():
        out[node] = tmp_path / f"{node}.log"
        shutil.copy(FIXTURES / "nccl" / name, out[node])
    return out


@pytest.mark.dist
def test_ib_present_and_nccl_on_sockets_stops_every_rank_naming_the_fix(tmp_path):
    socket = _logs(tmp_path, **{"gpu-a01": "ib_gpu-a01.log", "gpu-a02": "socket_gpu-a02.log"})
    errors = run_on_ranks(_check_on_ranks, 2, tmp_path, socket, _plan("auto"), tmp_path)
    assert errors[0] == errors[1] and errors[0] is not None  # every rank stops, with the same line
    assert errors[0].startswith("node gpu-a02 has InfiniBand") and "NET/Socket" in errors[0]
    assert "fabric.require=any" in errors[0] and "libibverbs" in errors[0]
    check = json.loads((tmp_path / "topology.json").read_text())["transport_check"]
    assert check["per_node"]["gpu-a02"][0]["network"] == "Socket" and check["problems"] == [errors[0]]
    (tmp_path / "any").mkdir()
    assert run_on_ranks(_check_on_ranks, 2, tmp_path / "any", socket, _plan("any"), tmp_path / "any") == [None, None]
    ib = _logs(tmp_path / "any", **{"gpu-a01": "ib_gpu-a01.log", "gpu-a02": "ib_gpu-a01.log"})
    (tmp_path / "ib").mkdir()
    assert run_on_ranks(_check_on_ranks, 2, tmp_path / "ib", ib, _plan("auto"), tmp_path / "ib") == [None, None]
    check = json.loads((tmp_path / "ib" / "topology.json").read_text())["transport_check"]
    assert check["verified"] and check["per_node"]["gpu-a01"][0]["network"] == "IB"
