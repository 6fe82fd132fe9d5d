"""The searched recommendation (dtk.plan.cost.search): what-if dimensions in every check, the
70B case of issue 26, the memory line of a what-if without a shape, and a sweep in which
every recommended command, typed, plans and fits. In-process and torch-free."""

from __future__ import annotations

import json

import pytest

from conftest import run_main
from dtk.common.errors import UserError
from dtk.config.compose import compose
from dtk.plan.cost.budget import estimate
from dtk.plan.cost.inputs import context
from dtk.plan.cost.report import chosen_variant, memory_plan
from dtk.plan.cost.search import searched
from dtk.plan.cost.steptime import hardware_of
from dtk.plan.plan import make_plan

H100 = ["cluster=slurm", "cluster.accelerator=h100-80gb"]
LLAMA_70B = ["plan.params=70e9", "plan.layers=80", "plan.hidden=8192", "plan.heads=64", "plan.seq_len=4096"]


def planned(*overrides: str):
    cfg = compose(list(overrides))
    plan = make_plan(cfg, cwd="/tmp")
    return plan, memory_plan(context(cfg, plan), plan)


def typed_fits(base: list[str], overrides: list[str]):
    """The command typed: the same what-if and cluster keys plus the overrides; its own plan."""
    cfg = compose([*base, *overrides])
    plan = make_plan(cfg, cwd="/tmp")
    ctx = context(cfg, plan)
    return plan, estimate(ctx, chosen_variant(ctx, plan))


@pytest.mark.slow
def test_70b_on_two_h100_nodes_recommends_a_plan_that_fits_and_types():
    base = [*H100, *LLAMA_70B]
    _, mp = planned(*base, "nodes=2")
    rec = mp.ranked[0]
    assert rec.fits and rec.variant.nodes <= 8
    assert mp.recommended.overrides == rec.overrides and f"nodes={rec.variant.nodes}" in rec.overrides
    plan, est = typed_fits(base, rec.overrides)
    assert est.fits is True
    assert plan.degrees == rec.degrees and plan.micro_batch == rec.variant.micro_batch
    assert est.bytes.total == rec.estimate.bytes.total  # the same job, the same numbers
    for alt in mp.ranked[1:4]:  # the alternatives type too
        assert typed_fits(base, alt.overrides)[1].fits is True, alt.overrides


def test_typed_tp_is_checked_against_the_whatif_heads_not_the_builtin_model():
    base = [*H100, *LLAMA_70B, "nodes=16"]
    plan = make_plan(compose([*base, "+scheme=tp"]), cwd="/tmp")  # tp=8 divides plan.heads=64
    assert plan.degrees.tp == 8
    with pytest.raises(UserError, match=r"scheme.tp=8 does not divide plan.heads=60"):
        make_plan(compose([*base, "+scheme=tp", "plan.heads=60"]), cwd="/tmp")
    # a pipeline deeper than plan.layers names plan.layers with its value
    with pytest.raises(UserError, match=r"plan.layers=80: each stage needs at least one block"):
        make_plan(compose([*base, "+scheme=pp"]), cwd="/tmp")


def test_whatif_without_a_shape_says_activations_were_not_estimated():
    _, mp = planned(*H100, "nodes=1", "plan.params=1e9")
    memory = next(ln for ln in mp.describe().splitlines() if ln.startswith("memory "))
    assert "activations not estimated" in memory
    assert "plan.layers" in memory and "plan.hidden" in memory and "plan.seq_len" in memory
    # no model to split: the tp column is not a "fits"
    assert mp.rows["tp"].estimate is None and "plan.layers" in mp.rows["tp"].error
    assert mp.to_json()["activations_estimated"] is False
    assert mp.recommended.reason.endswith("activations not estimated: it fits the states alone")


def test_smallest_says_that_no_node_count_fits():
    _, mp = planned(*H100, "nodes=1", *LLAMA_70B)  # ddp never fits a 70B model
    assert "smallest    no node count up to 4096 fits under ddp" in mp.describe()


