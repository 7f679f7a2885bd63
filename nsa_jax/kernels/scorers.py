"""The selection branch's block scorers (model.nsa.scorer; docs/NSA.md "Block scorers").

A scorer ranks, for each query and KV group, the selection blocks of lp keys; `select_blocks`
then keeps the n best (block 0 and the two local blocks forced). Three families:

* `cmp` (the paper's Eq. 9-10): the compressed branch's probabilities summed over the group's
  heads and over the compressed tokens that overlap each block. It comes with the compressed
  attention (kernels/xla.py `compressed_attention_xla`, the fused Pallas kernels).
* `mix`: cmp's scores plus minmax's (each sums to G over a query's blocks), so a block wins a slot
  by its compressed mass or by its peak.
* `minmax` (Quest's bound, kept per sub-block): for a sub-block of `sub` keys with channel-wise
  minima k_min and maxima k_max, every key's logit q . k <= relu(q) . k_max + min(q, 0) . k_min.
  A block's logit is the largest bound over its lp / sub sub-blocks, so a block that holds one
  strong key keeps that key's peak where a mean-pooled key averages it away. Per head, a softmax
  over the blocks the query has complete (scale as the attention's), summed over the group's
  heads: a group's scores sum to at most G, as cmp's do. sub = 1 makes the bound exact: the
  block's true max logit (the ceiling of the family; it costs the full attention's scores).

* `rescore` (two stages): cmp's best m blocks (model.nsa.scorer_candidates, default 4 n; the
  forced ones among them), then among those the n of most mass of each head's softmax over the m
  blocks' keys the query sees (exact within the candidates), summed over the group's heads.
  The second stage reads m x lp keys a query whatever T is, with no value and no backward: on the
  converted SmolLM2-135M at 8k it brings the loss within 0.6% of dense where cmp is 5.3% above it
  and the ceiling (the best n blocks by the full attention) 0.4% (docs/PRETRAINED.md).

Everything here is stop-gradient (the choice of blocks has no gradient) and causal: a query at t
reads only blocks it has complete ((j + 1) lp <= t + 1); the blocks it may not have complete are
the forced ones, whose scores the ranking ignores.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nsa_jax.kernels.xla import EXCLUDED, FORCED, NEG_INF, map_query_chunks, masked_softmax, select_blocks

# The scorers a config may name (NSAConfig.scorer).
SCORERS = ("cmp", "minmax", "mix", "rescore")
# Scorers that read the compressed branch's probabilities, and those that keep the selection keys'
# sub-block bounds (the decode cache's kmin/kmax).
CMP_SCORERS = ("cmp", "mix", "rescore")
KEY_SCORERS = ("minmax", "mix")


# The most fp32 logits one query chunk of select_rescore_xla holds.
RESCORE_LOGITS = 1 << 27


def default_candidates(n: int) -> int:
    """`rescore`'s first-stage blocks when none are named: 4 n (at n = 16, 64: 0.970 of the best 16 blocks'
    attention in every layer of the converted SmolLM2 at 8k, docs/PRETRAINED.md)."""
    return 4 * n


def scorer_candidates(nsa) -> int:
    """`rescore`'s first-stage blocks of an NSAConfig (0 in the config: `default_candidates`)."""
    return nsa.scorer_candidates or default_candidates(nsa.n)


def candidate_mass(logits_XxGxMxL: jax.Array, visible_XxMxL: jax.Array) -> jax.Array:
    """[..., M] fp32: `rescore`'s second stage from each head's logits [..., G, M, L] over the M candidate
    blocks' L keys: per head a softmax over every visible key of the candidates, summed per block and
    over the heads (a block holding no visible key scores 0)."""
    X, (G, M, L) = logits_XxGxMxL.shape[:-3], logits_XxGxMxL.shape[-3:]
    vis = jnp.broadcast_to(visible_XxMxL[..., None, :, :], logits_XxGxMxL.shape).reshape(*X, G, M * L)
    p = masked_softmax(logits_XxGxMxL.astype(jnp.float32).reshape(*X, G, M * L), vis)
    return p.reshape(*X, G, M, L).sum(axis=(-3, -1))


