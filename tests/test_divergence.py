"""Divergence, the pure parts: the verdict (skip / rollback / fail) against recorded loss
sequences, the data order the skipped windows make, and the drill's request as rank 0 takes it."""

from __future__ import annotations

import json
import math

import pytest

from conftest import dtk
from dtk.data.order import data_step
from dtk.train.divergence import (
    FAIL,
    NAN_REQUEST,
    NAN_TAKEN,
    OK,
    ROLLBACK,
    SKIP,
    DivergenceWatch,
    NanDrill,
    read_skips,
    record_skip,
    write_nan_request,
)

NAN, INF = math.nan, math.inf


def verdicts(losses, *, grad_norms=None, **keys):
    args = dict(spike_factor=10.0, spike_window=3, rollback_after=3, rollback_window=5, max_rollbacks=1)
    watch = DivergenceWatch(**{**args, **keys})
    norms = grad_norms or [1.0] * len(losses)
    return [watch.observe(step, loss, norm, f"h{step}") for step, (loss, norm) in
            enumerate(zip(losses, norms, strict=True), start=1)], watch


def test_finite_losses_train_on():
    out, _ = verdicts([5.0, 4.0, 3.5, 3.4, 3.2, 30.0])  # 30 < 10 x median 3.4: no spike
    assert [v.action for v in out] == [OK] * 6


def test_one_nonfinite_loss_or_grad_norm_or_spike_is_a_skip():
    out, _ = verdicts([5.0, NAN, 4.0], grad_norms=[1.0, 1.0, 1.0])
    assert [v.action for v in out] == [OK, SKIP, OK] and out[1].cause() == "nonfinite_loss"
    out, _ = verdicts([5.0, 4.0], grad_norms=[INF, 1.0])
    assert [v.action for v in out] == [SKIP, OK] and out[0].cause() == "nonfinite_grad_norm"
    out, _ = verdicts([5.0, 4.0, 4.0, 4.0, 1e6, 3.9])
    assert [v.action for v in out] == [OK, OK, OK, OK, SKIP, OK] and out[4].cause() == "spike"
    assert out[4].bad[0].batch_hash == "h5" and out[4].bad[0].step == 5


def test_a_spike_needs_a_full_window():
    out, _ = verdicts([5.0, 1e6, 1e6])  # two good losses only when the huge ones come
    assert [v.action for v in out] == [OK, OK, OK]


def test_bad_steps_within_the_window_roll_back_then_the_next_divergence_fails():
    out, watch = verdicts([5.0, NAN, 4.0, NAN, NAN])
    assert [v.action for v in out] == [OK, SKIP, OK, SKIP, ROLLBACK]
    assert [b.step for b in out[-1].bad] == [2, 4, 5] and watch.rollbacks_done == 1
    watch.rolled_back(1)
    again = [watch.observe(s, NAN, 1.0, f"g{s}") for s in (2, 3, 4)]
    assert [v.action for v in again] == [SKIP, SKIP, FAIL]
    assert [b.batch_hash for b in again[-1].bad] == ["g2", "g3", "g4"]


def test_bad_steps_further_apart_than_the_window_only_skip():
    out, _ = verdicts([NAN, 4.0, 4.0, 4.0, 4.0, NAN, 4.0, 4.0, 4.0, 4.0, NAN])
    assert [v.action for v in out].count(SKIP) == 3 and ROLLBACK not in [v.action for v in out]


def test_rollback_after_zero_never_rolls_back():
    out, _ = verdicts([NAN] * 6, rollback_after=0)
    assert [v.action for v in out] == [SKIP] * 6


def test_the_window_after_a_rollback_is_the_window_of_its_checkpoint():
    _, watch = verdicts([5.0, 4.0, 3.0, 2.0, 1.0])
    watch.rolled_back(3)
    assert watch.observe(4, 45.0, 1.0).action == SKIP  # 10 x median(5, 4, 3) = 40; after step 5 it was 20
    assert watch.observe(4, 35.0, 1.0).action == OK


def test_skipped_windows_move_the_steps_after_them(tmp_path):
    assert [data_step(i, []) for i in range(4)] == [0, 1, 2, 3]
    record_skip(tmp_path, {"from_step": 3, "num_steps": 2})  # bad steps 3-4: data steps 2 and 3
    skips = read_skips(tmp_path)
    assert [data_step(i, skips) for i in range(6)] == [0, 1, 4, 5, 6, 7]
    record_skip(tmp_path, {"from_step": 5, "num_steps": 1})  # training step 5 read data step 6
    assert [data_step(i, read_skips(tmp_path)) for i in range(6)] == [0, 1, 4, 5, 7, 8]


