"""Interpolated bigram baseline over token ids.

p(w | v) = lam * c(v, w) / c(v) + (1 - lam) * p_uni(w),  p_uni(w) = (c(w) + 1) / (N + V)
(add-one unigram, so every token has mass). lam is tuned on held-out tokens over a grid
(the model card states the chosen value). Counts come from the training split only.
"""
from __future__ import annotations

import numpy as np

LAMBDAS = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95)


class Bigram:
    def __init__(self, vocab_size: int):
        self.V = vocab_size
        self.pair = np.zeros((vocab_size, vocab_size), dtype=np.float64)
        self.uni = np.zeros(vocab_size, dtype=np.float64)

    def add(self, ids: np.ndarray):
        ids = ids.astype(np.int64)
        np.add.at(self.uni, ids, 1)
        flat = ids[:-1] * self.V + ids[1:]
        self.pair += np.bincount(flat, minlength=self.V * self.V).reshape(self.V, self.V)
        return self

    def nll(self, ids: np.ndarray, lam: float) -> float:
        """Mean negative log-likelihood (nats/token) of ids[1:] given ids[:-1]."""
        ids = ids.astype(np.int64)
        v, w = ids[:-1], ids[1:]
        ctx = self.pair.sum(1)
        p_uni = (self.uni[w] + 1) / (self.uni.sum() + self.V)
        with np.errstate(invalid="ignore", divide="ignore"):
            p_bi = np.where(ctx[v] > 0, self.pair[v, w] / np.maximum(ctx[v], 1), 0.0)
        return float(-np.log(lam * p_bi + (1 - lam) * p_uni).mean())

    def tune(self, ids: np.ndarray) -> float:
        return min(LAMBDAS, key=lambda l: self.nll(ids, l))
