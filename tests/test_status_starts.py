"""dtk.status's per-start history: cause, resumed-from step, steps redone, downtime and the
relaunch budget, from the events and metrics records the drivers and workers write."""

from __future__ import annotations

import json

from conftest import run_main
from dtk.report.starts import history


def ev(t, kind, **fields):
    return {"time": t, "event": kind, **fields}


def rec(t, step, restart):
    return {"time": t, "step": step, "restart": restart, "loss": 1.0 / step}


# One allocation: a node fails at step 12 (checkpoint 10), then a crash at 25 (checkpoint 20),
# then a hang at 33 (checkpoint 30); then a preemption at 45 (checkpoint 40) and a requeue.
EVENTS = [
    ev(0.0, "submitted", job_id="7"),
    ev(1.0, "started", restart=0, job_id="7", nodes=["n1", "n2"], world_size=2, slurm_restart_count=0),
    ev(20.0, "node_failed", job_id="7", nodes=["n2"], step=12, resume_from=10),
    ev(21.0, "started", restart=1, job_id="7", nodes=["n1"], world_size=1, slurm_restart_count=0),
    ev(22.0, "checkpoint_loaded", step=10),
    ev(23.5, "resumed", step=11),
    ev(40.0, "relaunched", job_id="7", cause="crashed", detail="rank 0 exited 1", step=25, resume_from=20, attempt=1),
    ev(41.0, "started", restart=2, job_id="7", nodes=["n1"], world_size=1, slurm_restart_count=0),
    ev(42.0, "checkpoint_loaded", step=20),
    ev(60.0, "hang_detected", job_id="7", step=33, silent_s=10.0, limit_s=10),
    ev(60.5, "relaunched", job_id="7", cause="hung", detail="no heartbeat for 10 s (limit 10 s)", step=33,
       resume_from=30, attempt=2),
    ev(61.0, "started", restart=3, job_id="7", nodes=["n1"], world_size=1, slurm_restart_count=0),
    ev(62.0, "checkpoint_loaded", step=30),
    ev(80.0, "preempted", step=45, signal="SIGTERM", saved=True, checkpoint_step=45),
    ev(80.5, "requeued", job_id="7", step=45, reason="stopped on a signal"),
    ev(90.0, "started", restart=4, job_id="7", nodes=["n1", "n3"], world_size=2, slurm_restart_count=1),
    ev(90.5, "topology", restart=4, transport="socket", interface="lab0", master_addr="10.77.0.2"),
    ev(91.0, "checkpoint_loaded", step=45),
]
METRICS = ([rec(1.5 + s, s, 0) for s in range(1, 13)]
           + [rec(23.5 + s - 11, s, 1) for s in range(11, 26)]
           + [rec(43.0 + s - 21, s, 2) for s in range(21, 31)]  # records of 31-33 lost with the hang
           + [rec(63.0 + s - 31, s, 3) for s in range(31, 46)]
           + [rec(92.0, 46, 4)])


def test_each_start_has_its_cause_checkpoint_redone_steps_downtime_and_budget():
    starts = history(EVENTS, METRICS, max_restarts=3)
    assert [s["cause"].split(":")[0] for s in starts] == [
        "first start", "node failed", "crashed", "hung", "preempted (SIGTERM)"]
    assert [s["resumed_from"] for s in starts] == [0, 10, 20, 30, 45]
    assert [s.get("steps_redone") for s in starts] == [None, 2, 5, 3, 0]
    # Down: last record before the fault -> this start's first step (the `resumed` event or record).
    assert starts[1]["downtime_s"] == 23.5 - 13.5
    assert starts[2]["downtime_s"] == 43.0 - 37.5
    assert starts[3]["downtime_s"] == 63.0 - 52.0  # the hang's detection wait is inside
    assert starts[4]["downtime_s"] == 92.0 - 77.0  # the requeue's queue wait is inside
    # Relaunches after a crash and a hang spend the allocation's budget; a requeue is a new allocation.
    assert [s["budget_left"] for s in starts] == [3, 3, 2, 1, 3]
    assert starts[4]["slurm_restart_count"] == 1


def test_a_time_limit_and_a_grow_back_are_named():
    events = [
        ev(1.0, "started", restart=0, job_id="8", nodes=["n1"], world_size=1),
        ev(5.0, "preempted", step=4, signal="SIGUSR2", saved=True, checkpoint_step=4),
        ev(5.5, "requeued", job_id="8", step=4, reason="stopped on a signal"),
        ev(9.0, "started", restart=1, job_id="8", nodes=["n1"], world_size=1),
        ev(12.0, "node_returned", job_id="8", nodes=["n2"], step=6),
        ev(13.0, "started", restart=2, job_id="8", nodes=["n1", "n2"], world_size=2),
        ev(13.1, "grown", job_id="8", nodes=["n1", "n2"], from_world_size=1, world_size=2),
    ]
    starts = history(events, [], max_restarts=1)
    assert starts[1]["cause"] == "time limit"
    assert starts[2]["cause"].startswith("grown back to world 2")
    assert starts[1]["downtime_s"] is None  # no step of it on record yet


