"""A tied transformer (`model.tie_embeddings=true`: the output head is the token embedding)
under every data and tensor-parallel scheme on 4 CPU processes (gloo) against one process,
each a real `python -m dtk.submit` run, as tests/test_schemes.py does for the untied model;
4 steps each (the tie is in every step's gradient from the first), so the cases add a
fraction of that suite's time. Under a pipeline the first stage holds the embedding and
the last the head, each a copy whose gradients are summed every step. A checkpoint
written under tp continues under fsdp, one of fsdp under pp and one of pp under ddp, on 2
processes with the tie intact; the checkpoint holds the tied weight once and its export
loads into the tied model.

Tolerances as tests/test_schemes.py's: loss rtol 1e-5; parameters rtol 1e-5 with atol 1e-6
(data and pipeline parallel) and 2e-5 (tensor parallel).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_schemes import EXACT_ATOL, LOSS_RTOL, TP_ATOL, assert_parameters_close, final_parameters

from conftest import dtk, losses

pytestmark = [pytest.mark.slow, pytest.mark.dist]

STEPS = 4
JOB = [
    "model.tie_embeddings=true",
    f"train.steps={STEPS}",
    "train.global_batch=16",
    "train.micro_batch=2",
    "model.num_layers=4",
    "optim.warmup_steps=1",
    "checkpoint.every=2",
    f"train.log_every={STEPS}",
]

# name -> (overrides, parameter atol)
CASES = {
    "ddp": (["+scheme=ddp", "scheme.bucket_cap_mb=1"], EXACT_ATOL),
    "zero": (["+scheme=zero"], EXACT_ATOL),
    "fsdp": (["+scheme=fsdp"], EXACT_ATOL),
    "hsdp": (["+scheme=hsdp", "scheme.dp_replicate=2"], EXACT_ATOL),
    "tp": (["+scheme=tp", "train.micro_batch=8"], TP_ATOL),
    "hybrid_dp2_tp2": (
        ["+scheme=hybrid", "scheme.dp_shard=2", "scheme.tp=2", "scheme.sequence_parallel=true", "train.micro_batch=4"],
        TP_ATOL,
    ),
    # The embedding on the first stage, the head on the last: two copies, gradients summed.
    "pp_1f1b": (["+scheme=pp"], EXACT_ATOL),
    "pp_interleaved": (
        ["+scheme=pp", "scheme.pp=2", "scheme.dp_shard=2", "scheme.pp_schedule=interleaved_1f1b",
         "scheme.pp_virtual_stages=2"],
        EXACT_ATOL,
    ),
    "hybrid_pp2_dp2": (
        ["+scheme=hybrid", "scheme.pp=2", "scheme.dp_shard=2", "scheme.tp=1", "scheme.pp_schedule=gpipe"],
        EXACT_ATOL,
    ),
    "hybrid_pp2_tp2": (["+scheme=hybrid", "scheme.pp=2", "scheme.dp_shard=1", "scheme.tp=2"], TP_ATOL),
}


def train(root: Path, *overrides: str) -> Path:
    proc = dtk("dtk.submit", *JOB, *overrides, f"run.root={root}", "run.name=run", cwd=root)
    assert proc.returncode == 0, f"{overrides}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return root / "run"


def assert_tied(params: dict) -> None:
    """The checkpoint holds the tied weight once, under its first name."""
    assert "tok_embeddings.weight" in params and "output.weight" not in params


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    return train(tmp_path_factory.mktemp("reference"), "tasks_per_node=1")


@pytest.fixture(scope="module")
def tied_runs(tmp_path_factory):
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            done[name] = train(tmp_path_factory.mktemp(name), "tasks_per_node=4", *CASES[name][0])
        return done[name]

    return get


@pytest.mark.parametrize("name", list(CASES))
def test_a_tied_model_matches_one_process(name, reference, tied_runs):
    run = tied_runs(name)
    want, got = losses(reference), losses(run)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=LOSS_RTOL), f"step {step}"
    params, ref = final_parameters(run), final_parameters(reference)
    assert_tied(params)
    assert_tied(ref)
    assert_parameters_close(params, ref, CASES[name][1])


# written by -> continued by (on 2 processes): across tensor, data and pipeline parallelism
RESUMES = {"tp": ["+scheme=fsdp"], "fsdp": ["+scheme=pp", "scheme.pp=2"], "pp_1f1b": ["+scheme=ddp"]}


@pytest.mark.parametrize("written", list(RESUMES))
def test_a_tied_checkpoint_continues_under_another_scheme_on_two_processes(written, tied_runs, tmp_path):
    """Written at step 2 on 4 processes, continued on 2 under another scheme: steps 3-4 give
    the losses the writing run logged, and the checkpoint still holds the tie once."""
    first = tied_runs(written)
    run = tmp_path / "run"
    shutil.copytree(first, run)
    shutil.rmtree(run / "checkpoints" / f"step_{STEPS:08d}")
    (run / "summary.json").unlink()
    proc = dtk("dtk.submit", *JOB, *RESUMES[written], "tasks_per_node=2", f"run.root={tmp_path}", "run.name=run",
               cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    loaded = [e for e in loaded if e["event"] == "checkpoint_loaded"]
    assert loaded and loaded[-1]["step"] == 2 and loaded[-1]["from_world_size"] == 4
    continued = {
        r["step"]: r["loss"]
        for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if r["world_size"] == 2
    }
    assert sorted(continued) == [3, 4]
    on_four = losses(first)
    for step, loss in continued.items():
        assert loss == pytest.approx(on_four[step], rel=LOSS_RTOL), f"step {step}"
    assert_tied(final_parameters(run))


def test_the_export_of_a_tied_checkpoint_loads_into_the_tied_model(tied_runs, tmp_path):
    """`checkpoint export` writes the tensor under both names, as load_state_dict asks;
    the loaded model's head is its embedding, with the trained values."""
    import torch

    from dtk.models.transformer import build

    run = tied_runs("fsdp")
    out = tmp_path / "model.pt"
    proc = dtk("dtk.checkpoint", "export", str(run), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    info = json.loads(out.with_name("model.pt.json").read_text())
    assert info["tied"] == {"output.weight": "tok_embeddings.weight"}
    model = build(tie_embeddings=True, num_layers=4)
    model.load_state_dict(torch.load(out, weights_only=True))
    trained = final_parameters(run)["tok_embeddings.weight"]
    assert model.output.weight is model.tok_embeddings.weight and model.output.weight.equal(trained)
    assert info["parameters"] == sum(p.numel() for p in model.parameters())
