"""Every scheme on 4 CPU processes (gloo) against one process: same model, data and seed.

Each case is a real `python -m dtk.submit` run; the loss per step comes from its
metrics.jsonl and the final parameters from its last checkpoint, gathered to full tensors.

Tolerances (fp32 on the CPU):
- loss per step: rtol 1e-5 for every scheme. Measured: <= 1e-7 for all of them, pipeline
  alone bitwise equal. Data parallelism only changes the order in which the per-sample
  gradients are summed; tensor parallelism also splits each row-parallel matmul's inner
  sum across ranks, which moves the loss by the same ~1 ulp per step.
- parameters after 10 steps: |a - b| <= atol + rtol*|b| with rtol 1e-5 and atol 1e-6 for
  ddp, zero, fsdp, hsdp and pp; atol 2e-5 for tp and hybrid. Adam divides each gradient by
  its running RMS, so an element whose gradient is near zero turns a rounding difference
  into a visible step difference; each step moves a weight by at most ~lr = 3e-3, so
  these bounds are 1e-4 (5e-4) of what 10 steps can move it. Measured worst cases:
  2.4e-7 (ddp), 1.8e-7 (fsdp), 1.4e-6 (tp), 4.5e-6 (dp_shard 2 x tp 2).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from plan_md_check import assert_plan_md_matches_mesh

from conftest import dtk, losses

pytestmark = [pytest.mark.slow, pytest.mark.dist]

JOB = [
    "train.steps=10",
    "train.global_batch=16",
    "train.micro_batch=2",  # 4 data-parallel ranks: 2 accumulation steps; 4 pipeline stages: 8 micro-batches
    "model.num_layers=4",
    "optim.warmup_steps=2",
    "checkpoint.every=5",
    "train.log_every=10",
]

LOSS_RTOL = 1e-5
EXACT_ATOL, TP_ATOL = 1e-6, 2e-5

# name -> (overrides, parameter atol)
CASES = {
    "ddp": (["+scheme=ddp", "scheme.bucket_cap_mb=1"], EXACT_ATOL),
    "zero": (["+scheme=zero"], EXACT_ATOL),
    "fsdp": (["+scheme=fsdp"], EXACT_ATOL),
    "zero2": (["+scheme=zero2"], EXACT_ATOL),
    "hsdp": (["+scheme=hsdp", "scheme.dp_replicate=2"], EXACT_ATOL),
    # DTensor ops are slow on 2 shared cores: fewer, larger micro-batches (same gradient).
    "tp": (["+scheme=tp", "train.micro_batch=8"], TP_ATOL),
    "pp_1f1b": (["+scheme=pp"], EXACT_ATOL),
    "pp_interleaved": (
        ["+scheme=pp", "scheme.pp=2", "scheme.dp_shard=2", "scheme.pp_schedule=interleaved_1f1b",
         "scheme.pp_virtual_stages=2"],
        EXACT_ATOL,
    ),
    "hybrid_dp2_tp2": (
        ["+scheme=hybrid", "scheme.dp_shard=2", "scheme.tp=2", "scheme.sequence_parallel=true",
         "scheme.activation_checkpoint=selective", "train.micro_batch=4"],
        TP_ATOL,
    ),
    # ZeRO-1 with tp: no DDP wrapper, the optimizer all-reduces the gradients itself
    "zero_tp": (["+scheme=zero_tp_pp", "scheme.pp=1", "train.micro_batch=8"], TP_ATOL),
    "zero_pp": (["+scheme=zero_tp_pp", "scheme.tp=1"], EXACT_ATOL),  # DDP on each stage, ZeRO-1 per stage
    "hybrid_pp2_dp2": (
        ["+scheme=hybrid", "scheme.pp=2", "scheme.dp_shard=2", "scheme.tp=1", "scheme.pp_schedule=gpipe",
         "scheme.activation_checkpoint=full"],  # FSDP kept gathered through the pipeline step by default
        EXACT_ATOL,
    ),
}


def train(root: Path, *overrides: str) -> Path:
    proc = dtk("dtk.submit", *JOB, *overrides, f"run.root={root}", "run.name=run", cwd=root)
    assert proc.returncode == 0, f"{overrides}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return root / "run"


def final_parameters(run: Path) -> dict[str, torch.Tensor]:
    """The model's full tensors from the run's last checkpoint, whatever scheme wrote it,
    read as `checkpoint export` reads them: so every scheme's `.metadata` is shown to pass
    the check that admits DCP's metadata classes only (dtk.checkpoint.trust)."""
    from dtk.checkpoint.export import load_model_state
    from dtk.checkpoint.manifest import verify

    last = sorted((run / "checkpoints").glob("step_*"))[-1]
    return load_model_state(last, verify(last))


def assert_parameters_close(got: dict, want: dict, atol: float) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The single-process fp32 run every scheme must match."""
    return train(tmp_path_factory.mktemp("reference"), "tasks_per_node=1")


@pytest.fixture(scope="module")
def scheme_runs(tmp_path_factory):
    """Each case trained once per module, on demand (the checkpoint test reuses fsdp's)."""
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            done[name] = train(tmp_path_factory.mktemp(name), "tasks_per_node=4", *CASES[name][0])
        return done[name]

    return get


@pytest.mark.parametrize("name", list(CASES))
def test_scheme_matches_one_process(name, reference, scheme_runs):
    run = scheme_runs(name)
    want, got = losses(reference), losses(run)
    assert sorted(got) == list(range(1, 11))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=LOSS_RTOL), f"step {step}"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {r["world_size"] for r in records} == {4}
    assert_parameters_close(final_parameters(run), final_parameters(reference), CASES[name][1])


@pytest.mark.parametrize("name", list(CASES))
def test_plan_md_matches_the_mesh_the_workers_built(name, scheme_runs):
    assert_plan_md_matches_mesh(scheme_runs(name))


def test_fsdp_checkpoint_continues_under_ddp_on_two_processes(scheme_runs, tmp_path):
    """Written by fsdp on 4 processes at step 5, loaded by ddp on 2: steps 6-10 give the
    losses the fsdp run itself logged when it continued on 4."""
    fsdp = scheme_runs("fsdp")
    run = tmp_path / "run"
    shutil.copytree(fsdp, run)
    shutil.rmtree(run / "checkpoints" / "step_00000010")
    (run / "summary.json").unlink()
    proc = dtk("dtk.submit", *JOB, "+scheme=ddp", "tasks_per_node=2", f"run.root={tmp_path}", "run.name=run",
               cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    loaded = [e for e in loaded if e["event"] == "checkpoint_loaded"]
    assert loaded and loaded[-1]["step"] == 5 and loaded[-1]["from_world_size"] == 4
    continued = {
        r["step"]: r["loss"]
        for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if r["world_size"] == 2
    }
    assert sorted(continued) == [6, 7, 8, 9, 10]
    on_four = losses(fsdp)
    for step, loss in continued.items():
        assert loss == pytest.approx(on_four[step], rel=LOSS_RTOL), f"step {step}"