def test_the_nan_request_is_taken_once_at_a_step_boundary(tmp_path):
    drill = NanDrill(tmp_path)
    assert not drill.poisoned(1)
    write_nan_request(tmp_path, at_step=4, num_steps=2)
    assert [drill.poisoned(s) for s in range(2, 8)] == [False, False, True, True, False, False]
    assert [drill.poisoned(s) for s in (4, 5)] == [False, False]  # redone after a rollback: taken already
    assert not (tmp_path / NAN_REQUEST).exists()
    assert json.loads((tmp_path / NAN_TAKEN).read_text())["steps"] == [4, 5]
    write_nan_request(tmp_path, at_step=None, num_steps=1)  # no step: the next one
    assert drill.poisoned(9) and not drill.poisoned(10)
    assert not NanDrill(None).poisoned(1)  # ranks other than 0 read nothing


def test_drill_nan_writes_the_request(tmp_path):
    (tmp_path / "plan.json").write_text(json.dumps({"steps": 10}))
    proc = dtk("dtk.drill", "nan", str(tmp_path), "--at-step", "6", "--steps", "2")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / NAN_REQUEST).read_text()) == {"at_step": 6, "num_steps": 2}
    proc = dtk("dtk.drill", "nan", str(tmp_path), "--steps", "0")
    assert proc.returncode == 2 and proc.stderr.startswith("error: --steps"), proc.stderr


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_every_nonfinite_value_is_bad(bad):
    out, _ = verdicts([5.0, bad])
    assert out[1].action == SKIP


def test_goodput_counts_skipped_and_rolled_back_steps_as_redone():
    from dtk.report.goodput import account

    def rec(step, t, **extra):
        return {"step": step, "time": t, "step_time_s": 1.0, "restart": 0, **extra}
    events = [{"event": "submitted", "time": 0.0}, {"event": "started", "time": 1.0, "restart": 0},
              {"event": "skipped_update", "time": 4.0, "step": 3}, {"event": "rolled_back", "time": 5.0, "step": 3},
              {"event": "finished", "time": 9.0}]
    # Steps 2-3 of the first pass are thrown away by the rollback to step 1; step 4 skipped its update.
    lines = [rec(1, 2.0), rec(2, 3.0), rec(3, 4.0, skipped="nonfinite_loss"), rec(2, 6.0), rec(3, 7.0),
             rec(4, 8.0, skipped="spike")]
    g = account(events, lines)
    assert g["redone_steps"] == 3 and g["parts"]["redone_s"] == 3.0 and g["parts"]["productive_s"] == 3.0
    assert g["skipped_updates"] == 1 and g["rollbacks"] == 1


def test_status_names_the_skips_and_the_rollback():
    from dtk.report.collect import _divergence

    events = [{"event": "skipped_update", "step": s} for s in (5, 6, 7)] + [
        {"event": "rolled_back", "step": 5, "last_bad_step": 7, "cause": "nonfinite_loss", "to_step": 4,
         "data_window": [4, 6]}]
    div = _divergence(events)
    assert div["skipped_steps"] == [5, 6, 7] and div["rollbacks"][0]["to_step"] == 4


def test_a_resumed_watch_judges_the_next_steps_as_the_uninterrupted_one():
    losses = [5.0, 4.0, 3.0, 1e6, 3.5, 3.2, NAN]
    out, _ = verdicts(losses + [NAN, 40.0])
    # bad steps 4 (spike), 7, 8 within 5 steps: a rollback; then 40 > 10 x median(3, 3.5, 3.2)
    assert [v.action for v in out] == [OK, OK, OK, SKIP, OK, OK, SKIP, ROLLBACK, SKIP]
    # The records metrics.jsonl holds after step 7, as a resume from its checkpoint reads them.
    records = {s: {"loss": v, "batch_hash": f"h{s}", **({"skipped": v2.cause()} if v2.action != OK else {})}
               for s, v, v2 in zip(range(1, 8), losses, out, strict=False)}
    _, resumed = verdicts([])
    resumed.restore(records, up_to=7)
    again = [resumed.observe(8, NAN, 1.0, "h8"), resumed.observe(9, 40.0, 1.0, "h9")]
    assert [(v.action, [b.step for b in v.bad]) for v in again] == [(ROLLBACK, [4, 7, 8]), (SKIP, [9])]
