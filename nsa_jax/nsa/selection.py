"""Top-n block selection (docs/NSA.md "Selection").

Owns the map from compressed-attention probabilities to selection-block scores
(Eq. 9 with aligned indices), and from group scores to block indices: forced
blocks (0, current, previous), then the best candidates, ties to the lower
index, -1 for slots left over. Everything here is under stop_gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_FORCED = 1e9  # above any score (a group's scores sum to at most G)
_EXCLUDED = -1e9


def num_compressed(T: int, l: int, d: int) -> int:
    """T_cmp = floor((T - l) / d) + 1 complete compression blocks (0 when T < l)."""
    return 0 if T < l else (T - l) // d + 1


def block_scores_from_cmp(p_BxCxKxTc: jax.Array, n_blocks: int, l: int, d: int, lp: int) -> jax.Array:
    """s[j] = sum of p[i] over compressed tokens i whose span [i*d, i*d+l) overlaps block j.

    With d | l and d | lp, block j overlaps exactly the contiguous tokens
    i in [j*lp/d - l/d + 1, (j+1)*lp/d - 1]: a strided window sum (reduce_window),
    exact and in a fixed order, O(Tc) per query instead of a Tc x Nb matmul.
    """
    Tc = p_BxCxKxTc.shape[-1]
    lead = l // d - 1
    win = (lp + l) // d - 1
    stride = lp // d
    needed = (n_blocks - 1) * stride + win
    right = max(0, needed - (Tc + lead))
    pads = [(0, 0)] * (p_BxCxKxTc.ndim - 1) + [(lead, right)]
    out = jax.lax.reduce_window(
        p_BxCxKxTc,
        jnp.array(0, p_BxCxKxTc.dtype),
        jax.lax.add,
        window_dimensions=(1,) * (p_BxCxKxTc.ndim - 1) + (win,),
        window_strides=(1,) * (p_BxCxKxTc.ndim - 1) + (stride,),
        padding=pads,
    )
    return out[..., :n_blocks]


def select_blocks(scores_BxTxKxNb: jax.Array, lp: int, n: int, t_T: jax.Array | None = None) -> jax.Array:
    """Block indices [B, T, K, n] int32 for each query position and KV group.

    `t_T` gives the absolute positions of the rows (defaults to 0..T-1).
    Candidates are blocks j with j*lp <= t; blocks 0, t//lp and t//lp - 1 are forced.
    """
    scores = jax.lax.stop_gradient(scores_BxTxKxNb).astype(jnp.float32)
    T, Nb = scores.shape[1], scores.shape[-1]
    t_T = jnp.arange(T, dtype=jnp.int32) if t_T is None else t_T
    cur_T = t_T // lp
    j_Nb = jnp.arange(Nb, dtype=jnp.int32)
    cand_TxNb = j_Nb[None, :] <= cur_T[:, None]
    forced_TxNb = (j_Nb[None, :] == 0) | (j_Nb[None, :] == cur_T[:, None]) | (j_Nb[None, :] == cur_T[:, None] - 1)
    ranked = jnp.where(
        forced_TxNb[None, :, None, :], _FORCED, jnp.where(cand_TxNb[None, :, None, :], scores, _EXCLUDED)
    )
    if Nb < n:
        ranked = jnp.pad(ranked, [(0, 0)] * 3 + [(0, n - Nb)], constant_values=_EXCLUDED)
    # lax.top_k returns equal values lower index first: ties go to the lower block.
    vals, ids = jax.lax.top_k(ranked, n)
    return jnp.where(vals > _EXCLUDED / 2, ids, -1).astype(jnp.int32)
