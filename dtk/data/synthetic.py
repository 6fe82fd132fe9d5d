"""Synthetic token data: sequences from a fixed random Markov chain.

Each token has `branching` likely successors, so the data has far less entropy than
uniform noise and a model's loss visibly falls within a few hundred steps. The whole
table is generated from `seed`, identically on every rank and every restart. The
validation split is VALIDATION_SAMPLES more sequences of the same chain.
"""

from __future__ import annotations

import numpy as np

from dtk.common.errors import UserError

VALIDATION_SAMPLES = 512


class SyntheticTokens:
    def __init__(self, *, num_samples: int, seq_len: int, vocab_size: int, seed: int, branching: int) -> None:
        if branching < 1:
            raise UserError(f"data.branching={branching}: expected a positive integer")
        rng = np.random.default_rng(seed)
        self.successors = rng.integers(0, vocab_size, size=(vocab_size, branching))
        self.probs = rng.dirichlet(np.ones(branching), size=vocab_size).cumsum(axis=1)
        self.seq_len, self.vocab_size, self.seed = seq_len, vocab_size, seed
        self.tokens = self._sample(rng, num_samples)
        self.version = f"synthetic-{seed}-{num_samples}x{seq_len}-v{vocab_size}-b{branching}"

    def _sample(self, rng: np.random.Generator, num_samples: int) -> np.ndarray:
        branching = self.successors.shape[1]
        tokens = np.empty((num_samples, self.seq_len + 1), dtype=np.int64)
        tokens[:, 0] = rng.integers(0, self.vocab_size, size=num_samples)
        for t in range(self.seq_len):
            u = rng.random(num_samples)[:, None]
            pick = (u > self.probs[tokens[:, t]]).sum(axis=1).clip(max=branching - 1)
            tokens[:, t + 1] = self.successors[tokens[:, t], pick]
        return tokens

    def validation(self, num_samples: int = VALIDATION_SAMPLES) -> SyntheticTokens:
        """Held-out samples: the same chain, sequences drawn from a stream of their own."""
        val = object.__new__(SyntheticTokens)
        val.successors, val.probs = self.successors, self.probs
        val.seq_len, val.vocab_size, val.seed = self.seq_len, self.vocab_size, self.seed
        val.tokens = val._sample(np.random.default_rng([self.seed, 1]), num_samples)
        val.version = f"{self.version}-val{num_samples}"
        return val

    def __len__(self) -> int:
        return len(self.tokens)

    def get(self, ids: np.ndarray) -> np.ndarray:
        """Rows of `seq_len + 1` tokens: inputs are [:-1], targets [1:]."""
        return self.tokens[ids]
