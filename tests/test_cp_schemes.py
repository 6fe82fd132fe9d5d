"""Context parallelism end to end (real `python -m dtk.submit` runs on CPU gloo workers)
against one process, at model.seq_len=256 (4x the default): cp=2, cp=2 x dp_shard=2,
cp=2 x tp=2 and cp=2 with full activation checkpointing (losses, validation losses, final
parameters), and a Hugging Face Llama under cp=2 x dp_shard=2 (losses); and a checkpoint
written under cp resumes without it, and the other way round.

Tolerances: the loss per step within rtol 1e-5 (issue 34 asks 1e-4), the parameters after
10 steps within rtol 1e-5 and atol 2e-5 (5e-5 with tp: Adam turns a rounding difference of
a near-zero gradient into a visible step). Measured (largest over 10 steps, fp32 CPU): loss
1.8e-7 (cp2, cp2_full_ac), 9.9e-8 (cp2_dp2, cp2_tp2); parameters 3.4e-6 (cp2, cp2_full_ac),
2.8e-6 (cp2_dp2), 1.8e-5 (cp2_tp2); cp=2 x pp=2 is also run (no validation: a pipeline does not evaluate)."""

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
    "train.global_batch=8",
    "model.num_layers=2",
    "model.seq_len=256",
    "optim.warmup_steps=2",
    "checkpoint.every=5",
    "train.log_every=10",
    "train.eval_every=5",
]
LOSS_RTOL, ATOL, TP_ATOL = 1e-5, 2e-5, 5e-5

CASES = {
    "cp2": ["tasks_per_node=2", "+scheme=cp", "scheme.cp=2"],
    "cp2_dp2": ["tasks_per_node=4", "+scheme=cp", "scheme.cp=2", "scheme.dp_shard=2"],
    "cp2_tp2": ["tasks_per_node=4", "+scheme=cp", "scheme.cp=2", "scheme.dp_shard=1", "scheme.tp=2"],
    # the gather of keys and values runs again in the recomputed forward
    "cp2_full_ac": ["tasks_per_node=2", "+scheme=cp", "scheme.cp=2", "scheme.activation_checkpoint=full"],
    # each stage's attention gathers over its cp group; the last stage's loss is averaged
    # over cp per step (no evaluation under a pipeline)
    "cp2_pp2": ["tasks_per_node=4", "+scheme=cp", "scheme.cp=2", "scheme.dp_shard=1", "scheme.pp=2",
                "train.eval_every=0"],
}


def job(*overrides: str) -> list[str]:
    """JOB with the keys `overrides` set left out (Hydra takes a key once)."""
    keys = {o.split("=")[0] for o in overrides}
    return [o for o in JOB if o.split("=")[0] not in keys]


def train(root: Path, *overrides: str) -> Path:
    proc = dtk("dtk.submit", *job(*overrides), *overrides, f"run.root={root}", "run.name=run", cwd=root)
    assert proc.returncode == 0, f"{overrides}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return root / "run"


def validation(run: Path) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in map(json.loads, (run / "eval.jsonl").read_text().splitlines())}


def final_parameters(run: Path) -> dict[str, torch.Tensor]:
    from dtk.checkpoint.export import load_model_state
    from dtk.checkpoint.manifest import verify

    last = sorted((run / "checkpoints").glob("step_*"))[-1]
    return load_model_state(last, verify(last))


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