def pick_candidates(mass_XxM: jax.Array, cand_XxM: jax.Array, t_X: jax.Array, lp: int, n: int) -> jax.Array:
    """[..., n] int32: the n of M candidate blocks `cand` (-1: unused) a query at position t keeps, its
    forced blocks (0, t // lp - 1, t // lp) first, then by `mass` (ties to the earlier candidate, cmp's
    better one); -1 where fewer than n are valid (select_blocks' contract)."""
    cur = (t_X // lp)[..., None]
    forced = (cand_XxM == 0) | (cand_XxM == cur) | (cand_XxM == cur - 1)
    ranked = jnp.where(forced, FORCED, jnp.where(cand_XxM >= 0, mass_XxM, EXCLUDED))
    if ranked.shape[-1] < n:
        pad = [(0, 0)] * (ranked.ndim - 1) + [(0, n - ranked.shape[-1])]
        ranked, cand_XxM = jnp.pad(ranked, pad, constant_values=EXCLUDED), jnp.pad(cand_XxM, pad, constant_values=-1)
    vals, at = jax.lax.top_k(ranked, n)
    return jnp.where(vals > EXCLUDED / 2, jnp.take_along_axis(cand_XxM, at, axis=-1), -1).astype(jnp.int32)


def block_logsumexp(
    q_BxCxHxDk: jax.Array, k_BxSxKxDk: jax.Array, t_C: jax.Array, *, lp: int, scale: float, keys: int | None = None
) -> jax.Array:
    """[B, C, K, G, Nb] float32: per head, each selection block's log-sum-exp of the logits of queries at
    positions t_C over the block's keys they see (position <= t and < `keys`, default S); NEG_INF where a
    query sees none of a block. `k`: S = Nb * lp keys (whole blocks). A softmax over a query's blocks'
    log-sum-exps is where its full attention goes, block by block (rescore's masses, the distillation's
    target), with no [.., S] probabilities kept."""
    B, C, H, Dk = q_BxCxHxDk.shape
    S, K = k_BxSxKxDk.shape[1], k_BxSxKxDk.shape[2]
    keys = S if keys is None else keys
    qg = q_BxCxHxDk.astype(jnp.float32).reshape(B, C, K, H // K, Dk)
    s = jnp.einsum("bckgd,btkd->bckgt", qg, k_BxSxKxDk.astype(jnp.float32)).reshape(B, C, K, H // K, S // lp, lp)
    pos_NbxL = jnp.arange(S, dtype=jnp.int32).reshape(S // lp, lp)
    vis_CxNbxL = (pos_NbxL[None] <= t_C[:, None, None]) & (pos_NbxL[None] < keys)
    return jax.nn.logsumexp(jnp.where(vis_CxNbxL[None, :, None, None], s * scale, NEG_INF), axis=-1)


def select_rescore_xla(
    q_BxTxHxDk: jax.Array,
    k_BxTxKxDk: jax.Array,
    cand_BxTxKxM: jax.Array,
    *,
    lp: int,
    n: int,
    scale: float | None = None,
    query_chunk: int = 512,
    q_offset: int | jax.Array = 0,
) -> jax.Array:
    """Block indices [B, T, K, n] int32 of `rescore`'s second stage over the candidates [B, T, K, M] of
    its first (cmp's top m; select_blocks' contract). `k`: the selection keys of the whole sequence.

    One query chunk at a time the logits run against every key and reduce to each block's log-sum-exp
    over the keys the query sees; the candidates' masses are a softmax over their blocks' log-sum-exps:
    the same softmax as over the gathered M x lp keys (the decode step's), with no gather of logits."""
    B, T, H, Dk = q_BxTxHxDk.shape
    Tk = k_BxTxKxDk.shape[1]
    scale = Dk**-0.5 if scale is None else scale
    nb = -(-Tk // lp)
    k = jnp.pad(jax.lax.stop_gradient(k_BxTxKxDk), [(0, 0), (0, nb * lp - Tk), (0, 0), (0, 0)]).astype(jnp.float32)
    q = jax.lax.stop_gradient(q_BxTxHxDk)

    def body(start, q_BxCxHxDk, cand_BxCxKxM):
        C = q_BxCxHxDk.shape[1]
        t_C = start + q_offset + jnp.arange(C, dtype=jnp.int32)
        lse = block_logsumexp(q_BxCxHxDk, k, t_C, lp=lp, scale=scale, keys=Tk)  # [B, C, K, G, Nb]
        # Each candidate's log-sum-exp ([..., G, M]); per head a softmax over those of the candidates that hold
        # a visible key (the others score 0), summed over the group's heads.
        at = jnp.maximum(cand_BxCxKxM, 0)[:, :, :, None, :]
        lse_m = jnp.take_along_axis(lse, jnp.broadcast_to(at, (*lse.shape[:-1], at.shape[-1])), axis=-1)
        vis_m = (cand_BxCxKxM >= 0)[:, :, :, None, :] & (lse_m > NEG_INF / 2)
        mass = jnp.sum(masked_softmax(lse_m, vis_m), axis=-2)
        return pick_candidates(mass, cand_BxCxKxM, t_C[None, :, None], lp, n)

    # The chunk's logits are [C, H, Tk] fp32: at most 2^27 of them (0.5 GiB) however long the sequence.
    chunk = max(16, min(query_chunk, RESCORE_LOGITS // (B * H * nb * lp)))
    return map_query_chunks(body, chunk, q, cand_BxTxKxM)


def scorer_sub(nsa) -> int:
    """The min/max bound's sub-block length of an NSAConfig (0 in the config: lp, one bound a block)."""
    return nsa.scorer_sub or nsa.lp


def key_bounds(k_BxTxKxDk: jax.Array, lp: int, sub: int, num_blocks: int | None = None):
    """(k_min, k_max) [B, Nb * lp / sub, K, Dk] in the keys' dtype (a minimum is one of the values:
    exact): channel-wise minima and maxima of each sub-block of `sub` consecutive keys. Keys past T
    are zeros: they only reach blocks no query has complete."""
    B, T, K, Dk = k_BxTxKxDk.shape
    n_blocks = -(-T // lp) if num_blocks is None else num_blocks
    k = k_BxTxKxDk
    if n_blocks * lp != T:
        k = jnp.pad(k, [(0, 0), (0, n_blocks * lp - T), (0, 0), (0, 0)])
    k = k.reshape(B, n_blocks * lp // sub, sub, K, Dk)
    return jnp.min(k, axis=2), jnp.max(k, axis=2)


def bound_block_logits(qg_BxCxKxGxDk: jax.Array, kmin_BxSxKxDk, kmax_BxSxKxDk, lp: int, sub: int, scale: float):
    """[B, C, K, G, Nb] fp32: each head's largest bound q . k over each block (the module docstring)."""
    q = qg_BxCxKxGxDk.astype(jnp.float32)
    kmin, kmax = (x.astype(jnp.float32) for x in (kmin_BxSxKxDk, kmax_BxSxKxDk))
    ub = jnp.einsum("bckgd,bskd->bckgs", jnp.maximum(q, 0.0), kmax) + jnp.einsum(
        "bckgd,bskd->bckgs", jnp.minimum(q, 0.0), kmin
    )
    per = lp // sub
    ub = ub.reshape(*ub.shape[:-1], ub.shape[-1] // per, per)
    return jnp.max(ub, axis=-1) * scale


def complete_blocks(t_C: jax.Array, n_blocks: int, lp: int) -> jax.Array:
    """[C, Nb] bool: the blocks query t has seen to their end, (j + 1) lp <= t + 1."""
    j_Nb = jnp.arange(n_blocks, dtype=jnp.int32)
    return (j_Nb[None, :] + 1) * lp <= t_C[:, None] + 1


def group_block_scores(logits_BxCxKxGxNb: jax.Array, t_C: jax.Array, lp: int) -> jax.Array:
    """[B, C, K, Nb] fp32: per head a softmax over the complete blocks, summed over the group's heads."""
    vis = complete_blocks(t_C, logits_BxCxKxGxNb.shape[-1], lp)[None, :, None, None, :]
    return jnp.sum(masked_softmax(logits_BxCxKxGxNb, vis), axis=3)


def minmax_block_scores(q_BxCxHxDk, kmin, kmax, t_C, *, lp: int, sub: int, scale: float) -> jax.Array:
    """[B, C, K, Nb] fp32: the `minmax` scores of a chunk of queries at positions t_C."""
    B, C, H, Dk = q_BxCxHxDk.shape
    K = kmin.shape[2]
    qg = q_BxCxHxDk.reshape(B, C, K, H // K, Dk)
    return group_block_scores(bound_block_logits(qg, kmin, kmax, lp, sub, scale), t_C, lp)


def minmax_row_scores(qg_BxKxGxDk, kmin_BxUxKxDk, kmax_BxUxKxDk, t_B, *, lp: int, sub: int, scale: float):
    """[B, K, Nb] fp32: the `minmax` scores of one query per row, row b at its own position t_B[b]
    (decode, over a cache's sub-block bounds)."""
    logits = bound_block_logits(qg_BxKxGxDk[:, None], kmin_BxUxKxDk.astype(jnp.float32),
                                kmax_BxUxKxDk.astype(jnp.float32), lp, sub, scale)[:, 0]  # fmt: skip
    vis = jax.vmap(lambda t: complete_blocks(t[None], logits.shape[-1], lp)[0])(t_B)[:, None, None, :]
    return jnp.sum(masked_softmax(logits, vis), axis=2)


def select_minmax_xla(
    q_BxTxHxDk: jax.Array,
    k_BxTxKxDk: jax.Array,
    *,
    lp: int,
    n: int,
    sub: int,
    scale: float | None = None,
    query_chunk: int = 512,
    q_offset: int | jax.Array = 0,
    num_blocks: int | None = None,
    plus_scores: jax.Array | None = None,
) -> jax.Array:
    """Block indices [B, T, K, n] int32 of the `minmax` scorer, select_blocks' contract; with
    `plus_scores` [B, T, K, Nb] (the `mix` scorer: cmp's), ranked by the sum of the two.

    `k`: the selection keys of the whole sequence (context parallelism: gathered), whose bounds are
    made once; query row r stands at position r + q_offset. The scores exist one query chunk at a time.
    """
    Dk = q_BxTxHxDk.shape[-1]
    scale = Dk**-0.5 if scale is None else scale
    n_blocks = -(-k_BxTxKxDk.shape[1] // lp) if num_blocks is None else num_blocks
    kmin, kmax = key_bounds(jax.lax.stop_gradient(k_BxTxKxDk), lp, sub, n_blocks)
    q = jax.lax.stop_gradient(q_BxTxHxDk)

    def body(start, q_BxCxHxDk, *plus):
        t_C = start + q_offset + jnp.arange(q_BxCxHxDk.shape[1], dtype=jnp.int32)
        scores = minmax_block_scores(q_BxCxHxDk, kmin, kmax, t_C, lp=lp, sub=sub, scale=scale)
        return select_blocks(scores + plus[0] if plus else scores, lp, n, t_C)

    return map_query_chunks(body, query_chunk, q, *([] if plus_scores is None else [plus_scores]))
