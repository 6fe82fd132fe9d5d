"""A model dtk has never seen (tests/models_for_tests.py), given only by `_target_` and its
yaml, trains under fsdp, tp and pp and matches its own single-process run.

The yaml lives in a folder of the user's, added to Hydra's search path on the command
line (`hydra.searchpath=[file://DIR]`), as a team would keep its models outside dtk.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_schemes import assert_parameters_close, final_parameters

from conftest import dtk, losses

pytestmark = [pytest.mark.slow, pytest.mark.dist]

MODEL_YAML = """\
# No schema: every key but _target_ and the three parallel keys goes to the factory.
_target_: tests.models_for_tests.build
vocab_size: 256
seq_len: 32
width: 32
depth: 4
expansion: 2
wrap_classes: [ResidualMLP]
tp_plan:
  embed: rowwise
  blocks.*.up: colwise
  blocks.*.down: rowwise
  head: colwise_output
split_points: [blocks.2]
"""

JOB = ["train.steps=10", "train.global_batch=16", "train.micro_batch=4", "optim.warmup_steps=2", "train.log_every=10"]

CASES = {
    "fsdp": ["+scheme=fsdp", "scheme.cpu_offload=true"],
    "tp": ["+scheme=tp"],
    "pp": ["+scheme=pp"],
}


@pytest.fixture(scope="module")
def user_conf(tmp_path_factory) -> list[str]:
    conf = tmp_path_factory.mktemp("user_conf")
    (conf / "model").mkdir()
    (conf / "model" / "mlp_lm.yaml").write_text(MODEL_YAML)
    return [f"hydra.searchpath=[file://{conf}]", "model=mlp_lm"]


def train(root: Path, *overrides: str) -> Path:
    proc = dtk("dtk.submit", *JOB, *overrides, f"run.root={root}", "run.name=run", cwd=root)
    assert proc.returncode == 0, f"{overrides}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return root / "run"


@pytest.fixture(scope="module")
def reference(user_conf, tmp_path_factory) -> Path:
    return train(tmp_path_factory.mktemp("user_ref"), *user_conf, "tasks_per_node=1")


@pytest.mark.parametrize("name", list(CASES))
def test_user_model_trains_under_scheme(name, user_conf, reference, tmp_path):
    run = train(tmp_path, *user_conf, "tasks_per_node=2", *CASES[name])
    want, got = losses(reference), losses(run)
    assert sorted(got) == list(range(1, 11))
    assert got[10] < got[1]
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), f"step {step}"
    assert_parameters_close(final_parameters(run), final_parameters(reference), atol=2e-5)
    # The names in the checkpoint are the model's own: nothing of dtk's wrappers or stages.
    assert all(name.startswith(("embed.", "blocks.", "final_norm.", "head.")) for name in final_parameters(run))


def test_user_model_factory_sees_only_its_keys():
    from dtk.config.convert import model_config

    model = model_config({"_target_": "tests.models_for_tests.build", "width": 8, "wrap_classes": ["X"],
                          "tp_plan": {}, "split_points": []})
    assert model.kwargs == {"width": 8}
    assert model.wrap_classes == ["X"]
