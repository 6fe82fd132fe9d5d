"""The mixture of experts (model=moe) end to end (real `python -m dtk.submit` runs on CPU gloo
workers) against one process: under plain DDP on 2 ranks, ep=2 x dp_shard=2, ep=2 x
dp_shard=4, ep=2 x cp=2 x dp_shard=2, ep=2 with full activation checkpointing (losses per
step, validation losses, final parameters, the ep groups plan.md lists against those the
workers built); and a checkpoint written
under ep=2 resumes under ep=1 and one written under ep=1 resumes under ep=2, each
continuing the one-process losses, with ep in the checkpoint's layout record.

Tolerances: the loss per step within 1e-4 absolute (issue 34), measured far below (see the
report of the largest difference; measured 4.8e-7 in every case, one float32 rounding);
parameters after 8 steps within rtol 1e-5, atol 5e-5 (Adam turns a rounding difference of a near-zero gradient into a visible step).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from plan_md_check import assert_plan_md_matches_mesh
from test_cp_schemes import continue_run, validation
from test_schemes import assert_parameters_close, final_parameters

from conftest import dtk, losses

pytestmark = [pytest.mark.slow, pytest.mark.dist]

JOB = [
    "model=moe",
    "train.steps=8",
    "train.global_batch=8",
    "optim.warmup_steps=2",
    "checkpoint.every=4",
    "train.eval_every=4",
]
LOSS_ATOL, PARAM_ATOL = 1e-4, 5e-5

CASES = {
    "moe_ddp": ["tasks_per_node=2", "+scheme=ddp"],
    "ep2_dp2": ["tasks_per_node=2", "+scheme=ep", "scheme.ep=2"],
    "ep2_dp4": ["tasks_per_node=4", "+scheme=ep", "scheme.ep=2"],
    # ep carved out of dp_shard x cp: each ep group is a dp_shard rank's two cp ranks
    "cp2_ep2_dp2": ["tasks_per_node=4", "+scheme=ep", "scheme.cp=2", "scheme.ep=2", "scheme.dp_shard=2"],
    # the all-to-alls run again in the recomputed forward
    "ep2_full_ac": ["tasks_per_node=2", "+scheme=ep", "scheme.ep=2", "scheme.activation_checkpoint=full"],
}


def train(root: Path, *overrides: str) -> Path:
    proc = dtk("dtk.submit", *JOB, *overrides, f"run.root={root}", "run.name=run", cwd=root)
    assert proc.returncode == 0, f"{overrides}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return root / "run"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    return train(tmp_path_factory.mktemp("reference"), "tasks_per_node=1")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            done[name] = train(tmp_path_factory.mktemp(name), *CASES[name])
        return done[name]

    return get


def _close(got: dict[int, float], want: dict[int, float]) -> None:
    worst = max(abs(got[s] - want[s]) for s in want)
    assert worst <= LOSS_ATOL, f"largest loss difference {worst:.2e} over steps {sorted(want)}"
    print(f"largest loss difference {worst:.2e}")


@pytest.mark.parametrize("name", list(CASES))
def test_moe_matches_one_process(name, reference, runs):
    run = runs(name)
    want, got = losses(reference), losses(run)
    assert sorted(got) == list(range(1, 9))
    _close(got, want)
    assert_plan_md_matches_mesh(run)  # the ep groups the workers built are those plan.md lists
    want_val, got_val = validation(reference), validation(run)
    assert sorted(got_val) == [4, 8]
    _close(got_val, want_val)
    assert_parameters_close(final_parameters(run), final_parameters(reference), PARAM_ATOL)


def _layout_record(run: Path, step: int) -> dict:
    manifest = json.loads((run / "checkpoints" / f"step_{step:08d}" / "manifest.json").read_text())
    return manifest["mesh"]


def test_an_ep_checkpoint_continues_without_ep_and_back(reference, runs, tmp_path):
    source = runs("ep2_dp2")
    assert _layout_record(source, 4)["ep"] == 2
    continued = continue_run(source, tmp_path / "to_ep1", JOB, 4, "tasks_per_node=2", "+scheme=fsdp")
    assert sorted(continued) == [5, 6, 7, 8]
    _close(continued, {s: v for s, v in losses(reference).items() if s > 4})
    assert _layout_record(tmp_path / "to_ep1" / "run", 8)["ep"] == 1
    back = continue_run(runs("moe_ddp"), tmp_path / "to_ep2", JOB, 4, *CASES["ep2_dp4"])
    assert sorted(back) == [5, 6, 7, 8]
    _close(back, {s: v for s, v in losses(reference).items() if s > 4})
