"""Expert parallelism (dtk.parallel.ep) on real gloo ranks against one process: the built-in
MoE transformer's loss and every parameter's gradient after the experts are split over ep
ranks (tokens dispatched by all-to-all) and FSDP-sharded over the rest, then three Adam steps.

The all-to-all's backward and FSDP's divide factor are what make the experts' gradients
those of the whole batch: a wrong factor or a missing return exchange fails the gradient
comparison, not only the loss.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from multirank import run_on_ranks

pytestmark = [pytest.mark.dist]

MOE = dict(vocab_size=64, dim=32, num_layers=2, num_heads=4, seq_len=16, num_experts=4, top_k=2,
           aux_loss_weight=0.01)
BATCH, STEPS = 8, 3


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, MOE["vocab_size"], (BATCH, MOE["seq_len"] + 1), generator=g)


def _loss(model, rows):
    import torch.nn.functional as F

    from dtk.models.moe import aux_loss

    logits = model(rows[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
    extra = aux_loss(model)
    return loss + extra if extra is not None else loss


def _model():
    from dtk.models.transformer import build

    with torch.device("meta"):
        model = build(**MOE)
    return model


def _train(model, rows_of, reduce) -> dict:
    """STEPS Adam steps; the loss of each (reduced over ranks) and the first step's gradients."""
    from torch.distributed.tensor import DTensor

    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses, grads = [], {}
    for step in range(STEPS):
        loss = _loss(model, rows_of(_batch(step)))
        loss.backward()
        losses.append(reduce(loss.detach()))
        if step == 0:
            grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                     for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads}


def _reference() -> dict:
    from dtk.models.build import materialize

    model = _model()
    materialize([model], model_cfg=None, device=torch.device("cpu"), seed=0)  # type: ignore[arg-type]
    return _train(model, lambda rows: rows, lambda t: float(t))


def _ranks(rank: int, world: int, ep: int) -> dict:
    from dtk.mesh.mesh import build_mesh
    from dtk.models.build import materialize
    from dtk.parallel.ep import apply_ep
    from dtk.parallel.fsdp import apply_fsdp
    from dtk.plan.degrees import Degrees

    mesh = build_mesh(Degrees(dp_replicate=1, pp=1, dp_shard=world, tp=1, ep=ep), "cpu")
    model = _model()
    apply_ep(model, mesh=mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, reshard_after_forward=True,
             local_replicas=False)
    apply_fsdp(model, mesh=mesh.fsdp_shard, wrap_classes=("Block",), reshard_after_forward=True,
               param_dtype=torch.float32, reduce_dtype=torch.float32, cpu_offload=False, device=torch.device("cpu"))
    materialize([model], model_cfg=None, device=torch.device("cpu"), seed=0)  # type: ignore[arg-type]
    share = BATCH // world

    def mean(t: torch.Tensor) -> float:
        dist.all_reduce(t)
        return float(t) / world

    return _train(model, lambda rows: rows[rank * share:(rank + 1) * share], mean)


@pytest.mark.slow
@pytest.mark.parametrize("world,ep", [(2, 2), (4, 2), (4, 4)])
def test_ep_matches_one_process(world, ep, tmp_path):
    want = _reference()
    results = run_on_ranks(_ranks, world, tmp_path, ep)
    for got in results:
        assert got["losses"] == pytest.approx(want["losses"], abs=1e-5)
        assert got["grads"].keys() == want["grads"].keys()
        for name, grad in want["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