@pytest.mark.parametrize("name", list(CASES))
def test_cp_matches_one_process(name, reference, runs):
    run = runs(name)
    want, got = losses(reference), losses(run)
    assert sorted(got) == list(range(1, 11))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=LOSS_RTOL), f"step {step}"
    assert_plan_md_matches_mesh(run)  # the cp groups the workers built are those plan.md lists
    if "train.eval_every=0" in CASES[name]:  # a pipeline: no evaluation
        assert not (run / "eval.jsonl").exists()
    else:
        want_val, got_val = validation(reference), validation(run)
        assert sorted(got_val) == [5, 10]
        for step in want_val:  # evaluation: each cp rank's sum over its tokens, summed over cp
            assert got_val[step] == pytest.approx(want_val[step], rel=LOSS_RTOL), f"val_loss at step {step}"
    final, ref = final_parameters(run), final_parameters(reference)
    assert final.keys() == ref.keys()
    for key in ref:
        atol = TP_ATOL if "tp" in name else ATOL
        torch.testing.assert_close(final[key], ref[key], rtol=1e-5, atol=atol, msg=lambda m, k=key: f"{k}: {m}")


def continue_run(source: Path, tmp_path: Path, job: list[str], at: int, *overrides: str) -> dict[int, float]:
    """The source run (trained with `job`) continued from its checkpoint of step `at` to its
    last step under `overrides` (the checkpoint of the last step removed): the losses after it."""
    run = tmp_path / "run"
    shutil.copytree(source, run)
    for later in (run / "checkpoints").glob("step_*"):
        if int(later.name.split("_")[1]) > at:
            shutil.rmtree(later)
    (run / "summary.json").unlink()
    before = len((run / "metrics.jsonl").read_text().splitlines())
    proc = dtk("dtk.submit", *job, *overrides, f"run.root={tmp_path}", "run.name=run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = [e for e in map(json.loads, (run / "events.jsonl").read_text().splitlines())
              if e["event"] == "checkpoint_loaded"]
    assert loaded and loaded[-1]["step"] == at
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()[before:]]
    return {r["step"]: r["loss"] for r in records}


def test_a_cp_checkpoint_continues_without_cp(runs, tmp_path):
    source = runs("cp2_dp2")
    continued = continue_run(source, tmp_path, JOB, 5, "tasks_per_node=2", "+scheme=fsdp")
    assert sorted(continued) == [6, 7, 8, 9, 10]
    for step, loss in continued.items():
        assert loss == pytest.approx(losses(source)[step], rel=LOSS_RTOL), f"step {step}"


def test_a_checkpoint_of_cp_under_a_pipeline_continues_on_one_process(runs, tmp_path):
    source = runs("cp2_pp2")
    continued = continue_run(source, tmp_path, job("train.eval_every=0"), 5, "tasks_per_node=1", "train.eval_every=0")
    assert sorted(continued) == [6, 7, 8, 9, 10]
    for step, loss in continued.items():
        assert loss == pytest.approx(losses(source)[step], rel=LOSS_RTOL), f"step {step}"


def test_a_checkpoint_without_cp_continues_under_cp(reference, tmp_path):
    continued = continue_run(reference, tmp_path, JOB, 5, *CASES["cp2"])
    assert sorted(continued) == [6, 7, 8, 9, 10]
    for step, loss in continued.items():
        assert loss == pytest.approx(losses(reference)[step], rel=LOSS_RTOL), f"step {step}"


def test_a_hugging_face_llama_under_cp_matches_one_process(tmp_path):
    """model=hf (a Llama with grouped-query attention and RoPE) under cp=2 x dp_shard=2
    against one process: RoPE at the true positions, keys and values gathered over cp."""
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}))
    job = ["model=hf", f"model.config={tmp_path / 'tiny'}", "model.seq_len=256", "train.steps=4",
           "train.global_batch=4", f"run.root={tmp_path}"]
    runs = {}
    for name, layout in {"one": ["tasks_per_node=1"],
                         "cp": ["tasks_per_node=4", "+scheme=cp", "scheme.cp=2", "scheme.dp_shard=2"]}.items():
        proc = dtk("dtk.submit", *job, *layout, f"run.name={name}", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = losses(tmp_path / name)
    assert sorted(runs["cp"]) == [1, 2, 3, 4]
    for step, loss in runs["one"].items():
        assert runs["cp"][step] == pytest.approx(loss, rel=LOSS_RTOL), f"step {step}"
