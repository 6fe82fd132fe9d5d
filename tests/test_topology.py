"""Discovery against recorded machines (tests/fixtures/topology), and the pure choices
made from the records: interface, RDMA ports, overrides, node order, axis groups."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dtk.topology import parse
from dtk.topology.choose import choose, pick_interface
from dtk.topology.discover import discover
from dtk.topology.layout import MESH_ORDER, axis_groups, order_nodes
from dtk.topology.records import NodeTopology
from dtk.topology.source import LiveSource, RecordedSource, RecordingSource

FIXTURES = Path(__file__).parent / "fixtures" / "topology"


def recorded(machine: str, node: str) -> NodeTopology:
    return discover(RecordedSource(FIXTURES / machine / node))


def job(machine: str) -> list[NodeTopology]:
    return [discover(RecordedSource(d)) for d in sorted((FIXTURES / machine).iterdir()) if d.is_dir()]


def test_infiniband_node_ports_states_and_interfaces():
    a01, a02 = recorded("ib", "gpu-a01"), recorded("ib", "gpu-a02")
    assert [(p.name, p.state, p.phys_state, p.rate_gbps) for p in a01.ib_ports] == [
        ("mlx5_0:1", "ACTIVE", "LinkUp", 200.0), ("mlx5_1:1", "ACTIVE", "LinkUp", 200.0),
        ("mlx5_2:1", "ACTIVE", "LinkUp", 200.0), ("mlx5_3:1", "DOWN", "Disabled", 10.0)]
    assert [p.name for p in a02.active_ports()] == ["mlx5_0:1", "mlx5_2:1", "mlx5_3:1"]  # mlx5_1 waits in INIT
    assert {p.link_layer for p in a01.ib_ports} == {"InfiniBand"} and a01.ib_ports[0].hca_type == "MT4123"
    assert [p.netdev for p in a01.ib_ports] == ["ib0", "ib1", "ib2", "ib3"]
    ib0 = a01.interface("ib0")
    assert (ib0.kind, ib0.speed_mbps, ib0.ipv4, ib0.driver, ib0.virtual) == ("ipoib", 200000, ("10.10.0.11/16",),
                                                                            "mlx5_core", False)
    assert a01.interface("eno2").operstate == "down" and a01.interface("eno2").speed_mbps is None
    assert a01.num_cpus == 64 and a01.numa_nodes == {0: "0-31", 1: "32-63"}
    assert a01.nvlink_domains() == [(0, 1, 2, 3)] and a01.gpu_nics == {0: "mlx5_0", 1: "mlx5_1", 2: "mlx5_2", 3: "mlx5_3"}
    assert a01.slurm.node_name == "gpu-a01" and a01.slurm.job_nodes == ("gpu-a01", "gpu-a02")


def test_roce_node_gid_index_and_netdevs():
    c01 = recorded("roce", "gpu-c01")
    assert [(p.name, p.link_layer, p.kind, p.netdev, p.roce_v2_gid_index) for p in c01.ib_ports] == [
        ("mlx5_0:1", "Ethernet", "roce", "ens2f0np0", 3), ("mlx5_1:1", "Ethernet", "roce", "ens2f1np1", 3)]
    assert c01.interface("ens2f0np0").speed_mbps == 100000 and c01.interface("ens2f0np0").mtu == 9000


def test_ethernet_node_has_no_rdma_and_pcie_gpus():
    b01 = recorded("ethernet", "gpu-b01")
    assert b01.ib_ports == () and len(b01.gpus) == 4
    assert b01.nvlink_domains() == [(0,), (1,), (2,), (3,)]  # L40S: PCIe only
    assert b01.interface("docker0").virtual and b01.interface("ens1f0").driver == "ice"


def test_dgx_node_nvlink_ib_storage_roce_and_switches():
    dgx = recorded("dgx", "dgx-001")
    assert len(dgx.gpus) == 8 and dgx.gpus[7].numa_node == 1
    assert dgx.nvlink_domains() == [tuple(range(8))]
    kinds = [(p.device, p.kind) for p in dgx.active_ports()]
    assert kinds[:8] == [(f"mlx5_{k}", "ib") for k in range(8)] and kinds[8:] == [("mlx5_8", "roce"), ("mlx5_9", "roce")]
    assert [s.name for s in dgx.slurm.switches] == ["ib-leaf-01", "ib-leaf-02", "ib-spine-01"]
    assert dgx.slurm.switches[0].nodes == ("dgx-001", "dgx-002", "dgx-005", "dgx-006")


def test_live_discovery_and_its_recording_replay_identically(tmp_path):
    live = discover(LiveSource())
    assert live.num_cpus == len(os.sched_getaffinity(0)) or live.num_cpus >= 1
    assert any(i.kind == "loopback" for i in live.interfaces)
    recorded_live = discover(RecordingSource(LiveSource(), tmp_path / "here"))
    assert discover(RecordedSource(tmp_path / "here")) == recorded_live
    assert NodeTopology.from_dict(recorded_live.to_dict()) == recorded_live


def test_record_round_trips_through_json():
    for node in job("dgx") + job("roce"):
        assert NodeTopology.from_dict(node.to_dict()) == node


def test_recorded_source_refuses_a_missing_machine(tmp_path):
    with pytest.raises(FileNotFoundError, match="no recorded machine"):
        RecordedSource(tmp_path / "nope")


def test_parsers():
    assert parse.hostlist("dgx-[001-003,007],login1") == ["dgx-001", "dgx-002", "dgx-003", "dgx-007", "login1"]
    assert parse.hostlist("node[1-2]-ib") == ["node1-ib", "node2-ib"]
    assert parse.cpulist("0-2,8") == [0, 1, 2, 8]
    assert parse.ib_rate_gbps("2.5 Gb/sec (1X SDR)") == 2.5 and parse.ib_rate_gbps("garbage") == 0.0
    assert parse.ib_state("4: ACTIVE") == "ACTIVE"
    # What scontrol prints without a topology plugin is no switch at all.
    assert parse.switches("scontrol: error: No topology information available\n") == []


def test_cluster_env_then_environment_then_detected():
    nodes = job("ib")
    choice = choose(nodes, backend="nccl", cluster_env={"NCCL_SOCKET_IFNAME": "eno1", "NCCL_DEBUG": "WARN"},
                    environ={"GLOO_SOCKET_IFNAME": "eno1", "NCCL_IB_HCA": "mlx5"})
    assert choice.setting("NCCL_SOCKET_IFNAME").source == "cluster.env"
    assert choice.setting("NCCL_DEBUG").value == "WARN"
    gloo = choice.setting("GLOO_SOCKET_IFNAME")
    assert (gloo.value, gloo.source) == ("eno1", "environment")
    assert choice.setting("NCCL_IB_HCA", "gpu-a01").source == "environment"
    env = choice.env_for("gpu-a01")
    assert "GLOO_SOCKET_IFNAME" not in env and "NCCL_IB_HCA" not in env  # already there
    assert env["NCCL_SOCKET_IFNAME"] == "eno1"
    # The rendezvous follows a hand-chosen gloo interface... unless MASTER_ADDR is set too.
    assert choice.interface == "eno1"


def test_mixed_fabric_job_disables_ib_everywhere():
    nodes = [recorded("ib", "gpu-a01"), recorded("ethernet", "gpu-b02")]
    choice = choose(nodes, backend="nccl")
    assert choice.transport == "socket"
    assert choice.setting("NCCL_IB_DISABLE").value == "1"
    assert "gpu-b02" in choice.setting("NCCL_IB_DISABLE").why
    # Both have an eno1, in different subnets: still the only way between them, said so.
    assert choice.interface == "eno1" and "different subnets" in choice.setting("GLOO_SOCKET_IFNAME").why


def test_never_loopback_across_nodes_but_one_machine_may_share_addresses():
    vm = recorded("vm", "vm")
    # The lab without network namespaces: several nodes on one host, one stack.
    lab = [NodeTopology.from_dict(vm.to_dict() | {"node": f"node{k}"}) for k in (1, 2)]
    name, why = pick_interface(lab)
    assert name == "eth0", why
    assert pick_interface([vm])[0] == "lo"
    docker = job("ethernet")
    assert pick_interface(docker)[0] == "ens1f0"
    assert "docker0 (172.17.0.1 on both gpu-b01 and gpu-b02)" in pick_interface(docker)[1]


def test_no_shared_interface_leaves_the_choice_to_nccl_and_gloo():
    a01 = recorded("ib", "gpu-a01")
    other = NodeTopology.from_dict(recorded("roce", "gpu-c02").to_dict() | {"interfaces": []})
    choice = choose([a01, other], backend="nccl")
    assert choice.interface is None and choice.master_addr == "gpu-a01"
    assert choice.setting("GLOO_SOCKET_IFNAME") is None
    assert "no interface with an IPv4 address is shared by every node" in pick_interface([a01, other])[1]


def test_gloo_job_sets_no_nccl_variables():
    choice = choose(job("ethernet"), backend="gloo")
    assert not [s for s in choice.settings if s.key.startswith("NCCL_")]
    assert choice.env_for("gpu-b01") == {"GLOO_SOCKET_IFNAME": "ens1f0", "MASTER_ADDR": "10.20.0.11"}


def test_nodes_under_one_switch_are_kept_together():
    switches = parse.switches((FIXTURES / "dgx" / "dgx-001" / "cmd" / "scontrol_show_topology.txt").read_text())
    order, why = order_nodes([f"dgx-{k:03d}" for k in (1, 3, 5, 7)], switches)
    assert order == ["dgx-001", "dgx-005", "dgx-003", "dgx-007"]
    assert "ib-leaf-01: dgx-001 dgx-005" in why
    assert order_nodes(["b", "a"], [])[0] == ["b", "a"]


def test_axis_groups_match_the_device_mesh_grid():
    torch = pytest.importorskip("torch")
    from dtk.plan.degrees import Axis

    assert MESH_ORDER == tuple(a.value for a in Axis)  # the grid dtk.mesh.mesh builds
    degrees = {"dp_replicate": 2, "pp": 3, "dp_shard": 2, "cp": 2, "tp": 2}
    grid = torch.arange(48).view(*(degrees[a] for a in MESH_ORDER))
    for k, axis in enumerate(MESH_ORDER):
        expected = sorted(tuple(g.tolist()) for g in grid.movedim(k, -1).reshape(-1, degrees[axis]))
        assert sorted(axis_groups(degrees, axis)) == expected


def test_command_line_show_record_choose(tmp_path):
    from conftest import run_main

    shown = run_main("dtk.topology", "show")
    assert shown.returncode == 0 and "interface   lo" in shown.stdout and "MASTER_ADDR=" in shown.stdout
    assert run_main("dtk.topology", "record", str(tmp_path / "me")).returncode == 0
    assert (tmp_path / "me" / "fs" / "sys" / "class" / "net").is_dir()
    chosen = run_main("dtk.topology", "choose", *(str(FIXTURES / "ib" / n) for n in ("gpu-a01", "gpu-a02")))
    assert chosen.returncode == 0, chosen.stderr
    assert "gpu-a02: NCCL_IB_HCA==mlx5_0:1,mlx5_2:1,mlx5_3:1" in chosen.stdout
    missing = run_main("dtk.topology", "choose", str(tmp_path / "nothing"))
    assert missing.returncode == 2 and missing.stderr.startswith("error: no recorded machine at")


def test_topology_imports_no_torch():
    from conftest import dtk

    proc = dtk("-c", "import sys, dtk.topology, dtk.topology.nccl; assert 'torch' not in sys.modules")
    assert proc.returncode == 0, proc.stderr