SWEEP_MODELS = {  # what-if models from 1B to 400B (layers, hidden, heads)
    "1B": (16, 2048, 16),
    "8B": (32, 4096, 32),
    "70B": (80, 8192, 64),
    "175B": (96, 12288, 96),
    "400B": (126, 16384, 128),
}


@pytest.mark.parametrize("nodes", [1, 8, 64])
@pytest.mark.parametrize("model", list(SWEEP_MODELS))
def test_every_recommended_command_validates_when_typed(model, nodes):
    layers, hidden, heads = SWEEP_MODELS[model]
    base = [*H100, f"plan.layers={layers}", f"plan.hidden={hidden}", f"plan.heads={heads}", "plan.seq_len=4096",
            "plan.vocab_size=128256", "train.global_batch=512"]
    cfg = compose([*base, f"nodes={nodes}"])
    ctx = context(cfg, make_plan(cfg, cwd="/tmp"))
    ranked, why = searched(ctx, hardware_of(cfg.cluster, device="cuda", param_dtype="auto"), max_nodes=None)
    assert ranked, why
    rec = ranked[0]
    assert rec.fits and rec.time is not None and rec.time.total_s > 0
    plan, est = typed_fits(base, rec.overrides)
    assert est.fits is True and plan.degrees == rec.degrees, rec.overrides
    assert plan.nodes == rec.variant.nodes >= nodes


def test_plan_json_has_the_recommendation_and_its_alternatives(tmp_path):
    proc = run_main("dtk.plan", *H100, "nodes=8", *LLAMA_70B, "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["predicted_step_s"] is None  # the job as given (ddp) does not fit
    rec = out["recommended"]
    assert isinstance(rec["overrides"], list) and all(isinstance(o, str) and " " not in o for o in rec["overrides"])
    assert set(rec["degrees"]) == {"dp_replicate", "dp_shard", "cp", "tp", "pp", "ep"}
    assert rec["predicted_step_s"] > 0 and rec["reason"]
    assert len(out["alternatives"]) == 3
    for alt in out["alternatives"]:
        assert set(alt) >= {"overrides", "degrees", "predicted_step_s", "reason"}
        assert alt["predicted_step_s"] >= rec["predicted_step_s"] * 0.97 or "nodes" in alt["reason"]
    # the job as given, when it fits, has its own prediction
    proc = run_main("dtk.plan", *H100, "nodes=8", *LLAMA_70B, *rec["overrides"], "--json", cwd=tmp_path)
    own = json.loads(proc.stdout)
    assert own["fits"] is True and own["predicted_step_s"] == pytest.approx(rec["predicted_step_s"])


def test_plan_md_records_the_recommendation_its_step_and_the_alternatives():
    from dtk.plan.cost.handout import why_section

    _, mp = planned(*H100, "nodes=8", *LLAMA_70B, "+scheme=fsdp", "scheme.activation_checkpoint=full")
    text = "\n".join(why_section(mp))
    assert f"Predicted step of the job as asked: {mp.predicted.describe()}" in text
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and "`" in ln]
    assert len(rows) == 4 and "| recommended |" in rows[0]
    assert f"`{' '.join(mp.ranked[0].overrides)}`" in rows[0]
    for row, alt in zip(rows[1:], mp.ranked[1:4], strict=True):
        assert f"`{' '.join(alt.overrides)}`" in row and "step time" in row or "not as simple" in row


