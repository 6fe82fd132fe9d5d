"""NCCL's report (recorded debug output of real formats, tests/fixtures/nccl) read and
checked against recorded InfiniBand discovery."""

from __future__ import annotations

from pathlib import Path

from dtk.topology.choose import choose
from dtk.topology.discover import discover
from dtk.topology.nccl import check, network_kind, parse_log
from dtk.topology.source import RecordedSource

FIXTURES = Path(__file__).parent / "fixtures"


def ib_nodes():
    return [discover(RecordedSource(FIXTURES / "topology" / "ib" / n)) for n in ("gpu-a01", "gpu-a02")]


def reports(**files):
    return {node: parse_log((FIXTURES / "nccl" / name).read_text()) for node, name in files.items()}


def test_parse_reads_each_communicator_and_its_network():
    (ok,) = parse_log((FIXTURES / "nccl" / "ib_gpu-a01.log").read_text())
    assert (ok.host, ok.pid, ok.network) == ("gpu-a01", 20417, "IB")
    world, split = ok.communicators
    assert (world.comm, world.num_ranks, world.num_nodes, world.network) == ("0x5605a1c3e9b0", 8, 2, "IB")
    assert (split.num_ranks, split.num_nodes, split.network) == (4, 1, None)  # inside the node: no network
    (bad,) = parse_log((FIXTURES / "nccl" / "socket_gpu-a02.log").read_text())
    assert bad.network == "Socket" and bad.communicators[0].network == "Socket"
    assert bad.clues == ("Failed to open libibverbs.so[.1]",)
    assert [network_kind(n) for n in ("IB", "IBext_v8", "Socket", "AWS Libfabric", None)] == [
        "ib", "ib", "socket", "other", "unknown"]


def test_ib_chosen_everywhere_passes():
    nodes = ib_nodes()
    choice = choose(nodes, backend="nccl")
    both = reports(**{"gpu-a01": "ib_gpu-a01.log", "gpu-a02": "ib_gpu-a01.log"})
    result = check(nodes, both, choice=choice, require="auto", backend="nccl")
    assert result.problems == () and result.verified


def test_sockets_with_infiniband_present_name_the_node_and_the_fix():
    nodes = ib_nodes()
    choice = choose(nodes, backend="nccl")
    result = check(nodes, reports(**{"gpu-a01": "ib_gpu-a01.log", "gpu-a02": "socket_gpu-a02.log"}),
                   choice=choice, require="auto", backend="nccl")
    (problem,) = result.problems
    assert problem.startswith("node gpu-a02 has InfiniBand (mlx5_0:1 200 Gb/s, mlx5_2:1 200 Gb/s, mlx5_3:1 200 Gb/s)")
    assert "NCCL chose TCP sockets (NET/Socket) for communicator 0x55f4c2a1b6e0 (8 ranks on 2 nodes)" in problem
    assert "libibverbs" in problem and "NCCL_IB_HCA==mlx5_0:1,mlx5_2:1,mlx5_3:1" in problem
    assert "fabric.require=any" in problem and problem.isascii()


def test_a_hand_set_ib_disable_is_named_as_the_fix():
    nodes = ib_nodes()
    choice = choose(nodes, backend="nccl", cluster_env={"NCCL_IB_DISABLE": "1"})
    result = check(nodes, reports(**{"gpu-a02": "socket_gpu-a02.log"}), choice=choice, require="ib", backend="nccl")
    assert "NCCL_IB_DISABLE=1 comes from cluster.env: remove it" in result.problems[0]


def test_require_any_records_but_never_stops():
    nodes = ib_nodes()
    result = check(nodes, reports(**{"gpu-a02": "socket_gpu-a02.log"}), choice=choose(nodes, backend="nccl"),
                   require="any", backend="nccl")
    assert result.problems == () and result.per_node["gpu-a02"][0]["network"] == "Socket"


def test_require_ib_without_ib_or_without_nccl_or_without_a_report():
    eth = [discover(RecordedSource(FIXTURES / "topology" / "ethernet" / n)) for n in ("gpu-b01", "gpu-b02")]
    result = check(eth, {}, choice=choose(eth, backend="nccl"), require="ib", backend="nccl")
    assert "node gpu-b01 has no active InfiniBand or RoCE port" in result.problems[0]
    nodes = ib_nodes()
    result = check(nodes, {}, choice=choose(nodes, backend="gloo"), require="ib", backend="gloo")
    assert "runs gloo, which only speaks TCP" in result.problems[0]
    result = check(nodes, {}, choice=choose(nodes, backend="nccl"), require="ib", backend="nccl")
    assert "could not be read on every node" in result.problems[0]
    # auto: an unread report is recorded as unverified, not an error
    result = check(nodes, {}, choice=choose(nodes, backend="nccl"), require="auto", backend="nccl")
    assert result.problems == () and not result.verified
