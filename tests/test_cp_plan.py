"""Context parallelism at plan time (torch-free): the degrees with cp, FSDP over dp_shard x cp
in the budget's layout, and every combination the runtime cannot run stopped before launch
with one `error:` line and exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_main
from dtk.common.errors import UserError
from dtk.config.compose import compose
from dtk.plan.degrees import Axis, Degrees
from dtk.plan.layout import axis_groups, coords, uses_fsdp
from dtk.plan.plan import make_plan


def plan(*overrides: str):
    return make_plan(compose(list(overrides)), cwd="/tmp")


def test_cp_is_a_mesh_axis_between_dp_shard_and_tp():
    assert Axis.values().index("cp") == Axis.values().index("dp_shard") + 1 == Axis.values().index("tp") - 1
    d = Degrees(dp_replicate=1, pp=1, dp_shard=2, tp=2, cp=2)
    assert d.world == 8 and d.dp == 2  # cp ranks see the same samples
    assert axis_groups(d, "cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert coords(6, d).cp == 1 and coords(6, d).dp_shard == 1 and coords(6, d).tp == 0


def test_cp_plans_with_fsdp_over_dp_shard_x_cp():
    p = plan("+scheme=cp", "tasks_per_node=8", "scheme.cp=4", "model.seq_len=256", "train.global_batch=8")
    assert (p.degrees.cp, p.degrees.dp_shard, p.degrees.dp) == (4, 2, 2)
    assert uses_fsdp(compose(["+scheme=cp"]).scheme, p.degrees)
    alone = plan("+scheme=cp", "tasks_per_node=2", "scheme.cp=2", "train.global_batch=8")
    assert (alone.degrees.cp, alone.degrees.dp) == (2, 1)  # FSDP shards over cp alone


CASES = {
    "seq_len": (["+scheme=cp", "tasks_per_node=4", "scheme.cp=4", "model.seq_len=36"],
                "scheme.cp=4 does not fit model.seq_len=36: each sequence is cut into 2 x cp = 8 equal chunks"),
    "world": (["+scheme=cp", "tasks_per_node=4", "scheme.cp=3", "scheme.dp_shard=1", "model.seq_len=48"],
              "dp_replicate=1 x pp=1 x dp_shard=1 x cp=3 x tp=1 = 3, but the world size (nodes x tasks_per_node) is 4"),
    "ddp": (["+scheme=ddp", "tasks_per_node=2", "scheme.cp=2", "scheme.dp_replicate=1"],
            "scheme.cp=2 with scheme.data_parallel=ddp: context-parallel ranks hold parts of the same samples"),
    "compile": (["+scheme=cp", "tasks_per_node=2", "scheme.cp=2", "scheme.compile=true"],
                "scheme.compile=true with scheme.cp=2: context parallelism does not run with it yet"),
    "sequence_parallel": (["+scheme=cp", "tasks_per_node=4", "scheme.cp=2", "scheme.tp=2", "scheme.dp_shard=1",
                           "scheme.sequence_parallel=true"],
                          "scheme.sequence_parallel=true with scheme.cp=2: context parallelism does not run"),
    "hf_seq_len": (["model=hf", "model.config={tmp}/tiny-llama", "model.seq_len=30", "+scheme=cp",
                    "tasks_per_node=2", "scheme.cp=2"],
                   "scheme.cp=2 does not fit model.seq_len=30: each sequence is cut into 2 x cp = 4 equal chunks"),
    "user_model": (["hydra.searchpath=[file://{tmp}]", "model=mine", "+scheme=cp", "tasks_per_node=2", "scheme.cp=2"],
                   "scheme.cp=2: context parallelism runs the built-in transformer and model=hf; the attention of"
                   " model._target_=tests.models_for_tests.build does not gather"),
    "user_task": (["+scheme=cp", "tasks_per_node=2", "scheme.cp=2", "task._target_=os.path.join"],
                  "scheme.cp=2 with task._target_=os.path.join: context parallelism cuts token rows"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_what_cp_cannot_run_is_one_error_line_with_exit_2(case, tmp_path: Path):
    overrides, message = CASES[case]
    overrides = [o.format(tmp=tmp_path) for o in overrides]
    (tmp_path / "tiny-llama").mkdir()
    (tmp_path / "tiny-llama" / "config.json").write_text(json.dumps({  # a Llama config (model=hf)
        "model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "mine.yaml").write_text(  # a user model
        "_target_: tests.models_for_tests.build\nvocab_size: 256\nseq_len: 32\nwidth: 8\ndepth: 2\n")
    proc = run_main("dtk.submit", *overrides, f"run.root={tmp_path}/runs", cwd=tmp_path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert message in lines[0], lines[0]
    assert not (tmp_path / "runs").exists()


def test_a_hugging_face_model_plans_under_cp(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}))
    p = plan("model=hf", f"model.config={tmp_path}", "model.seq_len=32", "+scheme=cp", "tasks_per_node=4",
             "scheme.cp=2", "train.global_batch=8")
    assert (p.degrees.cp, p.degrees.dp_shard) == (2, 2)


def test_the_checks_are_user_errors_in_make_plan():
    with pytest.raises(UserError, match="2 x cp = 4 equal chunks"):
        plan("+scheme=cp", "tasks_per_node=2", "scheme.cp=2", "model.seq_len=66")


def _job(degrees: Degrees, ac: str):
    import dataclasses

    from dtk.config.schema import SchemeConfig
    from dtk.plan.cost.memory import Job, precision_for, scheme_config

    s = scheme_config(dict(dataclasses.asdict(SchemeConfig()), data_parallel="fsdp", activation_checkpoint=ac))
    return Job(s, degrees, micro_batch=2, num_micro=1, device="cuda", precision=precision_for(s, "cuda"))


SHAPE_KEYS = {"layers": 4, "hidden": 1024, "heads": 8, "seq_len": 8192, "vocab_size": 32000}


@pytest.mark.parametrize("ac", ["full", "none"])
def test_the_budget_divides_activations_by_cp_and_keeps_the_gathered_keys_and_values(ac):
    from dtk.plan.cost.memory import rank_bytes
    from dtk.plan.shape import whatif_shape

    shape = whatif_shape(SHAPE_KEYS)
    one = rank_bytes(shape, _job(Degrees(1, 1, 2, 1), ac), 0).activations
    cp2 = rank_bytes(shape, _job(Degrees(1, 1, 1, 1, cp=2), ac), 0).activations
    local_bsh = 2 * 8192 // 2 * 1024  # micro batch x this rank's tokens x hidden
    gathered = 0 if ac == "full" else 2 * 2 * local_bsh  # per block, bf16 (2 bytes): the other rank's keys and values
    # the chunked loss's one fp32 chunk in backward (dtk.plan.cost.activations) is the same whatever the tokens
    from dtk.plan.cost.activations import LOSS_BYTES, LOSS_CHUNK_ELEMENTS

    chunk = 3 * LOSS_BYTES * LOSS_CHUNK_ELEMENTS
    assert cp2 == (one - chunk) // 2 + chunk + 4 * gathered


def test_the_step_time_counts_the_key_value_traffic_of_cp_on_the_critical_path():
    from dtk.config.schema import ClusterConfig
    from dtk.plan.cost.comm import traffic
    from dtk.plan.cost.steptime import hardware_of, step_time
    from dtk.plan.shape import whatif_shape

    shape = whatif_shape(SHAPE_KEYS)
    for ac, gathers in (("none", 1), ("full", 2)):
        job = _job(Degrees(1, 1, 1, 1, cp=2), ac)
        axes = {a.axis: a for a in traffic(shape, job, tasks_per_node=8)}
        local_bsh = 2 * 8192 // 2 * 1024
        # 4 blocks x (forward gathers + backward reduce-scatter) x (cp - 1) / cp x K and V of cp x local tokens, bf16
        assert axes["cp"].bytes_per_step == 4 * (gathers + 1) * 0.5 * 2 * 2 * local_bsh * 2
        hw = hardware_of(ClusterConfig(accelerator="h100-80gb"), device="cuda", param_dtype="auto")
        t = step_time(shape, job, global_batch=2, tasks_per_node=8, hw=hw)
        assert t.axes["cp"] == pytest.approx(axes["cp"].bytes_per_step / (hw.speeds.intra_gbps * 1e9))
