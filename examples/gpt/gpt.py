"""A GPT-2-style language model of this project's own, plain PyTorch, and the text it learns.

    python gpt.py corpus              writes data/stdlib.txt: Python's standard library sources

The model is written the way such models usually are: the output head shares the token
embedding's weight (`self.head.weight = self.wte.weight`), the constructor prints its
parameter count, and `forward(idx, targets)` returns `(logits, loss)`. dtk runs it with
`task.form=model` (conf/task/gpt.yaml): `lm_loss(model, batch)` calls the forward with
the targets and returns its loss.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

# The corpus: every module of the standard library's top folder, in name order, up to this
# many characters. It exists wherever Python does; no download.
CORPUS_CHARS = 1_500_000


class SelfAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.num_heads, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, num_heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, dim: int, num_layers: int, num_heads: int) -> None:
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, dim)
        self.wpe = nn.Embedding(block_size, dim)
        self.blocks = nn.ModuleList(Block(dim, num_heads) for _ in range(num_layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self.head.weight = self.wte.weight  # tied: one (vocab_size, dim) parameter
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * num_layers))
        print(f"number of parameters: {sum(p.numel() for p in self.parameters()) / 1e6:.2f}M")

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
        return logits, loss


def build(vocab_size: int = 128, seq_len: int = 64, dim: int = 128, num_layers: int = 4, num_heads: int = 4) -> GPT:
    return GPT(vocab_size, seq_len, dim, num_layers, num_heads)


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """task.form=model: a batch is (batch, seq_len + 1) token ids; the model scores itself."""
    _, loss = model(batch[:, :-1], batch[:, 1:])
    return loss


def write_corpus(out: Path) -> None:
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8")
        parts.append(text)
        size += len(text)
        if size >= CORPUS_CHARS:
            break
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(parts)[:CORPUS_CHARS], encoding="utf-8")
    print(f"{out}: {CORPUS_CHARS} characters from {len(parts)} modules of {stdlib}")


if __name__ == "__main__":
    if sys.argv[1:] != ["corpus"]:
        sys.exit("usage: python gpt.py corpus")
    write_corpus(Path("data/stdlib.txt"))
