"""Run identity: the identity keys name a run, nothing else does, a new defaulted key renames
nothing, and a run directory v0.1.0 named is found again for the same command."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from dtk.config import convert, schema
from dtk.config.compose import compose
from dtk.config.fields import IDENTITY, is_identity
from dtk.config.identity import identity_hash, identity_values
from dtk.config.identity_v0 import v0_hash
from dtk.plan.identity import model_name, run_identity
from dtk.plan.plan import make_plan

GOLDEN = json.loads((Path(__file__).parent / "golden" / "run_names.json").read_text())
"""Each case: its overrides, the name v0.1.0 gave it (computed by that release's code), and
the name this rule gives it. Neither may change: a change renames runs users have."""


@pytest.mark.parametrize("case", GOLDEN, ids=lambda c: " ".join(c["overrides"]) or "defaults")
def test_run_names_are_frozen(case, tmp_path):
    cfg = compose(case["overrides"])
    assert run_identity(cfg, tmp_path)[0] == case["name"]
    assert f"{model_name(cfg.model._target_)}-{v0_hash(cfg)}" == case["v0.1.0"]


def test_the_identity_of_the_default_config_is_empty_and_so_is_every_scheme():
    names = {c["name"] for c in GOLDEN if not c["overrides"] or c["overrides"][0].startswith("+scheme=")}
    assert identity_values(compose([])) == {} and len(names) == 1


@pytest.mark.parametrize("overrides", [
    ["data.eval_samples=16"], ["model.wrap_classes=[]"], ["model.tp_plan={}"], ["model.split_points=[layers.1]"],
    ["checkpoint.every=7"], ["checkpoint.keep=5"], ["checkpoint.async_save=false"], ["train.log_every=5"],
    ["train.eval_every=10"], ["train.micro_batch=16"], ["train.profile=false"], ["train.tensorboard=true"],
    ["train.tracker=[mlflow]"], ["train.threads=1"], ["tasks_per_node=4"], ["+scheme=fsdp", "scheme.activation_checkpoint=full"],
    ["fault.max_restarts=1"], ["dist.timeout_s=60"], ["+task.metrics.acc=a.b"], ["run.root=elsewhere"],
])
def test_keys_that_compute_nothing_keep_the_name(overrides, tmp_path):
    assert make_plan(compose(overrides), cwd=tmp_path).run_name == GOLDEN[0]["name"]


def test_hdf5_evaluation_and_verification_keep_the_name():
    base = identity_hash(compose(["data=hdf5", "data.path=/d"]))
    assert identity_hash(compose(["data=hdf5", "data.path=/d", "data.eval_samples=8", "data.verify=true"])) == base
    assert identity_hash(compose(["data=hdf5", "data.path=/d", "data.split_seed=3"])) != base


# Every identity field of the schema, by section; a marker dropped or added fails here.
IDENTITY_FIELDS = {
    schema.TransformerConfig: {"_target_", "vocab_size", "dim", "num_layers", "num_heads", "ffn_hidden", "seq_len",
                               "norm_eps", "dropout", "tie_embeddings", "num_experts", "top_k", "aux_loss_weight",
                               "capacity_factor"},
    schema.OptimConfig: {"name", "lr", "weight_decay", "beta1", "beta2", "eps", "warmup_steps", "min_lr_ratio",
                         "grad_clip"},
    schema.TrainConfig: {"steps", "global_batch", "seed"},
    schema.SyntheticDataConfig: {"kind", "num_samples", "seed", "branching"},
    schema.Hdf5DataConfig: {"kind", "path", "val_fraction", "split_seed", "val_shards"},
    schema.UserDataConfig: {"kind", "_target_", "kwargs", "val_fraction", "split_seed", "version"},
    schema.TaskConfig: {"_target_", "form", "inputs"},
    schema.ModelConfig: {"_target_", "kwargs"},
    schema.SchemeConfig: {"grad_compression", "powersgd_rank"},
    schema.SyncConfig: {"mode", "every", "outer_lr", "outer_momentum", "outer_nesterov", "dtype", "fragments"},
}


def test_the_identity_fields_are_declared_in_the_schema():
    for cls, names in IDENTITY_FIELDS.items():
        assert {f.name for f in dataclasses.fields(cls) if is_identity(f)} == names, cls.__name__


def _changed(value):
    """Another value of the same type."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value * 2 + 1
    if isinstance(value, list):
        return [*value, "x.h5"]
    if isinstance(value, dict):
        return {**value, "n": 1}
    return f"{value}.other"  # strings, None and Enums: a value of another spelling


@pytest.mark.parametrize("base, section", [
    ([], "optim"), ([], "train"), ([], "data"), ([], "task"),
    (["data=hdf5", "data.path=/d"], "data"), (["data=user", "data._target_=m.f"], "data"),
    ([], "scheme"), (["+sync=diloco"], "sync"),
])
def test_each_identity_key_changes_the_name(base, section):
    cfg = compose(base)
    before = identity_hash(cfg)
    obj = getattr(cfg, section)
    for f in dataclasses.fields(obj):
        if not is_identity(f) or f.name == "kind":  # kind chooses the schema: another data group
            continue
        saved = getattr(obj, f.name)
        setattr(obj, f.name, _changed(saved))
        assert identity_hash(cfg) != before, f"{section}.{f.name}"
        setattr(obj, f.name, saved)
    assert identity_hash(cfg) == before


def test_each_model_key_changes_the_name():
    cfg = compose([])
    before = identity_hash(cfg)
    for key, value in list(cfg.model.kwargs.items()):
        cfg.model.kwargs[key] = _changed(value)
        assert identity_hash(cfg) != before, f"model.{key}"
        cfg.model.kwargs[key] = value
    user = compose(["model=hf", "model.config=gpt2", "model.vocab_size=256"])
    assert identity_hash(compose(["model=hf", "model.config=gpt2", "model.vocab_size=128"])) != identity_hash(user)


def _with_new_field(cls: type, name: str, default):
    return dataclasses.make_dataclass(f"{cls.__name__}Next", [(name, type(default), dataclasses.field(
        default=default, metadata=IDENTITY))], bases=(cls,))


@pytest.mark.parametrize("section, cls", [("optim", schema.OptimConfig), ("train", schema.TrainConfig),
                                          ("data", schema.SyntheticDataConfig)])
def test_a_new_defaulted_identity_field_renames_no_run(section, cls):
    cfg = compose(["optim.lr=1e-4"])
    before, old = identity_hash(cfg), v0_hash(cfg)
    nxt = _with_new_field(cls, "ema_decay", 0.0)
    setattr(cfg, section, nxt(**dataclasses.asdict(getattr(cfg, section))))
    assert (identity_hash(cfg), v0_hash(cfg)) == (before, old)
    getattr(cfg, section).ema_decay = 0.5  # set: the config computes something else
    assert identity_hash(cfg) != before and v0_hash(cfg) is None


def test_a_new_defaulted_transformer_key_renames_no_run(monkeypatch):
    cfg = compose(["model.dim=128"])  # today's schema
    before, old = identity_hash(cfg), v0_hash(cfg)
    # The next release's: one more key, with a default; the same config now spells it.
    nxt = _with_new_field(schema.TransformerConfig, "rope_theta", 10000.0)
    for module in (convert, schema):
        monkeypatch.setattr(module, "TransformerConfig", nxt)
    monkeypatch.setattr(convert, "TRANSFORMER_KEYS", convert.TRANSFORMER_KEYS | {"rope_theta"})
    cfg.model.kwargs["rope_theta"] = 10000.0
    assert convert.builtin_transformer(cfg.model) is not None
    assert (identity_hash(cfg), v0_hash(cfg)) == (before, old)
    cfg.model.kwargs["rope_theta"] = 500.0
    assert identity_hash(cfg) != before and v0_hash(cfg) is None


def _v0_run(root: Path, name: str, config_hash: str) -> Path:
    """A run directory as v0.1.0 leaves it, as far as identity goes: its plan.json's hash."""
    run = root / name
    run.mkdir(parents=True)
    (run / "plan.json").write_text(json.dumps({"run_name": name, "config_hash": config_hash}))
    return run


@pytest.mark.parametrize("case", GOLDEN[8:12] + GOLDEN[:1], ids=lambda c: " ".join(c["overrides"]) or "defaults")
def test_a_run_directory_of_v0_is_kept_for_the_same_command(case, tmp_path):
    cfg = compose(case["overrides"])
    _v0_run(tmp_path / "runs", case["v0.1.0"], v0_hash(cfg))
    plan = make_plan(cfg, cwd=tmp_path)
    assert (plan.run_name, plan.config_hash) == (case["v0.1.0"], v0_hash(cfg))
    # Another config never lands in it: it gets this rule's name.
    other = make_plan(compose([*case["overrides"], "train.seed=7"]), cwd=tmp_path)
    assert other.run_name != case["v0.1.0"] and other.config_hash == identity_hash(other.config)


def test_a_named_run_of_v0_keeps_its_hash(tmp_path):
    cfg = compose(["run.name=mine", "optim.lr=1e-4"])
    _v0_run(tmp_path / "runs", "mine", v0_hash(cfg))
    assert make_plan(cfg, cwd=tmp_path).config_hash == v0_hash(cfg)
    # A directory of another config keeps the current hash, so the launch refuses the mix.
    assert make_plan(compose(["run.name=mine"]), cwd=tmp_path).config_hash == identity_hash(compose([]))


def test_a_run_directory_of_this_rule_wins_over_one_of_v0(tmp_path):
    cfg = compose(["train.seed=1"])
    new = GOLDEN[9]["name"]
    _v0_run(tmp_path / "runs", GOLDEN[9]["v0.1.0"], v0_hash(cfg))
    _v0_run(tmp_path / "runs", new, identity_hash(cfg))
    assert make_plan(cfg, cwd=tmp_path).run_name == new


def test_each_release_is_a_commit_of_this_history_and_its_tag_agrees():
    import subprocess

    from conftest import REPO, require
    from releases import RELEASES

    for tag, commit in RELEASES.items():
        found = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True)
        require(found.returncode == 0, f"this clone lacks commit {commit} of {tag} (a shallow clone)")
        tagged = subprocess.run(["git", "-C", str(REPO), "rev-parse", "-q", "--verify", f"refs/tags/{tag}^{{commit}}"],
                                capture_output=True, text=True)
        if tagged.returncode == 0:  # a clone may lack the tags; where one is there, it is this commit
            assert tagged.stdout.strip() == commit, tag
