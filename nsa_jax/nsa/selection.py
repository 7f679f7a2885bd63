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
    masked_softmax,
    num_compressed,
    select_blocks,
)


def _block_scores_body(kc_BxTcxKxDk: jax.Array, T: int, *, l: int, d: int, lp: int, scale: float):
    """(start, q [B, C, H, Dk]) -> differentiable block scores [B, C, K, Nb], normalised per query.

    The compressed probabilities summed over the group's heads (Eq. 10) and over the
    compressed tokens overlapping each block (Eq. 9 with aligned indices), as in
    block_scores_from_cmp, but written as a matmul: its reduce_window has no gradient
    inside a rematerialised map.
    """
    B, Tc, K, Dk = kc_BxTcxKxDk.shape
    n_blocks = -(-T // lp)
    end_Tc = jnp.arange(Tc, dtype=jnp.int32) * d + l - 1
    kc = kc_BxTcxKxDk.astype(jnp.float32)
    start_Tc = jnp.arange(Tc)[:, None] * d
    j_Nb = jnp.arange(n_blocks)[None, :]
    overlap_TcxNb = ((start_Tc < (j_Nb + 1) * lp) & (start_Tc + l > j_Nb * lp)).astype(jnp.float32)

    def body(start, q_BxCxHxDk):
        C, H = q_BxCxHxDk.shape[1], q_BxCxHxDk.shape[2]
        t_C = start + jnp.arange(C, dtype=jnp.int32)
        qg = q_BxCxHxDk.astype(jnp.float32).reshape(B, C, K, H // K, Dk)
        s_cmp = jnp.einsum("bckgd,bikd->bckgi", qg, kc) * scale
        vis_cmp = (end_Tc[None, :] <= t_C[:, None])[None, :, None, None, :]
        p_cmp = jnp.where(vis_cmp, jax.nn.softmax(jnp.where(vis_cmp, s_cmp, -1e30), axis=-1), 0.0)
        sc = jnp.einsum("bcki,ij->bckj", jnp.sum(p_cmp, axis=3), overlap_TcxNb)
        return sc / jnp.maximum(jnp.sum(sc, axis=-1, keepdims=True), 1e-9)

    return body


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
    scores_body = _block_scores_body(kc_BxTcxKxDk, T, l=l, d=d, lp=lp, scale=scale)

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


def score_distill_kl(
    q_BxTxHxDk: jax.Array,
    kc_BxTcxKxDk: jax.Array,
    k_BxTxKxDk: jax.Array,
    *,
    l: int,
    d: int,
    lp: int,
    scale: float | None = None,
    query_chunk: int = 512,
) -> jax.Array:
    """Mean KL(target || scorer) over the free block choices of every (row, query, KV group).

    Trains the block scorer directly (model.nsa.slc_score_distill). The target is where
    the selection branch's own attention would go if it saw every earlier key: its
    queries against all causal selection keys (dense), softmax per head, summed per
    selection block and averaged over the group's heads. The scorer is the compressed
    block scores (Eq. 9-10). Both are restricted to the free candidates, blocks
    1 .. t//lp - 2 (block 0 and the two local blocks are forced whatever the scores
    say), and renormalised; a query with fewer than two free candidates adds nothing.

    Only the compressed keys (projection and phi) get its gradient: the queries and the
    selection keys enter through stop_gradient, so the loss never moves what the three
    branches share. The dense target costs a chunked T x T attention per layer in XLA,
    about a full-attention forward; it is meant for short warm-ups or small models.
    Returns a float32 scalar.
    """
    B, T, H, Dk = q_BxTxHxDk.shape
    Tc, K = kc_BxTcxKxDk.shape[1], kc_BxTcxKxDk.shape[2]
    G = H // K
    n_blocks = -(-T // lp)
    scale = Dk**-0.5 if scale is None else scale
    if Tc == 0 or n_blocks < 4:  # no query has two free candidates
        return jnp.zeros((), jnp.float32)
    q_sg = jax.lax.stop_gradient(q_BxTxHxDk)
    pad = n_blocks * lp - T
    k_sg = jax.lax.stop_gradient(jnp.pad(k_BxTxKxDk, [(0, 0), (0, pad), (0, 0), (0, 0)])).astype(jnp.float32)
    p_Tp = jnp.arange(n_blocks * lp, dtype=jnp.int32)
    j_Nb = jnp.arange(n_blocks, dtype=jnp.int32)
    scores_body = _block_scores_body(kc_BxTcxKxDk, T, l=l, d=d, lp=lp, scale=scale)

    def body(start, q_BxCxHxDk):
        C = q_BxCxHxDk.shape[1]
        t_C = start + jnp.arange(C, dtype=jnp.int32)
        qg = q_BxCxHxDk.astype(jnp.float32).reshape(B, C, K, G, Dk)
        s = jnp.einsum("bckgd,btkd->bckgt", qg, k_sg) * scale
        causal = (p_Tp[None, :] <= t_C[:, None])[None, :, None, None, :]
        p = masked_softmax(s, causal)
        target = jnp.mean(p.reshape(B, C, K, G, n_blocks, lp).sum(-1), axis=3)  # [B, C, K, Nb]
        free_CxNb = (j_Nb[None, :] >= 1) & (j_Nb[None, :] <= t_C[:, None] // lp - 2)
        free = free_CxNb[None, :, None, :]
        target = jnp.where(free, target, 0.0)
        target = target / jnp.maximum(jnp.sum(target, -1, keepdims=True), 1e-12)
        sc = jnp.where(free, scores_body(start, q_BxCxHxDk), 0.0)
        log_sc = jnp.log(jnp.maximum(sc, 1e-30)) - jnp.log(jnp.maximum(jnp.sum(sc, -1, keepdims=True), 1e-30))
        kl = jnp.sum(jnp.where(free & (target > 0), target * (jnp.log(jnp.maximum(target, 1e-30)) - log_sc), 0.0), -1)
        counts = (jnp.sum(free_CxNb, -1) >= 2) & (t_C < T)
        return kl * counts[None, :, None], jnp.broadcast_to(counts[None, :, None], kl.shape).astype(jnp.float32)

    kl_BxTxK, used_BxTxK = map_query_chunks(body, query_chunk, q_sg)
    return jnp.sum(kl_BxTxK) / jnp.maximum(jnp.sum(used_BxTxK), 1.0)
