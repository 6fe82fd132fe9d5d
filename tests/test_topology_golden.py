"""Recorded machines in, chosen environment and group layout out, against golden files
(tests/golden/topology/<machine>.json): an InfiniBand node with ports down, an
Ethernet-only node, a RoCE node, a DGX-like NVLink node, and this VM (recorded live).

Regenerate after an intended change with
`DTK_UPDATE_GOLDEN=1 python -m pytest tests/test_topology_golden.py`, and read the diff.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dtk.topology.choose import choose
from dtk.topology.discover import discover
from dtk.topology.layout import plan_layout
from dtk.topology.source import RecordedSource

FIXTURES = Path(__file__).parent / "fixtures" / "topology"
GOLDEN = Path(__file__).parent / "golden" / "topology"
MACHINES = ("ib", "ethernet", "roce", "dgx", "vm")


def outcome(machine: str) -> dict:
    nodes = [discover(RecordedSource(d)) for d in sorted((FIXTURES / machine).iterdir()) if d.is_dir()]
    tasks = len(nodes[0].gpus) or 2
    world = tasks * len(nodes)
    backend = "nccl" if nodes[0].gpus else "gloo"
    schemes = {
        # replicas across nodes, shards inside (HSDP); tensor inside a node, pipeline across
        "hsdp": {"dp_replicate": len(nodes), "pp": 1, "dp_shard": tasks, "tp": 1},
        "tp_pp": {"dp_replicate": 1, "pp": len(nodes), "dp_shard": 1, "tp": tasks},
        "fsdp": {"dp_replicate": 1, "pp": 1, "dp_shard": world, "tp": 1},
    }
    return {
        "choice": choose(nodes, backend=backend).to_dict(),
        "layouts": {name: plan_layout(nodes, degrees=d, tasks_per_node=tasks).to_dict() for name, d in schemes.items()},
    }


@pytest.mark.parametrize("machine", MACHINES)
def test_choice_and_layout_match_golden(machine):
    got = json.loads(json.dumps(outcome(machine)))
    path = GOLDEN / f"{machine}.json"
    if os.environ.get("DTK_UPDATE_GOLDEN") == "1":
        path.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    assert got == json.loads(path.read_text())


def test_golden_files_say_what_the_issue_asks():
    """Spot checks, so that a regenerated golden file cannot quietly drift."""
    ib = json.loads((GOLDEN / "ib.json").read_text())
    hca = {n: [s["value"] for s in ss if s["key"] == "NCCL_IB_HCA"] for n, ss in ib["choice"]["node_settings"].items()}
    assert hca == {"gpu-a01": ["=mlx5_0:1,mlx5_1:1,mlx5_2:1"], "gpu-a02": ["=mlx5_0:1,mlx5_2:1,mlx5_3:1"]}
    assert (ib["choice"]["interface"], ib["choice"]["master_addr"]) == ("ib0", "10.10.0.11")
    eth = json.loads((GOLDEN / "ethernet.json").read_text())
    assert {s["key"]: s["value"] for s in eth["choice"]["settings"]}["NCCL_IB_DISABLE"] == "1"
    assert eth["choice"]["interface"] == "ens1f0"
    roce = json.loads((GOLDEN / "roce.json").read_text())
    assert roce["choice"]["transport"] == "roce"
    assert {s["key"]: s["value"] for s in roce["choice"]["settings"]}["NCCL_IB_GID_INDEX"] == "3"
    dgx = json.loads((GOLDEN / "dgx.json").read_text())
    assert dgx["choice"]["interface"] == "ibp24s0"
    assert all("mlx5_8" not in s["value"] for ss in dgx["choice"]["node_settings"].values() for s in ss)
    spans = {a["axis"]: a["span"] for a in dgx["layouts"]["tp_pp"]["axes"]}
    assert spans == {"tp": "NVLink", "cp": "one rank", "dp_shard": "one rank", "pp": "one switch", "dp_replicate": "one rank"}
    spans = {a["axis"]: a["span"] for a in eth["layouts"]["tp_pp"]["axes"]}
    assert spans["tp"] == "inside a node" and eth["layouts"]["tp_pp"]["warnings"]  # L40S: no NVLink
    vm = json.loads((GOLDEN / "vm.json").read_text())
    assert vm["choice"]["interface"] == "lo" and vm["choice"]["backend"] == "gloo"
