"""The model as a scorer: tokens_BxT1 -> (nll_BxT, hit_BxT) through NSALM's own forward.

One program per row length L, compiled ahead of time for a fixed batch of rows
(`prepare(L)`), so its memory is known before anything runs: the compiled total
(nsa_jax/ops/memory.py `compiled_memory`, per device) is checked against the device's
memory (`device_memory_limit`, or a given limit) and an L that does not fit raises
`WontFitError` naming the figures.
The forward is the training forward with the inference settings (scanned layers, no
remat): Pallas kernels on a GPU, the XLA path elsewhere, whose attention runs in
query chunks of `model.nsa.query_chunk`, so long rows are processed chunk by chunk. The
logits are made SCORE_CHUNK positions at a time from the final hidden states (each chunk's nll
and argmax kept, its logits dropped): [B, SCORE_CHUNK, V] at once instead of [B, L, V], which
for a 128k vocabulary at 32k tokens is 16 GiB a row.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nsa_jax.config import ModelConfig
from nsa_jax.inference.decode import inference_config
from nsa_jax.kernels import plan_kernels
from nsa_jax.model import NSALM, rows_nll
from nsa_jax.ops.memory import WontFitError, compiled_memory, device_memory_limit

SCORE_CHUNK = 2048  # positions whose logits exist at once


def scored_chunks(cfg: ModelConfig, params, x_BxTxD, targets_BxT, chunk: int = SCORE_CHUNK):
    """(nll_BxT fp32, hit_BxT bool) of the final-normed hidden states, the logits made `chunk`
    positions at a time (model.rows_nll)."""
    return rows_nll(cfg, params, x_BxTxD, targets_BxT, chunk, hits=True)


def make_score_fn(cfg: ModelConfig, kernel_fallback: frozenset = frozenset(), chunk: int = SCORE_CHUNK):
    """(params, tokens_BxT1) -> (nll_BxT fp32, hit_BxT bool) for targets tokens[:, 1:].

    `kernel_fallback`: NSA branches to run on XLA whatever the backend (a training run's kernel
    guard findings, kernels/guard.py), at every row length. `chunk`: positions whose logits exist
    at once (scored_chunks).
    """
    cfg = inference_config(cfg)

    def score(params, tokens_BxT1):
        inputs_BxT, targets_BxT = tokens_BxT1[:, :-1], tokens_BxT1[:, 1:]
        plan = plan_kernels(cfg.nsa, inputs_BxT.shape[1], jax.default_backend(), kernel_fallback, backward=False)
        x_BxTxD = NSALM(cfg, kernels=plan).apply({"params": params}, inputs_BxT, head=False)
        return scored_chunks(cfg, params, x_BxTxD, targets_BxT, chunk)

    return score


def _gb(n: int) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 1e7 else f"{n / 1e6:,.2f} MB"


class ModelScorer:
    """Scores batches of `batch` rows with the model; compiles and checks memory once per L."""

    def __init__(
        self,
        cfg: ModelConfig,
        params: Any,
        batch: int,
        device_memory: int | None = None,
        kernel_fallback: frozenset = frozenset(),
    ):
        self.cfg, self.batch = cfg, batch
        self.device = jax.local_devices()[0]
        self.params = jax.device_put(params, self.device)
        self.fn = jax.jit(make_score_fn(cfg, kernel_fallback))
        if device_memory is None:
            self.limit, self.limit_source = device_memory_limit(self.device)
        else:
            self.limit, self.limit_source = device_memory, "given limit"
        self.compiled: dict[int, Any] = {}
        self.bytes: dict[int, int | None] = {}

    def prepare(self, L: int) -> int | None:
        """Compiles the program for rows of L + 1 tokens; its bytes per device, or WontFitError."""
        if L in self.compiled:
            return self.bytes[L]
        tokens = jax.ShapeDtypeStruct((self.batch, L + 1), jnp.int32)
        params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self.params)
        compiled = self.fn.lower(params, tokens).compile()
        mem = compiled_memory(compiled)
        need = mem["total"] if mem else None
        if need is not None and self.limit is not None and need > self.limit:
            raise WontFitError(
                f"L={L} needs {_gb(need)} per device for a batch of {self.batch} rows (compiled forward) and the "
                f"device has {_gb(self.limit)} ({self.limit_source}); drop L={L} from --lengths or lower --batch-size"
            )
        self.compiled[L], self.bytes[L] = compiled, need
        return need

    def __call__(self, tokens_BxT1: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(nll_BxT, hit_BxT) numpy for exactly `batch` rows of one prepared length."""
        tokens_BxT1 = np.asarray(tokens_BxT1, np.int32)
        L = tokens_BxT1.shape[1] - 1
        if tokens_BxT1.shape[0] != self.batch:
            raise ValueError(f"the scorer takes {self.batch} rows at a time, got {tokens_BxT1.shape[0]}")
        self.prepare(L)
        nll, hit = self.compiled[L](self.params, jax.device_put(tokens_BxT1, self.device))
        return np.asarray(nll), np.asarray(hit)
