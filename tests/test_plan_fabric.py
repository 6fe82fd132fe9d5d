"""plan.md's fabric section: the rule each node applies at start, the check, and what the
user fixed by hand (cluster.env), as far as the login node can say it; no torch."""

from __future__ import annotations

from dtk.config.compose import compose
from dtk.plan.cost.handout import fabric_section
from dtk.plan.plan import make_plan


def section(*overrides: str) -> str:
    cfg = compose(["run.root=/nonexistent", *overrides])
    return "\n".join(fabric_section(make_plan(cfg)))


def test_one_local_node_stays_on_the_loopback():
    text = section("dist.device=cpu")
    assert "one node: rendezvous and gloo on the loopback" in text
    assert "backend gloo" in text and "NCCL_IB_HCA" not in text


def test_a_multi_node_nccl_job_names_the_rule_the_check_and_what_the_user_fixed():
    text = section("cluster=lab", "nodes=2", "dist.backend=nccl", "+cluster.env.NCCL_IB_DISABLE=1",
                   "+cluster.env.FOO=bar", "fabric.require=ib")
    assert "never loopback: GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME" in text
    assert "InfiniBand where every node has an active IB port" in text
    assert "fabric.require=ib" in text
    assert "cluster.env (wins over what is detected): NCCL_IB_DISABLE=1." in text  # not FOO: dtk chooses no FOO


def test_discovery_off_says_who_chooses():
    text = section("cluster=lab", "nodes=2", "dist.device=cpu", "fabric.detect=false")
    assert "discovery off (fabric.detect=false)" in text and "interface:" not in text
