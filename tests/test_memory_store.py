"""The memory tier's pure rules (dtk.checkpoint.memory.store): the ring partner, commit
records, which step the ranks restore and from whom, what pruning keeps. Real files in a
temporary folder, no torch."""

from __future__ import annotations

import json

from dtk.checkpoint.memory import store as ms

IDENTITY = {"config_hash": "abc", "mesh": {"dp": 4}}


def test_the_partner_is_the_same_local_rank_on_the_next_node_and_replica_of_inverts_it():
    assert [ms.partner(r, 4, 2) for r in range(4)] == [2, 3, 0, 1]
    assert [ms.partner(r, 6, 2) for r in range(6)] == [2, 3, 4, 5, 0, 1]
    for r in range(6):
        assert ms.replica_of(ms.partner(r, 6, 2), 6, 2) == r
    assert ms.partner(1, 2, 2) is None and ms.replica_of(0, 2, 2) is None  # one node: no replica


def test_commit_records_round_trip_and_torn_or_foreign_ones_are_not_records(tmp_path):
    record = ms.commit_record(6, world_size=2, identity=IDENTITY, crcs=[1, 2], layout_crcs=[3, 4])
    (tmp_path / ms.step_dir(tmp_path, 6).name).mkdir()
    ms.write_commit(tmp_path, record)
    assert ms.parse_commit((ms.step_dir(tmp_path, 6) / ms.COMMIT).read_text()) == record
    assert ms.parse_commit(json.dumps(record)[:-3]) is None
    assert ms.parse_commit(json.dumps({**record, "crcs": [1]})) is None  # one CRC per rank
    assert ms.parse_commit(json.dumps({**record, "layout_crcs": [3]})) is None
    assert ms.parse_commit("[1, 2]") is None


def report(node, steps):
    return {"node": node, "steps": steps}


def held(commit, own=(), replica=()):
    return {"commit": commit, "own": list(own), "replica": list(replica)}


def two_nodes(step, lost_node_b=False):
    """4 ranks, 2 per node: a holds own 0, 1 and replicas of 2, 3; b the other way round."""
    c = ms.commit_record(step, world_size=4, identity=IDENTITY, crcs=[10, 11, 12, 13], layout_crcs=[20, 21, 22, 23])
    a = held(c, own=(0, 1), replica=(2, 3))
    b = {} if lost_node_b else {step: held(c, own=(2, 3), replica=(0, 1))}
    return [report("a", {step: a}), report("a", {step: a}), report("b", b), report("b", b)]


NODES = ["a", "a", "b", "b"]


def test_every_rank_on_its_own_node_restores_from_memory():
    choice = ms.choose(two_nodes(8), world=4, identity=IDENTITY, disk_step=4)
    assert choice.step == 8 and choice.from_world == 4
    assert choice.sources == {0: (0, "own"), 1: (1, "own"), 2: (2, "own"), 3: (3, "own")}
    assert choice.crcs == [10, 11, 12, 13] and choice.layout_crcs == [20, 21, 22, 23]
    moves, tiers = ms.transfers([[0], [1], [2], [3]], choice.sources, NODES)
    assert moves == [] and tiers == {0: "memory", 1: "memory", 2: "memory", 3: "memory"}


def test_the_replacement_of_a_lost_node_gets_its_shards_from_the_replicas():
    choice = ms.choose(two_nodes(8, lost_node_b=True), world=4, identity=IDENTITY, disk_step=4)
    assert choice.step == 8 and choice.sources[2] == (0, "replica") and choice.sources[3] == (0, "replica")
    moves, tiers = ms.transfers([[0], [1], [2], [3]], choice.sources, ["a", "a", "c", "c"])
    assert moves == [(2, 0, 2), (3, 0, 3)]  # rank 0 reads both replicas from node a and sends them
    assert tiers == {0: "memory", 1: "memory", 2: "peer", 3: "peer"}


