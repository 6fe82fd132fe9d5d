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


def setup_file_environment() -> dict[str, str]:
    """The variables the batch script's setup lines from slurm_templates/setup/nccl.sh (the
    default cluster=slurm setup) leave for the workers, as bash sets them."""
    import subprocess

    from dtk.launch.sbatch import setup_lines

    script = "\n".join(setup_lines(["nccl"])) + "\nenv -0"
    out = subprocess.run(["env", "-i", "bash", "-c", script], capture_output=True, text=True, check=True).stdout
    return dict(item.split("=", 1) for item in out.split("\0") if "=" in item)


def test_the_default_setup_file_leaves_the_report_on_and_sockets_beside_infiniband_are_stopped(tmp_path):
    from dtk.topology.start import decide

    environ = setup_file_environment()
    assert environ["NCCL_DEBUG"] == "WARN"  # what the setup file asks for
    nodes = ib_nodes()
    fabric = decide(nodes, node_rank=1, rank=5, backend="nccl", degrees={"dp_replicate": 2, "pp": 1, "dp_shard": 4, "tp": 1}, tasks_per_node=4,
                    cluster_env={}, environ=environ, report_dir=tmp_path)
    assert fabric.nccl_log == tmp_path / "gpu-a02.rank5.log"
    assert fabric.env["NCCL_DEBUG"] == "INFO" and fabric.env["NCCL_DEBUG_SUBSYS"] == "INIT,NET"
    # NCCL writes its report where it was told; this is the one captured on gpu-a02.
    fabric.nccl_log.write_text((FIXTURES / "nccl" / "socket_gpu-a02.log").read_text())
    found = reports(**{"gpu-a01": "ib_gpu-a01.log"}) | {"gpu-a02": parse_log(fabric.nccl_log.read_text())}
    result = check(nodes, found, choice=fabric.choice, require="auto", backend="nccl")
    assert result.verified
    (problem,) = result.problems
    assert problem.startswith("node gpu-a02 has InfiniBand") and "NCCL chose TCP sockets (NET/Socket)" in problem


def test_one_node_needs_no_network():
    (a01,) = ib_nodes()[:1]
    eth = discover(RecordedSource(FIXTURES / "topology" / "ethernet" / "gpu-b01"))  # no RDMA port at all
    for node, log in ((a01, "ib_gpu-a01.log"), (eth, None)):
        found = reports(**{node.node: log}) if log else {}
        for require in ("ib", "auto"):
            result = check([node], found, choice=choose([node], backend="nccl"), require=require, backend="nccl")
            assert result.problems == () and result.verified, (node.node, require)
            assert result.note.startswith("one node")


def test_nccl_warnings_are_repeated_from_the_report():
    from dtk.topology.nccl import warn_lines

    text = ("\ngpu-a02:18211:18270 [0] transport/net_ib.cc:312 NCCL WARN NET/IB : Got async event : port error\n"
            "gpu-a02:18211:18270 [0] NCCL INFO Using network Socket\n")
    assert warn_lines(text) == ["gpu-a02:18211:18270 [0] transport/net_ib.cc:312 NCCL WARN NET/IB : Got async event"
                                " : port error"]
