"""How long a long evaluation takes: the attention cost model, measured rates, and the projected times.

A scorer call (a batch of rows of length L) is timed; a length not yet measured is projected from the
nearest measured one by the cost model of a row:

    t(L) = t(L0) * cost(L) / cost(L0),   cost(L) = L * (dense + per_key * keys(L))

`dense`: the matmul flops of one token (2 x the parameters it multiplies: all but the embedding lookup);
`per_key`: the flops of one query-key pair summed over layers and heads (2 * (head_dim + v_head_dim) *
n_heads * n_layers: QK and PV); `keys(L)`: the keys one query reads in the three branches, as the
implementation computes them. The kernels skip masked tiles (info.keys_per_query, the causal means); the
XLA path (the CPU) scores every compressed token of the row for every query, gathers n blocks and reads a
window chunk of C + w - 1 keys.

Flops are a rough guide where the quadratic parts (softmax, block scores, top-n) cost more per flop than
the matmuls, so a length's projection from another length says so, and is replaced by the length's own
measured rate once its first batch is done (`Rates.per_batch` says which it used); once two lengths are
measured, the cost ratio is raised to the power they show (`Rates.exponent`).
"""

from __future__ import annotations

import math
from typing import Iterable

from nsa_jax.config import ModelConfig
from nsa_jax.info import keys_per_query
from nsa_jax.kernels import plan_kernels
from nsa_jax.kernels.xla import num_compressed
from nsa_jax.progress_text import fmt_seconds


def query_keys(cfg: ModelConfig, L: int, backend: str) -> float:
    """Keys one query reads on average in a row of L tokens, as the implementation on `backend` computes them."""
    a = cfg.nsa
    if cfg.attention == "dense":  # the window branch's kernel over a window as long as the row (nsa/dense.py)
        w = min(cfg.dense_window or L, L)
        if plan_kernels(a, L, backend).win != "xla":
            return (w + 1) / 2 if w == L else float(w)  # causal: the mean over positions; a window: about w
        return float(min(a.query_chunk, L) + w - 1)
    if plan_kernels(a, L, backend).cmp != "xla":
        return keys_per_query(cfg, L)["nsa_total"]
    keys = float(max(1, num_compressed(L, a.l, a.d)))  # every compressed token, masked, for every query
    if "slc" in a.branches:
        keys += a.n * a.lp
    if "win" in a.branches:
        keys += min(a.query_chunk, L) + a.w - 1
    return keys


class CostModel:
    """cost(L): the flops of scoring one row of L tokens (module docstring)."""

    def __init__(self, cfg: ModelConfig, n_params: int, backend: str):
        self.cfg, self.backend = cfg, backend
        embedding = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model  # a lookup, not a matmul
        self.dense = 2.0 * (n_params - embedding)
        self.per_key = 2.0 * (cfg.head_dim + cfg.v_head_dim) * cfg.n_heads * cfg.n_layers

    def __call__(self, L: int) -> float:
        return L * (self.dense + self.per_key * query_keys(self.cfg, L, self.backend))


class Rates:
    """Measured seconds per batch by length, and the projected seconds of a batch at any length."""

    def __init__(self, cost):
        self.cost = cost
        self.measured: dict[int, float] = {}

    def add(self, L: int, seconds: float) -> None:
        """A batch at L took `seconds` (the first one measured at L stays: later batches run as fast)."""
        self.measured.setdefault(L, seconds)

    def per_batch(self, L: int) -> tuple[float, str]:
        """(seconds a batch at L, how that is known); (nan, '') when nothing is measured."""
        if L in self.measured:
            return self.measured[L], "measured"
        if not self.measured:
            return math.nan, ""
        # The nearest measured length in the ratio of costs: the longest below L, else the shortest above.
        below = [m for m in self.measured if m < L]
        ref = max(below) if below else min(self.measured)
        t = self.measured[ref] * (self.cost(L) / self.cost(ref)) ** self.exponent()
        how = f"scaled from L={ref:,}'s {fmt_seconds(self.measured[ref])} a batch by the attention cost model"
        return t, how

    def exponent(self) -> float:
        """p in t ~ cost^p: 1 with one measured length; fitted to the two longest measured ones with two or
        more (never below 1). Where the quadratic parts cost more per flop than the matmuls (the CPU),
        time grows faster than the flops, and a projection with p = 1 came out short by up to 3x."""
        if len(self.measured) < 2:
            return 1.0
        (L1, t1), (L2, t2) = sorted(self.measured.items())[-2:]
        ratio = self.cost(L2) / self.cost(L1)
        if ratio <= 1.0 or t1 <= 0 or t2 <= 0:
            return 1.0
        return max(1.0, math.log(t2 / t1) / math.log(ratio))

    def total(self, batches_by_length: Iterable[tuple[int, int]]) -> float:
        """Projected seconds of `(L, batches)` pairs; nan when nothing is measured."""
        return sum(n * self.per_batch(L)[0] for L, n in batches_by_length)
