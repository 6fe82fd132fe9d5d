"""ZeRO-1 with tensor and pipeline parallelism (+scheme=zero_tp_pp) on 8 CPU processes
(dp_replicate=2 x pp=2 x tp=2, gloo) against one process: the issue's acceptance layout.
Losses per step and final parameters, with the tolerances of tests/test_schemes.py for tp
(the same model, data and seed)."""

from __future__ import annotations

import json

import pytest
from test_schemes import LOSS_RTOL, TP_ATOL, assert_parameters_close, final_parameters, train

from conftest import losses

pytestmark = [pytest.mark.slow, pytest.mark.dist]


def test_zero1_with_tp_and_pp_on_eight_ranks_matches_one_process(tmp_path):
    (tmp_path / "reference").mkdir()
    (tmp_path / "zero_tp_pp").mkdir()
    reference = train(tmp_path / "reference", "tasks_per_node=1")
    run = train(tmp_path / "zero_tp_pp", "tasks_per_node=8", "+scheme=zero_tp_pp")
    degrees = json.loads((run / "plan.json").read_text())["degrees"]
    assert (degrees["dp_replicate"], degrees["pp"], degrees["dp_shard"], degrees["tp"]) == (2, 2, 1, 2)
    want, got = losses(reference), losses(run)
    assert sorted(got) == list(range(1, 11))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=LOSS_RTOL), f"step {step}"
    assert_parameters_close(final_parameters(run), final_parameters(reference), TP_ATOL)
