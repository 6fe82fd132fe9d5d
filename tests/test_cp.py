"""Context parallelism (dtk.parallel.cp) on 2 real gloo ranks, each piece against one process:
the head-tail slice, causal attention over gathered keys and values (forward and backward),
and the built-in transformer with the LM task (loss, gradients, evaluation sums)."""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from multirank import run_on_ranks

pytestmark = pytest.mark.dist
WORLD = 2


def _layout(rank: int, size: int):
    from dtk.parallel.cp import CpLayout

    return CpLayout(rank=rank, size=size, group=dist.group.WORLD)


def _attention(rank: int, size: int) -> dict:
    """Random q, k, v of a full sequence (the same on every rank): this rank's slice through
    CpLayout.attention against the slice of full causal attention, and the gradients."""
    from dtk.parallel.cp import shard_sequence

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 16, 8, generator=gen, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(2, 3, 16, 8, generator=gen)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    full.backward(grad_out)
    want_out = shard_sequence(full.detach(), cp=size, rank=rank, dim=2)
    want_grads = [shard_sequence(t.grad, cp=size, rank=rank, dim=2) for t in (q, k, v)]

    local = [shard_sequence(t.detach(), cp=size, rank=rank, dim=2).requires_grad_() for t in (q, k, v)]
    out = _layout(rank, size).attention(*local)
    out.backward(shard_sequence(grad_out, cp=size, rank=rank, dim=2))
    return {
        "shape": tuple(out.shape),
        "out": (out.detach() - want_out).abs().max().item(),
        "grads": [(t.grad - w).abs().max().item() for t, w in zip(local, want_grads, strict=True)],
        "grad_norms": [t.grad.norm().item() for t in local],
    }


def _model(rank: int, size: int) -> dict:
    """The transformer and the LM task under cp against one process: the step's loss, the
    gradient (the mean of the cp ranks', as FSDP over dp_shard x cp averages) and the
    evaluation's sum and count."""
    from dtk.models.transformer import build
    from dtk.parallel.cp import apply_cp
    from dtk.train.loss import TokenCrossEntropy
    from dtk.train.task import LmTask

    def fresh():
        torch.manual_seed(0)
        return build(vocab_size=64, dim=32, num_layers=2, num_heads=4, seq_len=32)

    tokens = torch.randint(0, 64, (3, 33), generator=torch.Generator().manual_seed(1))
    reference, model = fresh(), fresh()
    task = LmTask(TokenCrossEntropy())
    want = task(reference, tokens, torch.autocast("cpu", enabled=False))
    want.backward()
    layout = _layout(rank, size)
    apply_cp(model, layout=layout)
    cp_task = LmTask(TokenCrossEntropy(), cp=layout)
    inputs, targets = cp_task.split(tokens)
    loss = cp_task(model, tokens, torch.autocast("cpu", enabled=False))
    loss.backward()
    diffs = {}
    for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        g = p.grad.clone()
        dist.all_reduce(g)
        diffs[name] = (g / size - r.grad).abs().max().item()
    with torch.no_grad():
        want_sums, want_counts = task.sums(reference, tokens)
        sums, counts = cp_task.sums(model, tokens)
    return {
        "local_shapes": (tuple(inputs.shape), tuple(targets.shape)),
        "loss": loss.item(), "want": want.item(), "grads": diffs,
        "sum": (sums["loss"].item(), want_sums["loss"].item()), "count": (counts["loss"], want_counts["loss"]),
    }


def _checks(rank: int, size: int) -> dict:
    torch.manual_seed(1234 + rank)  # ranks whose own random state differs: nothing may depend on it
    out = {}
    for name, fn in {"attention": _attention, "model": _model}.items():
        try:
            out[name] = fn(rank, size)
        except Exception:
            out[name] = {"error": traceback.format_exc()}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_on_ranks(_checks, WORLD, tmp_path_factory.mktemp("cp"))


def per_rank(results: list[dict], name: str) -> list[dict]:
    for rank, r in enumerate(results):
        assert "error" not in r[name], f"rank {rank}:\n{r[name]['error']}"
    return [r[name] for r in results]


def test_head_tail_chunks_balance_the_causal_mask():
    from dtk.parallel.cp import chunk_positions, shard_sequence

    assert chunk_positions(16, 2, 0) == [range(0, 4), range(12, 16)]
    assert chunk_positions(16, 2, 1) == [range(4, 8), range(8, 12)]
    held = sorted(p for r in range(4) for chunk in chunk_positions(32, 4, r) for p in chunk)
    assert held == list(range(32))  # every position on exactly one rank
    # Causal (query, key) pairs per rank: equal for every rank with the head-tail split.
    pairs = [sum(p + 1 for chunk in chunk_positions(32, 4, r) for p in chunk) for r in range(4)]
    assert len(set(pairs)) == 1, pairs
    row = torch.arange(16).unsqueeze(0)
    assert shard_sequence(row, cp=2, rank=0).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]


def test_attention_over_gathered_keys_equals_full_causal_attention(results):
    for r in per_rank(results, "attention"):
        assert r["shape"] == (2, 3, 16 // WORLD, 8)
        assert r["out"] < 1e-6
        assert max(r["grads"]) < 1e-6, r["grads"]
        assert min(r["grad_norms"]) > 0  # the gradients compared are not all zero


def _attention_only(rank: int, size: int) -> dict:
    try:
        return _attention(rank, size)
    except Exception:
        return {"error": traceback.format_exc()}


def test_attention_on_four_cp_ranks_equals_full_causal_attention(tmp_path):
    """cp=4: 8 chunks, each rank's head and tail at other offsets than with 2."""
    for rank, r in enumerate(run_on_ranks(_attention_only, 4, tmp_path)):
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
        assert r["shape"] == (2, 3, 16 // 4, 8)
        assert r["out"] < 1e-6
        assert max(r["grads"]) < 1e-6, r["grads"]


def test_transformer_under_cp_gives_the_one_process_loss_and_gradients(results):
    for r in per_rank(results, "model"):
        assert r["local_shapes"] == ((3, 32 // WORLD), (3, 32 // WORLD))
        assert r["loss"] == pytest.approx(r["want"], rel=1e-6)
        assert r["grads"] and max(r["grads"].values()) < 1e-6, r["grads"]
        assert r["sum"][0] == pytest.approx(r["sum"][1], rel=1e-6)
        assert r["count"][0] == r["count"][1] == 3 * 32
