"""Small configs and comparison helpers shared by the tests."""

from __future__ import annotations

import numpy as np

from nsa_jax.config import load_config


def tiny_model_cfg(T_hint: int = 64, G: int = 2, K: int = 1, **nsa):
    """A model config small enough for per-token references."""
    base = {"l": 8, "d": 4, "lp": 8, "n": 3, "w": 12, "cmp_mlp_hidden": 16, "gate_hidden": 8, "query_chunk": 16}
    base.update(nsa)
    overrides = [
        "model.vocab_size=32",
        "model.d_model=24",
        "model.n_layers=2",
        f"model.n_heads={G * K}",
        f"model.n_kv_heads={K}",
        "model.head_dim=8",
        "model.v_head_dim=8",
        "model.d_ff=32",
        "model.init_std=0.3",
        f"train.seq_len={T_hint}",
    ] + [f"model.nsa.{k}={v if not isinstance(v, (list, tuple)) else ','.join(v)}" for k, v in base.items()]
    return load_config(None, overrides).model


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
