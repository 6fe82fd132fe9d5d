"""The same training without dtk: one process, plain PyTorch, the model of gpt.py.

    python plain.py --data data/stdlib --steps 200 --seed 0 --out plain-0.jsonl

Same model and initial values (torch.manual_seed(seed) before the constructor, as dtk
builds it), the same batches (the dataset's training shards; global batch k is positions
[k*B, (k+1)*B) of the permutation numpy draws from (seed, epoch)), the same AdamW (weight
decay on matrices only), warmup and cosine schedule, gradient clipping, and the same
validation loss (the first eval_samples of the validation shards, mean over every target
token). One line per step: step, loss, tokens/s of the step; `val_loss` every --eval-every.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import h5py
import numpy as np
import torch

from gpt import build


def read_split(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    manifest = json.loads((folder / "manifest.json").read_text())
    val_names = set(manifest.get("val_shards", []))

    def rows(names: list[str]) -> np.ndarray:
        parts = []
        for name in names:
            with h5py.File(folder / name, "r") as f:
                parts.append(f["tokens"][:].astype(np.int64))
        return np.concatenate(parts)

    names = [s["file"] for s in manifest["shards"]]
    return rows([n for n in names if n not in val_names]), rows([n for n in names if n in val_names])


def batch_ids(step: int, batch: int, n: int, seed: int) -> np.ndarray:
    start = step * batch
    epoch, i = divmod(start, n)
    perm = np.random.default_rng([seed, epoch]).permutation(n)
    if i + batch <= n:
        return perm[i : i + batch]
    rest = np.random.default_rng([seed, epoch + 1]).permutation(n)
    return np.concatenate([perm[i:], rest[: batch - (n - i)]])


def lr_at(step: int, *, lr: float, warmup: int, total: int, min_ratio: float) -> float:
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model: torch.nn.Module, val: np.ndarray, *, samples: int, batch: int) -> float:
    model.eval()
    n = (min(samples, len(val)) // batch) * batch
    total = 0.0
    for start in range(0, n, batch):
        rows = torch.from_numpy(val[start : start + batch])
        _, loss = model(rows[:, :-1], rows[:, 1:])
        total += float(loss) * len(rows)
    model.train()
    return total / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=Path("data/stdlib"))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-samples", type=int, default=512)
    p.add_argument("--vocab-size", type=int, default=128)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    train, val = read_split(args.data)
    torch.manual_seed(args.seed)
    model = build(vocab_size=args.vocab_size, seq_len=train.shape[1] - 1)
    params = list(model.parameters())
    groups = [{"params": [q for q in params if q.ndim >= 2], "weight_decay": 0.1},
              {"params": [q for q in params if q.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    with open(args.out, "w") as log:
        for step in range(args.steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, lr=args.lr, warmup=args.warmup, total=args.steps, min_ratio=0.1)
            start = time.perf_counter()
            rows = torch.from_numpy(train[batch_ids(step, args.batch, len(train), args.seed)])
            _, loss = model(rows[:, :-1], rows[:, 1:])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            seconds = time.perf_counter() - start
            record = {"step": step + 1, "loss": loss.item(), "tokens_per_s": rows[:, :-1].numel() / seconds}
            if args.eval_every and ((step + 1) % args.eval_every == 0 or step + 1 == args.steps):
                record["val_loss"] = evaluate(model, val, samples=args.eval_samples, batch=args.batch)
            log.write(json.dumps(record) + "\n")
            log.flush()


if __name__ == "__main__":
    main()