def test_status_prints_and_returns_the_history(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "plan.json").write_text(json.dumps({"steps": 50, "run_name": "run", "config": {"fault": {"max_restarts": 3}}}))
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in EVENTS))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in METRICS))
    proc = run_main("dtk.status", str(run), "--json", env={"PATH": "/nonexistent"})
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert [s["resumed_from"] for s in info["starts"]] == [0, 10, 20, 30, 45]
    assert info["restarts_by_cause"] == {"node failed": 1, "crashed": 1, "hung": 1, "preempted": 1}
    assert info["relaunches_left"] == 3
    text = run_main("dtk.status", str(run), env={"PATH": "/nonexistent"}).stdout
    assert "cause: hung: no heartbeat" in text and "from step 30, 3 steps redone, down 11.0 s" in text
    assert info["fabric"] == {"restart": 4, "transport": "socket", "interface": "lab0", "master_addr": "10.77.0.2"}
    assert "fabric       socket across nodes over lab0, master 10.77.0.2 (start 4; why: topology.json)" in text


def _write(run, events, metrics, summary=None):
    run.mkdir()
    (run / "plan.json").write_text(json.dumps({"steps": 50, "run_name": "run", "config": {"fault": {"max_restarts": 3}}}))
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    if summary is not None:
        (run / "summary.json").write_text(json.dumps(summary))


# Crashed at step 25 (checkpoint 20), relaunched: it is redoing step 22 now.
REDO_EVENTS = [ev(0.0, "submitted", job_id="local-1"), ev(1.0, "started", restart=0, job_id="local-1", nodes=["h"]),
               ev(30.0, "relaunched", cause="crashed", step=25, resume_from=20, attempt=1),
               ev(31.0, "started", restart=1, job_id="local-1", nodes=["h"]), ev(32.0, "checkpoint_loaded", step=20)]
REDO_METRICS = [rec(1.0 + s, s, 0) for s in range(1, 26)] + [rec(33.0 + s, s, 1) for s in range(21, 23)]


def test_status_and_report_show_the_step_of_the_start_that_runs_not_the_dead_ones(tmp_path):
    run = tmp_path / "run"
    _write(run, REDO_EVENTS, REDO_METRICS)
    info = json.loads(run_main("dtk.status", str(run), "--json", env={"PATH": "/nonexistent"}).stdout)
    assert info["step"] == 22 and info["loss"] == 1.0 / 22
    out = json.loads(run_main("dtk.report", str(run), "--json", "--no-plots").stdout)["runs"][0]
    assert out["step"] == 22 and out["final_loss"] == 1.0 / 22


def test_report_does_not_call_a_run_failed_that_was_started_again(tmp_path):
    run = tmp_path / "run"
    events = [ev(0.0, "submitted"), ev(1.0, "started", restart=0), ev(5.0, "failed", error="boom"),
              ev(9.0, "submitted"), ev(10.0, "started", restart=1)]
    _write(run, events, [rec(2.0, 1, 0), rec(11.0, 1, 1)], summary={"status": "failed", "final_step": 1})
    out = json.loads(run_main("dtk.report", str(run), "--json", "--no-plots").stdout)["runs"][0]
    assert out["status"] == "running or stopped (started again after it failed)"
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events[:3]))
    assert json.loads(run_main("dtk.report", str(run), "--json", "--no-plots").stdout)["runs"][0]["status"] == "failed"


def test_a_resume_after_dtk_stop_is_named_a_stop_not_a_preemption():
    events = [ev(1.0, "started", restart=0, job_id="9", nodes=["n1"], world_size=1),
              ev(5.0, "preempted", step=4, signal="SIGTERM", saved=True, checkpoint_step=4),  # the stop's SIGTERM
              ev(5.5, "stopped", by="dtk.stop by alice", step=4, checkpoint=4),
              ev(20.0, "submitted", job_id="10"), ev(21.0, "started", restart=1, job_id="10", nodes=["n1"])]
    starts = history(events, [], max_restarts=1)
    assert starts[1]["cause"] == "stopped (dtk.stop by alice), then submitted again"


def test_the_memory_line_puts_the_largest_rank_beside_its_own_plan(tmp_path):
    from dtk.plan.cost.predict import summarize

    ranks = [{"rank": 0, "predicted_bytes": 900, "measured_bytes": 1000, "gap": 0.1111},
             {"rank": 1, "predicted_bytes": 2000, "measured_bytes": 800, "gap": -0.6}]
    memory = summarize(ranks, device="cpu")
    assert (memory["rank"], memory["predicted_bytes"], memory["measured_bytes"]) == (0, 900, 1000)
    run = tmp_path / "run"
    older = {**memory, "predicted_bytes": 2000}  # as an older dtk wrote it: the largest plan of any rank
    _write(run, [ev(0.0, "submitted"), ev(1.0, "finished")], [rec(1.0, 1, 0)],
           summary={"status": "finished", "final_step": 1, "final_loss": 1.0, "memory": older})
    info = json.loads(run_main("dtk.status", str(run), "--json", env={"PATH": "/nonexistent"}).stdout)
    assert (info["memory"]["predicted_bytes"], info["memory"]["measured_bytes"], info["memory"]["rank"]) == (900, 1000, 0)


def test_a_stop_with_now_does_not_claim_a_checkpoint_was_committed():
    from dtk.driver.local import stopped_line

    assert "without saving" in stopped_line("dtk.stop by alice --now", 20)
    assert "after committing a checkpoint" in stopped_line("dtk.stop by alice", 40)
