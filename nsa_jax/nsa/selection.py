"""Top-n block selection (docs/NSA.md "Selection").

The selection branch's names in one place: the map from compressed-attention
probabilities to selection-block scores (Eq. 9 with aligned indices) and from group
scores to block indices (forced blocks 0, current, previous, then the best
candidates, ties to the lower index, -1 for slots left over) are defined in
kernels/xla.py, beside the kernels that must agree with them, and re-exported
here; this module owns the straight-through term (straight_through_delta), whose
value is zero and whose gradient reaches the block scorer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The block-score and top-n math lives with the XLA kernels (the fused Pallas kernel must agree
# with it bit for bit); the NSA layer and its tests read it from here.
from nsa_jax.kernels.xla import (  # noqa: F401 - re-exported
    block_scores_from_cmp,
    map_query_chunks,
    num_compressed,
    select_blocks,
)


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
