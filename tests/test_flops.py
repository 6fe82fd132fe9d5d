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


def test_logged_mfu_of_the_builtin_transformer_is_the_analytic_formula(tmp_path):
    """The record a worker writes: tokens/s from the step time, FLOPs from the formula by hand,
    over the device count and the peak."""
    from types import SimpleNamespace

    from dtk.common.rundir import read_jsonl
    from dtk.train.metrics import MetricsLog

    per_token = flops_per_token(model(BUILTIN_TARGET))
    log = MetricsLog(tmp_path / "m.jsonl", world_size=4, restart=0, global_batch=64, tokens_per_step=64 * 96,
                     total_steps=1, log_every=1, samples_per_epoch=None, flops_per_token=per_token, peak_tflops=989.5)
    log.step(1, SimpleNamespace(loss=2.0, lr=1e-3, grad_norm=1.0, step_time_s=0.25, data_wait_s=0.0, batch_hash="x"))
    (r,) = read_jsonl(tmp_path / "m.jsonl")
    weights = 3 * (4 * 128 * 128 + 3 * 128 * 352) + 512 * 128
    by_hand = (64 * 96 / 0.25) * (6 * weights + 12 * 3 * 128 * 96) / 4 / 1e12  # TFLOP/s per device
    assert r["tokens_per_s"] == 64 * 96 / 0.25 and r["samples_per_s"] == 256.0
    assert r["tflops"] == pytest.approx(by_hand, abs=1e-4)
    assert r["mfu"] == pytest.approx(by_hand / 989.5, abs=1e-5)


@pytest.mark.parametrize("device_name, table_name", [
    ("NVIDIA H100 80GB HBM3", "h100-80gb"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H100 NVL", "h100-nvl"),
    ("NVIDIA H200", "h200"), ("NVIDIA H200 NVL", "h200-nvl"), ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("NVIDIA L40S", "l40s"), ("NVIDIA L4", "l4"), ("NVIDIA L40", None),
    ("NVIDIA B200", "b200"), ("AMD Instinct MI300X", "mi300x"), ("Tesla V100-SXM2-32GB", None),
    ("NVIDIA A800-SXM4-80GB", "a800"), ("NVIDIA H800", "h800"), ("NVIDIA GH200 480GB", "gh200"),
    ("AMD Instinct MI250X/MI250", "mi250x"),
])
def test_device_names_find_their_row_of_the_accelerator_table(device_name, table_name):
    from dtk.plan.accelerators import ACCELERATORS, accelerator_of

    assert accelerator_of(device_name) == table_name
    assert table_name is None or table_name in ACCELERATORS


def test_the_peak_comes_from_the_override_and_none_on_the_cpu():
    import torch

    from dtk.train.flops import matmul_dtype_name, peak_tflops

    cpu = torch.device("cpu")
    assert peak_tflops(override=400.0, accelerator="h100-80gb", device=cpu, dtype=torch.bfloat16) == (
        400.0, "cluster.peak_tflops")
    assert peak_tflops(override=None, accelerator="h100-80gb", device=cpu, dtype=torch.bfloat16)[0] is None
    gpu = torch.device("cuda")  # only its type is read when cluster.accelerator names the device
    assert peak_tflops(override=None, accelerator="h100-80gb", device=gpu, dtype=torch.bfloat16)[0] == 989.5
    assert peak_tflops(override=None, accelerator="a100-80gb", device=gpu, dtype=torch.float16)[0] == 312.0
    assert matmul_dtype_name(torch.bfloat16) == "bfloat16" and matmul_dtype_name(torch.float16) == "float16"
