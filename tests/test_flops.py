"""Model FLOPs per token and MFU: the analytic formula of the built-in transformer against
torch's FLOP counter on the real module, and the MFU arithmetic."""

from __future__ import annotations

import pytest

from dtk.config.convert import model_config
from dtk.models.transformer import DEFAULTS, build
from dtk.train.flops import BUILTIN_TARGET, achieved, counted_flops_per_token, flops_per_token

SHAPE = {"vocab_size": 512, "dim": 128, "num_layers": 3, "num_heads": 4, "ffn_hidden": 0, "seq_len": 96}


def model(target: str):
    return model_config({"_target_": target, **DEFAULTS, **SHAPE})


def test_analytic_formula_matches_the_flop_counter_for_a_known_shape():
    analytic = flops_per_token(model(BUILTIN_TARGET))
    # By hand: hidden = 16 * ceil(8 * 128 / 3 / 16) = 352; weights 3 * (4 * 128^2 + 3 * 128 * 352) + 512 * 128.
    weights = 3 * (4 * 128 * 128 + 3 * 128 * 352) + 512 * 128
    assert analytic == 6 * weights + 12 * 3 * 128 * 96
    counted = counted_flops_per_token(lambda: build(**SHAPE), SHAPE["seq_len"], SHAPE["vocab_size"])
    assert counted == pytest.approx(analytic, rel=1e-9)


def test_a_user_model_is_counted():
    cfg = model("dtk.models.transformer.build")  # the factory by another path would be counted
    user = model("dtk.models.transformer.Transformer")  # not the built-in factory: counted
    assert flops_per_token(user) == pytest.approx(flops_per_token(cfg), rel=1e-9)


def test_mfu_is_achieved_over_peak_per_device():
    # 8 devices at 1e6 tokens/s on a 1e9-FLOP/token model: 125 TFLOP/s each; of 989.5 peak.
    out = achieved(tokens_per_s=1e6, flops_per_token=1e9, num_devices=8, peak_tflops=989.5)
    assert out["tflops"] == 125.0 and out["mfu"] == pytest.approx(125.0 / 989.5, abs=1e-5)
    assert "mfu" not in achieved(tokens_per_s=1e6, flops_per_token=1e9, num_devices=8, peak_tflops=None)
