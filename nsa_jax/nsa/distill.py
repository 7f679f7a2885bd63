"""Block-scorer distillation (train.scorer_distill; docs/NSA.md "Learning options").

Owns the KL between where the selection branch's attention would go with every
block visible and the compressed block scores (Eq. 9-10) that choose its blocks.
The layer computes it only when its caller makes the `losses` collection mutable
(nsa/layer.py); the train step weighs it into the loss (step/step.py). The block
scores and top-n the forward uses live in kernels/xla.py, beside the kernels that
must agree with them. The KL's pieces (the free blocks, the full attention's block
mass, the compressed block scores) also measure a model's selections
(experiments/selection_recall.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nsa_jax.kernels.scorers import block_logsumexp
from nsa_jax.kernels.xla import NEG_INF, map_query_chunks, masked_softmax


def free_blocks(t_C: jax.Array, n_blocks: int, lp: int) -> jax.Array:
    """[C, Nb] bool: the blocks query t may choose, 1 .. t//lp - 2 (block 0 and the two local
    blocks are forced whatever the scores say)."""
    j_Nb = jnp.arange(n_blocks, dtype=jnp.int32)
    return (j_Nb[None, :] >= 1) & (j_Nb[None, :] <= t_C[:, None] // lp - 2)


def full_block_mass(q_BxCxHxDk: jax.Array, k_BxTxKxDk: jax.Array, t_C: jax.Array, *, lp: int, scale: float):
    """[B, C, K, Nb] float32: where the selection branch's attention would go with every earlier key
    visible. Queries at positions t_C against all causal keys, softmax per head, summed per
    selection block of lp keys and averaged over the group's heads; each row sums to 1."""
    T = k_BxTxKxDk.shape[1]
    k = jnp.pad(k_BxTxKxDk, [(0, 0), (0, -T % lp), (0, 0), (0, 0)])
    lse = block_logsumexp(q_BxCxHxDk, k, t_C, lp=lp, scale=scale, keys=T)  # [B, C, K, G, Nb]
    return jnp.mean(masked_softmax(lse, lse > NEG_INF / 2), axis=3)


def compressed_block_scores(
    q_BxCxHxDk: jax.Array, kc_BxTcxKxDk: jax.Array, t_C: jax.Array, n_blocks: int, *, l: int, d: int, lp: int, scale
):
    """[B, C, K, Nb] float32, differentiable in the compressed keys: the block scores (Eq. 9-10) that
    choose query t's blocks. The compressed probabilities summed over the group's heads and over
    the compressed tokens overlapping each block, as kernels/xla.py block_scores_from_cmp, but
    written as a matmul: its reduce_window has no gradient inside a rematerialised map."""
    B, C, H, Dk = q_BxCxHxDk.shape
    Tc, K = kc_BxTcxKxDk.shape[1], kc_BxTcxKxDk.shape[2]
    start_Tc = jnp.arange(Tc, dtype=jnp.int32) * d
    j_Nb = jnp.arange(n_blocks, dtype=jnp.int32)
    overlap_TcxNb = (start_Tc[:, None] < (j_Nb[None, :] + 1) * lp) & (start_Tc[:, None] + l > j_Nb[None, :] * lp)
    qg = q_BxCxHxDk.astype(jnp.float32).reshape(B, C, K, H // K, Dk)
    s_cmp = jnp.einsum("bckgd,bikd->bckgi", qg, kc_BxTcxKxDk.astype(jnp.float32)) * scale
    vis_cmp = ((start_Tc + l - 1)[None, :] <= t_C[:, None])[None, :, None, None, :]
    p_cmp = jnp.where(vis_cmp, jax.nn.softmax(jnp.where(vis_cmp, s_cmp, -1e30), axis=-1), 0.0)
    return jnp.einsum("bcki,ij->bckj", jnp.sum(p_cmp, axis=3), overlap_TcxNb.astype(jnp.float32))


def free_kl(target_BxCxKxNb: jax.Array, scores_BxCxKxNb: jax.Array, free_CxNb: jax.Array) -> jax.Array:
    """[B, C, K]: KL(target || scores), both restricted to the free blocks and renormalised there."""
    free = free_CxNb[None, :, None, :]
    target = jnp.where(free, target_BxCxKxNb, 0.0)
    target = target / jnp.maximum(jnp.sum(target, -1, keepdims=True), 1e-12)
    sc = jnp.where(free, scores_BxCxKxNb, 0.0)
    log_sc = jnp.log(jnp.maximum(sc, 1e-30)) - jnp.log(jnp.maximum(jnp.sum(sc, -1, keepdims=True), 1e-30))
    return jnp.sum(jnp.where(free & (target > 0), target * (jnp.log(jnp.maximum(target, 1e-30)) - log_sc), 0.0), -1)


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
    Tc = kc_BxTcxKxDk.shape[1]
    n_blocks = -(-T // lp)
    scale = Dk**-0.5 if scale is None else scale
    if Tc == 0 or n_blocks < 4:  # no query has two free candidates
        return jnp.zeros((), jnp.float32)
    q_sg = jax.lax.stop_gradient(q_BxTxHxDk)
    # Padded to whole blocks once, outside the query map: full_block_mass's own pad is then empty.
    pad = n_blocks * lp - T
    k_sg = jax.lax.stop_gradient(jnp.pad(k_BxTxKxDk, [(0, 0), (0, pad), (0, 0), (0, 0)])).astype(jnp.float32)

    def body(start, q_BxCxHxDk):
        C = q_BxCxHxDk.shape[1]
        t_C = start + jnp.arange(C, dtype=jnp.int32)
        target = full_block_mass(q_BxCxHxDk, k_sg, t_C, lp=lp, scale=scale)
        scores = compressed_block_scores(q_BxCxHxDk, kc_BxTcxKxDk, t_C, n_blocks, l=l, d=d, lp=lp, scale=scale)
        free_CxNb = free_blocks(t_C, n_blocks, lp)
        kl = free_kl(target, scores, free_CxNb)
        counts = (jnp.sum(free_CxNb, -1) >= 2) & (t_C < T)
        return kl * counts[None, :, None], jnp.broadcast_to(counts[None, :, None], kl.shape).astype(jnp.float32)

    kl_BxTxK, used_BxTxK = map_query_chunks(body, query_chunk, q_sg)
    return jnp.sum(kl_BxTxK) / jnp.maximum(jnp.sum(used_BxTxK), 1.0)