def test_a_shrunk_job_restores_every_old_shard_from_its_node():
    """Node b lost, no spare: 2 ranks on node a hold the 4 old shards (own 0, 1, replicas 2, 3)."""
    choice = ms.choose(two_nodes(8, lost_node_b=True)[:2], world=2, identity=IDENTITY, disk_step=0)
    assert choice.step == 8 and choice.from_world == 4
    assert choice.sources == {0: (0, "own"), 1: (1, "own"), 2: (0, "replica"), 3: (0, "replica")}
    # FSDP 4 -> 2: each new rank needs two old pieces, all on its own node
    moves, tiers = ms.transfers([[0, 1], [2, 3]], choice.sources, ["a", "a"])
    assert moves == [] and tiers == {0: "memory", 1: "memory"}
    # a replicated piece is read from the rank's own number, else one its node holds, else the lowest
    assert ms.pick([0, 1, 2, 3], rank=1, sources=choice.sources, nodes=["a", "a"]) == 1
    assert ms.pick([2, 3], rank=1, sources=choice.sources, nodes=["a", "a"]) == 2


def test_a_snapshot_older_than_the_disk_or_of_another_mesh_falls_back_with_the_reason():
    assert ms.choose(two_nodes(8), world=4, identity=IDENTITY, disk_step=9).reason.startswith("the newest snapshot")
    assert ms.choose(two_nodes(8), world=4, identity=IDENTITY, disk_step=8).step == 8  # a tie: read from memory
    other = ms.choose(two_nodes(8), world=4, identity={**IDENTITY, "mesh": {"dp": 2, "tp": 2}}, disk_step=0)
    assert other.step is None and "mesh changed" in other.reason
    # node b lost and its replicas with it (a ring of three nodes would keep them): no restore
    a_only = [report("a", {8: held(two_nodes(8)[0]["steps"][8]["commit"], own=(0, 1))})] * 2
    gone = ms.choose(a_only, world=2, identity=IDENTITY, disk_step=0)
    assert gone.step is None and "rank 2's shard is on no node of the job" in gone.reason


def test_a_step_missing_a_shard_is_skipped_for_an_older_complete_one():
    c8 = ms.commit_record(8, world_size=2, identity=IDENTITY, crcs=[1, 2], layout_crcs=[5, 6])
    c6 = ms.commit_record(6, world_size=2, identity=IDENTITY, crcs=[3, 4], layout_crcs=[7, 8])
    steps = {8: held(c8, own=(0,)), 6: held(c6, own=(0, 1))}
    choice = ms.choose([report("a", steps), report("a", steps)], world=2, identity=IDENTITY, disk_step=0)
    assert choice.step == 6
    only8 = {8: held(c8, own=(0,))}
    none = ms.choose([report("a", only8), report("a", only8)], world=2, identity=IDENTITY, disk_step=0)
    assert none.step is None and "rank 1's shard is on no node" in none.reason
    assert ms.choose([report("a", {}), report("a", {})], world=2, identity=IDENTITY, disk_step=0).reason is None


def test_prune_keeps_the_two_newest_complete_steps_and_a_newer_one_in_flight(tmp_path):
    for step in (2, 4, 6, 8, 10):
        ms.write_shard(tmp_path, step, "own", 0, b"x", 1)
        if step != 4 and step != 10:
            ms.write_commit(tmp_path, ms.commit_record(step, world_size=1, identity={}, crcs=[1], layout_crcs=[2]))
    ms.prune(tmp_path, generation=0)
    assert sorted(ms.holdings(tmp_path)) == [6, 8, 10]
    data, crc = ms.read_shard(tmp_path, 8, "own", 0)
    assert (data, crc) == (b"x", 1)


def test_submit_refuses_a_memory_tier_that_does_not_fit_the_nodes_ram(tmp_path):
    from conftest import run_main

    job = ["cluster=lab", "cluster.accelerator=h100-80gb", "dist.device=cuda", "tasks_per_node=2", "cluster.mem_gb=8",
           "model.dim=1024", "model.num_layers=16", "model.num_heads=16", "submit.dry_run=true",
           f"run.root={tmp_path / 'runs'}"]
    proc = run_main("dtk.submit", *job, "checkpoint.memory_every=5", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = proc.stderr.strip()
    assert line.startswith("error: checkpoint.memory_every=5: the in-memory snapshot tier needs ") and "\n" not in line
    assert "(cluster.mem_gb=8)" in line
    assert run_main("dtk.submit", *job, "checkpoint.memory_every=0", cwd=tmp_path).returncode == 0
