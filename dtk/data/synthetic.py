"""Synthetic token data: sequences from a fixed random Markov chain.

Each token has `branching` likely successors, so the data has far less entropy than
uniform noise and a model's loss visibly falls within a few hundred steps. The whole
table is generated from `seed`, identically on every rank and every restart.
"""

from __future__ import annotations

import numpy as np


class SyntheticTokens:
    def __init__(self, *, num_samples: int, seq_len: int, vocab_size: int, seed: int, branching: int) -> None:
        if branching < 1:
            raise ValueError(f"data.branching={branching}: expected a positive integer")
        rng = np.random.default_rng(seed)
        successors = rng.integers(0, vocab_size, size=(vocab_size, branching))
        probs = rng.dirichlet(np.ones(branching), size=vocab_size).cumsum(axis=1)
        tokens = np.empty((num_samples, seq_len + 1), dtype=np.int64)
        tokens[:, 0] = rng.integers(0, vocab_size, size=num_samples)
        for t in range(seq_len):
            u = rng.random(num_samples)[:, None]
            pick = (u > probs[tokens[:, t]]).sum(axis=1).clip(max=branching - 1)
            tokens[:, t + 1] = successors[tokens[:, t], pick]
        self.tokens = tokens
        self.version = f"synthetic-{seed}-{num_samples}x{seq_len}-v{vocab_size}-b{branching}"

    def __len__(self) -> int:
        return len(self.tokens)

    def get(self, ids: np.ndarray) -> np.ndarray:
        """Rows of `seq_len + 1` tokens: inputs are [:-1], targets [1:]."""
        return self.tokens[ids]
