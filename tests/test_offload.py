"""FSDP2 CPU offload, checked on the CPU: the parameter shards are materialized in host
memory (FSDP's own validation accepts them) and the buffers on the device, and the step
profiler puts a post-accumulate-grad hook on one parameter only, since FSDP copies the
gradient of every hooked parameter to the host blocking.

The CPU stands in for host memory; the meta device stands in for the accelerator, so that
"on the device" and "on the host" are told apart on a machine without a GPU."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

from dtk.parallel.fsdp import materialize_offloaded
from dtk.train.phases import PhaseTimer
from multirank import run_on_ranks

ACCELERATOR = torch.device("meta")  # any device that is not the CPU


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 2.0))  # like a rotary table

    def forward(self, x):
        return self.linear(x) * self.scale


def sharded_with_offload() -> nn.Module:
    with torch.device("meta"):
        model = nn.Sequential(Block(), Block())
    mesh = init_device_mesh("cpu", (1,))
    policy = CPUOffloadPolicy(pin_memory=False)
    for block in model:
        fully_shard(block, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    return model


def fill(parts: list[nn.Module], on: torch.device) -> None:
    """What dtk.models.build.materialize does first: storage on `on`, then values."""
    for part in parts:
        part.to_empty(device=on)
        for name, buffer in part.named_buffers():
            buffer.fill_(2.0 if name.endswith("scale") else 0.0)


def validation_error(model: nn.Module) -> str | None:
    """FSDP's own check of offloaded parameters (what its first forward runs)."""
    try:
        for module in model.modules():
            state = getattr(module, "_get_fsdp_state", None)
            if state is not None and state()._fsdp_param_group is not None:
                state()._fsdp_param_group._validate_cpu_offload_params()
    except RuntimeError as exc:
        return str(exc)
    return None


def check_offload(rank: int, world: int) -> dict:
    offloaded = sharded_with_offload()
    materialize_offloaded([offloaded], fill, device=ACCELERATOR)
    on_device = sharded_with_offload()
    fill([on_device], ACCELERATOR)  # the old way: to_empty(device=the accelerator)
    timer = PhaseTimer(device=torch.device("cpu"))
    params = list(offloaded.parameters())
    timer.watch_gradients(params, one=True)
    return {
        "param_devices": {p.to_local().device.type for p in offloaded.parameters()},
        "buffer_devices": {b.device.type for b in offloaded.buffers()},
        "offloaded_error": validation_error(offloaded),
        "on_device_error": validation_error(on_device),
        "hooked": [bool(getattr(p, "_post_accumulate_grad_hooks", None)) for p in params],
    }


def test_offloaded_shards_on_the_host_buffers_on_the_device_and_one_gradient_hook(tmp_path):
    [result] = run_on_ranks(check_offload, 1, tmp_path)
    assert result["param_devices"] == {"cpu"}
    assert result["buffer_devices"] == {ACCELERATOR.type}
    assert result["offloaded_error"] is None
    assert "FSDP parameters should be materialized on CPU" in result["on_device_error"]
    # FSDP makes the host copy of a hooked parameter's gradient blocking: one hook, on the
    # first parameter (the root unit's, reduced last).
    assert result["hooked"] == [True] + [False] * (len(result["hooked"]) - 1)


def test_the_trainer_hooks_one_parameter_when_a_gpu_step_keeps_parameters_on_the_host():
    from types import SimpleNamespace

    from dtk.train.trainer import Trainer

    def hooked(step_device: str) -> list[bool]:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))  # parameters in host memory
        batches = SimpleNamespace(device=torch.device(step_device))  # where the step runs
        Trainer(model=model, optimizer=[], scheduler=None, batches=batches, task=None, grad_clip=0.0, mesh=None,
                timer=PhaseTimer(device=torch.device("cpu")))
        return [bool(getattr(p, "_post_accumulate_grad_hooks", None)) for p in model.parameters()]

    assert hooked("cuda") == [True, False, False, False]  # FSDP's CPU offload on a GPU
    assert hooked("cpu") == [True] * 4  # a CPU run: every gradient counted