def test_submit_refuses_whatif_keys_it_would_not_train(tmp_path):
    proc = run_main("dtk.submit", "cluster=lab", "plan.params=70e9", "plan.heads=64", "+scheme=tp", "submit.dry_run=true",
                    f"run.root={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("error: plan.params=7e+10 plan.heads=64: what-if keys")
    assert "\n" not in proc.stderr.strip() and not list(tmp_path.iterdir())


def test_the_search_names_the_axes_from_the_axis_table():
    """search.py and variants.py spell no list of axis names of their own (a tuple of degree
    keys, a dict keyed by them, `keys["pp"]`): the axes come from dtk.plan.degrees.Axis."""
    import ast

    from conftest import REPO
    from dtk.plan.degrees import Axis

    only_axes = {Axis.dp_replicate.value, Axis.dp_shard.value}  # names no scheme file has
    axes = set(Axis.values())
    found = []
    for where in ("dtk/plan/cost/search.py", "dtk/plan/cost/variants.py"):
        for node in ast.walk(ast.parse((REPO / where).read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                named = {e.value for e in node.elts if isinstance(e, ast.Constant)}
            elif isinstance(node, ast.Dict):
                named = {k.value for k in node.keys if isinstance(k, ast.Constant)}
            elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
                named = {node.slice.value} & axes
                if named:
                    found.append((where, node.lineno, sorted(named)))
                continue
            else:
                continue
            if named & only_axes:
                found.append((where, node.lineno, sorted(named & axes)))
    assert found == []


GPT_76B = ["cluster=slurm", "tasks_per_node=8", "nodes=128", "cluster.accelerator=a100-80gb", "cluster.nics_per_node=8",
           "train.global_batch=1792", "plan.layers=60", "plan.hidden=10240", "plan.heads=80", "plan.seq_len=2048",
           "plan.vocab_size=51200"]
"""Megatron-LM SC'21 Table 1's 76.1B model on its 1024 GPUs: its batch does not split over 1024."""


def test_a_batch_the_default_layout_cannot_split_is_no_reason_to_refuse_the_search(tmp_path):
    r = run_main("dtk.plan", *GPT_76B, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("as given    train.global_batch=1792 does not split over the data-parallel size 1024")
    rec = next(line for line in lines if line.startswith("recommended "))
    overrides, reason = rec.removeprefix("recommended ").split(": ", 1)
    assert "fits on the 128 node(s) asked" in reason and "by the batch split" in reason
    plan, est = typed_fits(GPT_76B, overrides.split())
    assert est.fits is True and 1792 % plan.degrees.dp == 0
    as_json = json.loads(run_main("dtk.plan", *GPT_76B, "--json", cwd=tmp_path).stdout)
    assert as_json["recommended"]["overrides"] == overrides.split() and "1792" in as_json["as_given"]
    # a job that names its layout is refused as before
    named = run_main("dtk.plan", *GPT_76B, "+scheme=fsdp", cwd=tmp_path)
    assert named.returncode == 2 and named.stderr.startswith("error: train.global_batch=1792")


@pytest.mark.slow
def test_the_search_tries_zero1_with_tp_and_pp_and_its_layouts_type():
    """ZeRO-1 with tp and pp (+scheme=zero_tp_pp) is among the searched structures, at 1F1B
    and without sequence parallelism, the layout its runtime runs (tests/test_schemes_zero_tp_pp.py)."""
    base = ["cluster=slurm", "tasks_per_node=8", "cluster.accelerator=a100-80gb", "cluster.nics_per_node=8",
            "train.global_batch=2304", "plan.layers=80", "plan.hidden=12288", "plan.heads=96", "plan.seq_len=2048",
            "plan.vocab_size=51200"]
    _, mp = planned(*base, "nodes=192", "+scheme=zero_tp_pp", "scheme.tp=8", "scheme.pp=8")
    zero1 = [c for c in mp.ranked if c.key == "zero_tp_pp"]
    assert zero1
    for c in zero1[:3]:
        plan, est = typed_fits(base, c.overrides)
        scheme = plan.config.scheme
        assert est.fits is True and plan.degrees == c.degrees and plan.degrees.tp * plan.degrees.pp > 1
        assert scheme.shard_optimizer and str(scheme.data_parallel) == "ddp" and scheme.pp_virtual_stages == 1
