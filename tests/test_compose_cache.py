"""compose() builds Hydra's defaults tree once per distinct set of group choices and applies
the value overrides with Hydra's own code on a copy: the result and the errors must be what
one Hydra compose of the whole command line gives, and an edited yaml composes afresh. Fast."""

from __future__ import annotations

import pytest

from dtk.common.errors import UserError
from dtk.config import compose as compose_module
from dtk.config.compose import SearchPath, compose
from dtk.config.convert import finish, to_dict

CASES = [
    [],
    ["train.steps=7", "optim.lr=3e-4"],
    ["+scheme=fsdp", "scheme.dp_shard=2", "nodes=2"],
    ["+scheme=tp", "nodes=3"],  # tp.yaml's dp_shard interpolates ${nodes}: the value reaches it
    ["model=hf", "data=synthetic", "train.steps=2"],
    ["data=hdf5", "data.path=/tmp/x.h5"],
    ["+extra.note=hello", "~train.eval_every"],
    ["model.dim=64", "+scheme=pp", "scheme.pp=2", "model.num_layers=4"],
]


def _one_hydra_compose(overrides: list[str]) -> dict:
    """What Hydra's compose of the whole command line gives, through dtk's typing."""
    from hydra import compose as hydra_compose
    from omegaconf import OmegaConf

    from dtk.config.schema import register

    register()
    with compose_module._hydra(SearchPath()):
        cfg = hydra_compose(compose_module.CONFIG_NAME, overrides=overrides)
    return to_dict(finish(OmegaConf.to_object(cfg)))


@pytest.mark.parametrize("overrides", CASES, ids=lambda o: " ".join(o) or "defaults")
def test_a_composed_config_is_what_one_hydra_compose_gives(overrides):
    try:
        wanted = _one_hydra_compose(overrides)
    except Exception as exc:  # ~train.eval_every: a schema key cannot be deleted; the same refusal
        with pytest.raises(UserError):
            compose(overrides, search=SearchPath())
        assert type(exc).__name__ in ("ConfigCompositionException", "ConfigKeyError")
        return
    compose_module._BASES.clear()
    assert to_dict(compose(overrides, search=SearchPath())) == wanted  # built afresh
    assert to_dict(compose(overrides, search=SearchPath())) == wanted  # from the kept base


def test_values_of_one_compose_do_not_reach_the_next():
    first = compose(["train.steps=9", "+extra.mark=1"], search=SearchPath())
    first.train.steps = 123
    again = compose([], search=SearchPath())
    assert again.train.steps != 9 and again.train.steps != 123 and "mark" not in again.extra


@pytest.mark.parametrize("bad", [["train.steps=abc"], ["scheme.tp=2"], ["train.nosuch=1"], ["optim.lr=1e-3,3e-4"],
                                 ["model=nosuch"], ["+train.steps=3"]])
def test_a_bad_override_is_the_same_error_with_and_without_a_kept_base(bad):
    messages = []
    for _ in range(2):
        compose_module._BASES.clear()
        compose([], search=SearchPath())  # the defaults' base is kept now
        with pytest.raises(UserError) as err:
            compose(bad, search=SearchPath())
        messages.append(str(err.value))
    compose_module._BASES.clear()
    with pytest.raises(UserError) as fresh:
        compose(bad, search=SearchPath())
    assert messages[0] == messages[1] == str(fresh.value)
    assert "\n" not in messages[0]


def test_an_edited_yaml_composes_afresh(tmp_path):
    conf = tmp_path / "conf"
    (conf / "model").mkdir(parents=True)
    mine = conf / "model" / "transformer.yaml"
    mine.write_text("defaults:\n  - transformer_schema\n  - _self_\ndim: 48\n")
    search = SearchPath(config=(conf,), modules=(tmp_path,))
    assert compose(["train.steps=3"], search=search).model.kwargs["dim"] == 48
    mine.write_text("defaults:\n  - transformer_schema\n  - _self_\ndim: 64\n")  # same size, same second
    assert compose(["train.steps=3"], search=search).model.kwargs["dim"] == 64
    (conf / "cluster").mkdir()
    (conf / "cluster" / "mine.yaml").write_text("defaults:\n  - cluster_schema\n  - _self_\nkind: slurm\n")
    assert compose(["cluster=mine"], search=search).cluster.kind == "slurm"  # a new option is seen


def test_a_yaml_edited_in_a_hydra_searchpath_folder_composes_afresh(tmp_path):
    conf = tmp_path / "conf"
    (conf / "model").mkdir(parents=True)
    mine = conf / "model" / "mine.yaml"
    given = [f"hydra.searchpath=[file://{conf}]", "model=mine"]
    mine.write_text("defaults:\n  - transformer_schema\n  - _self_\ndim: 48\n")
    assert compose(given, search=SearchPath()).model.kwargs["dim"] == 48
    mine.write_text("defaults:\n  - transformer_schema\n  - _self_\ndim: 64\n")
    assert compose(given, search=SearchPath()).model.kwargs["dim"] == 64
