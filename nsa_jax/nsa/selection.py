"""Top-n block selection (NSA_SPEC.md "Selection branch").

Owns the map from compressed-attention probabilities to selection-block scores
(Eq. 9 with aligned indices), and from group scores to block indices: forced
blocks (0, current, previous), then the best candidates, ties to the lower
index, -1 for slots left over. Everything here is under stop_gradient, except the
straight-through term (straight_through_delta), whose value is zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nsa_jax.kernels.xla import map_query_chunks

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


def straight_through_delta(
    q_BxTxHxDk: jax.Array,
    kc_BxTcxKxDk: jax.Array,
    k_BxTxKxDk: jax.Array,
    v_BxTxKxDv: jax.Array,
    idx_BxTxKxN: jax.Array,
    *,
    l: int,
    d: int,
    lp: int,
    scale: float | None = None,
    query_chunk: int = 512,
) -> jax.Array:
    """A zero-valued term [B, T, H, Dv] whose gradient is the straight-through top-n's.

    With o_slc = sum_j P_j (P_j: the selection output's part from selected block j, the
    attention probabilities of its keys times their values), a straight-through top-n
    uses sum_j (1 + s_j - stop_gradient(s_j)) P_j instead, s_j the block's compressed
    score normalised over the query's blocks. Its value equals o_slc, and its gradient
    reaches s_j, i.e. the compressed keys and the queries. This returns the difference,
    sum_j (s_j - stop_gradient(s_j)) stop_gradient(P_j): exactly zero in the forward
    (x - x), so adding it to o_slc changes no value. P_j is recomputed here (chunked dense
    attention under the selected-block mask), so this costs about one more selection
    forward; the scores are recomputed with gradient from q and the compressed keys.
    """
    B, T, H, Dk = q_BxTxHxDk.shape
    Tc, K = kc_BxTcxKxDk.shape[1], kc_BxTcxKxDk.shape[2]
    Dv = v_BxTxKxDv.shape[3]
    G = H // K
    n_blocks = -(-T // lp)
    scale = Dk**-0.5 if scale is None else scale
    if Tc == 0:
        return jnp.zeros((B, T, H, Dv), jnp.float32)
    pad = n_blocks * lp - T
    k_sg = jax.lax.stop_gradient(jnp.pad(k_BxTxKxDk, [(0, 0), (0, pad), (0, 0), (0, 0)])).astype(jnp.float32)
    v_sg = jax.lax.stop_gradient(jnp.pad(v_BxTxKxDv, [(0, 0), (0, pad), (0, 0), (0, 0)])).astype(jnp.float32)
    p_Tp = jnp.arange(n_blocks * lp, dtype=jnp.int32)
    end_Tc = jnp.arange(Tc, dtype=jnp.int32) * d + l - 1
    kc = kc_BxTcxKxDk.astype(jnp.float32)
    # Compressed token i (span [i*d, i*d + l)) overlaps block j: the sum of block_scores_from_cmp
    # as a matmul (its reduce_window has no gradient inside a rematerialised map).
    start_Tc = jnp.arange(Tc)[:, None] * d
    j_Nb = jnp.arange(n_blocks)[None, :]
    overlap_TcxNb = ((start_Tc < (j_Nb + 1) * lp) & (start_Tc + l > j_Nb * lp)).astype(jnp.float32)

    def scores_body(start, q_BxCxHxDk):
        # Differentiable block scores: compressed probabilities summed over the group's heads
        # (Eq. 10) and over the compressed tokens overlapping each block, normalised per query.
        C = q_BxCxHxDk.shape[1]
        t_C = start + jnp.arange(C, dtype=jnp.int32)
        qg = q_BxCxHxDk.astype(jnp.float32).reshape(B, C, K, G, Dk)
        s_cmp = jnp.einsum("bckgd,bikd->bckgi", qg, kc) * scale
        vis_cmp = (end_Tc[None, :] <= t_C[:, None])[None, :, None, None, :]
        p_cmp = jnp.where(vis_cmp, jax.nn.softmax(jnp.where(vis_cmp, s_cmp, -1e30), axis=-1), 0.0)
        sc = jnp.einsum("bcki,ij->bckj", jnp.sum(p_cmp, axis=3), overlap_TcxNb)
        return sc / jnp.maximum(jnp.sum(sc, axis=-1, keepdims=True), 1e-9)

    def blocks_body(start, q_BxCxHxDk, idx_BxCxKxN):
        # P_j: selection attention under the selected-block mask, summed per block.
        C = q_BxCxHxDk.shape[1]
        t_C = start + jnp.arange(C, dtype=jnp.int32)
        qg = q_BxCxHxDk.astype(jnp.float32).reshape(B, C, K, G, Dk)
        chosen = jnp.any(idx_BxCxKxN[..., None] == jnp.arange(n_blocks, dtype=jnp.int32), axis=-2)
        chosen_T = jnp.repeat(chosen, lp, axis=-1)
        visible = chosen_T & (p_Tp[None, None, None, :] <= t_C[None, :, None, None])
        s = jnp.einsum("bckgd,btkd->bckgt", qg, k_sg) * scale
        s = jnp.where(visible[:, :, :, None, :], s, -1e30)
        p = jnp.where(visible[:, :, :, None, :], jax.nn.softmax(s, axis=-1), 0.0)
        p_BxCxKxGxNbxL = p.reshape(B, C, K, G, n_blocks, lp)
        v_BxNbxLxKxD = v_sg.reshape(B, n_blocks, lp, K, Dv)
        return jnp.einsum("bckgjl,bjlkd->bckgjd", p_BxCxKxGxNbxL, v_BxNbxLxKxD)

    # Two chunk maps: a rematerialised map whose outputs mix differentiable and constant
    # values fails to linearise, so the constant P_j is computed from stop_gradient inputs.
    s_BxTxKxNb = map_query_chunks(scores_body, query_chunk, q_BxTxHxDk)
    P_BxTxKxGxNbxDv = jax.lax.stop_gradient(
        map_query_chunks(blocks_body, query_chunk, jax.lax.stop_gradient(q_BxTxHxDk), idx_BxTxKxN)
    )
    ds = s_BxTxKxNb - jax.lax.stop_gradient(s_BxTxKxNb)
    return jnp.einsum("btkj,btkgjd->btkgd", ds, P_BxTxKxGxNbxDv).reshape(B, T, H, Dv)
