"""The NSA layer's statistics for the training logs: gate means and entropy, the share of selected
blocks beyond the window, the compressed against the selection keys' and values' scale.

The layer sows `aux_stat_sums` (two reductions per layer, whatever the number of statistics);
the train step adds them over micro-batches and devices and `aux_stats` finishes them outside
the layers (nsa_jax/step/loss.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from nsa_jax.config import ModelConfig


def aux_stat_sums(
    g_BxTxHx3: jax.Array,
    idx_BxTxKxN: jax.Array,
    kc_BxTcxKxDk: jax.Array,
    vc_BxTcxKxDv: jax.Array,
    k_slc_BxTxKxDk: jax.Array,
    v_slc_BxTxKxDv: jax.Array,
    lp: int,
    w: int,
    t_T: jax.Array | None = None,
    real_T: jax.Array | None = None,
    real_Tc: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """The sums the logged statistics are made of (aux_stats), in two reductions.

    "tokens" [1 + 4H + 2KN + K(Dk + Dv)]: over the B x T tokens, the token count, the
    gates [H, 3], the gate entropies [H], the selected blocks beyond the window and all
    selected blocks [K, N], the squared selection keys and values. "cmp" [Dk + Dv + 1]:
    over the compressed tokens' B x Tc x K rows, squared keys, values, and the row count.
    One reduction for each, whatever the number of statistics; aux_stats finishes them
    outside the layers (a kernel per layer and micro-batch for each statistic otherwise).
    Under context parallelism (a device's share of the sums, added over `seq` by the
    train step): `t_T` the tokens' positions (default 0..T-1), `real_T` / `real_Tc` which
    tokens and compressed tokens count (padding and duplicates do not).
    """
    B, T = g_BxTxHx3.shape[:2]
    g = g_BxTxHx3.astype(jnp.float32)
    probs = g / jnp.maximum(jnp.sum(g, axis=-1, keepdims=True), 1e-9)
    entropy_BxTxH = -jnp.sum(probs * jnp.log(jnp.maximum(probs, 1e-9)), axis=-1)
    t = (jnp.arange(T) if t_T is None else t_T)[None, :, None, None]
    used = idx_BxTxKxN >= 0
    # A block lies beyond the window when its last token is before t - w + 1.
    far = used & ((idx_BxTxKxN + 1) * lp <= t - w + 1)
    terms = [jnp.ones((B, T)), g, entropy_BxTxH, far, used, jnp.square(k_slc_BxTxKxDk), jnp.square(v_slc_BxTxKxDv)]
    tokens = jnp.concatenate([x.astype(jnp.float32).reshape(B, T, -1) for x in terms], axis=-1)
    cmp = jnp.concatenate([kc_BxTcxKxDk, vc_BxTcxKxDv], axis=-1).astype(jnp.float32)
    cmp = jnp.concatenate([jnp.square(cmp), jnp.ones((*cmp.shape[:-1], 1), jnp.float32)], axis=-1)
    if real_T is not None:
        tokens = jnp.where(real_T[None, :, None], tokens, 0.0)
    if real_Tc is not None:
        cmp = jnp.where(real_Tc[None, :, None, None], cmp, 0.0)
    return {"tokens": jnp.sum(tokens, axis=(0, 1)), "cmp": jnp.sum(cmp, axis=(0, 1, 2))}


def aux_stats(sums: dict[str, jax.Array], cfg: ModelConfig) -> dict[str, jax.Array]:
    """The logged statistics from aux_stat_sums' sums (any leading axes, e.g. [L]), fp32:

    gate_mean [..., 3] (per branch), gate_entropy (mean over tokens and heads of the
    entropy of the normalised gates), sel_far_frac (share of the selected blocks that
    lie beyond the window), cmp_k_ratio / cmp_v_ratio (RMS of the compressed keys
    (values) over the selection keys' (values'); 0 with no compressed token: the MLP
    compressor's output can grow far past the projections', docs/EXPERIMENTS.md "Why the
    MLP compressor fails on retrieval", and the training loop warns when it does).
    """
    H, K, N, Dk, Dv = cfg.n_heads, cfg.n_kv_heads, cfg.nsa.n, cfg.head_dim, cfg.v_head_dim
    tok, cmp = sums["tokens"], sums["cmp"]
    count, g, entropy, far, used, kslc_sq, vslc_sq = jnp.split(
        tok, np.cumsum([1, 3 * H, H, K * N, K * N, K * Dk]), axis=-1
    )
    kc_sq, vc_sq, rows = jnp.split(cmp, [Dk, Dk + Dv], axis=-1)
    count, rows = count[..., 0], rows[..., 0]

    def rms_ratio(num_sq, num_n, den_sq, den_n):
        ratio = jnp.sqrt(jnp.sum(num_sq, -1) / jnp.maximum(num_n, 1)) / jnp.maximum(
            jnp.sqrt(jnp.sum(den_sq, -1) / den_n), 1e-9
        )
        return jnp.where(num_n > 0, ratio, 0.0)

    return {
        "gate_mean": jnp.sum(g.reshape(*g.shape[:-1], H, 3), axis=-2) / (count * H)[..., None],
        "gate_entropy": jnp.sum(entropy, -1) / (count * H),
        "sel_far_frac": jnp.sum(far, -1) / jnp.maximum(jnp.sum(used, -1), 1),
        "cmp_k_ratio": rms_ratio(kc_sq, rows * Dk, kslc_sq, count * K * Dk),
        "cmp_v_ratio": rms_ratio(vc_sq, rows * Dv, vslc_sq, count * K * Dv),
    }
