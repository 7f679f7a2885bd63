"""Block-scorer distillation (train.scorer_distill; docs/NSA.md "Learning options").

Owns the KL between where the selection branch's attention would go with every
block visible and the compressed block scores (Eq. 9-10) that choose its blocks.
The layer computes it only when its caller makes the `losses` collection mutable
(nsa/layer.py); the train step weighs it into the loss (train/step.py). The block
scores and top-n the forward uses live in kernels/xla.py, beside the kernels that
must agree with them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nsa_jax.kernels.xla import map_query_chunks, masked_softmax


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

    Trains the block scorer directly (train.scorer_distill). The target is where
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
