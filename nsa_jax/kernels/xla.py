"""Plain-XLA attention for the three NSA branches.

This is the reference path and the CPU path. It never builds a T x T matrix:
queries are processed in chunks of C (`map_query_chunks`); a chunk of the
selection branch gathers only its selected blocks (C x N*lp keys), a chunk of the
window branch slices the C + w - 1 keys it can see, a chunk of the compressed
branch scores all T/d compressed tokens and reduces its probabilities to
selection-block scores before the next chunk. Each chunk body is
rematerialised, so the backward pass holds one chunk's scores at a time too.

Contract (docs/NSA.md, "Selection and window attention"): q[B,T,H,Dk], k[B,T,K,Dk],
v[B,T,K,Dv]; query head h reads KV head h // G; softmax in fp32; -1 marks an
unused slot; positions after t are masked.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

NEG_INF = -1e30

FORCED = 1e9  # above any score (a group's scores sum to at most G)
EXCLUDED = -1e9


def num_compressed(T: int, l: int, d: int) -> int:
    """T_cmp = floor((T - l) / d) + 1 complete compression blocks (0 when T < l)."""
    return 0 if T < l else (T - l) // d + 1


def block_scores_from_cmp(
    p_BxCxKxTc: jax.Array, n_blocks: int, l: int, d: int, lp: int, pool: str = "sum"
) -> jax.Array:
    """s[j] = sum (pool "sum", Eq. 9) or max (pool "max", InfLLM-V2's pooling, screened by
    experiments/selection_recall.py) of p[i] over the
    compressed tokens i whose span [i*d, i*d+l) overlaps block j.

    With d | l and d | lp, block j overlaps exactly the contiguous tokens
    i in [j*lp/d - l/d + 1, (j+1)*lp/d - 1]: a strided window reduction (reduce_window),
    exact and in a fixed order, O(Tc) per query instead of a Tc x Nb matmul. p >= 0, so the
    zero padding never wins a max.
    """
    if pool not in ("sum", "max"):
        raise ValueError(f"block score pool must be sum or max, got {pool!r}")
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
        jax.lax.add if pool == "sum" else jax.lax.max,
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
    ranked = jnp.where(forced_TxNb[None, :, None, :], FORCED, jnp.where(cand_TxNb[None, :, None, :], scores, EXCLUDED))
    if Nb < n:
        ranked = jnp.pad(ranked, [(0, 0)] * 3 + [(0, n - Nb)], constant_values=EXCLUDED)
    # lax.top_k returns equal values lower index first: ties go to the lower block.
    vals, ids = jax.lax.top_k(ranked, n)
    return jnp.where(vals > EXCLUDED / 2, ids, -1).astype(jnp.int32)


def map_query_chunks(body: Callable, chunk: int, *per_query) -> jax.Array:
    """Applies `body(start, *chunks)` to query chunks and stitches the outputs.

    Every array in `per_query` has the query axis at position 1 ([B, T, ...]).
    `body` gets the chunk's first position (traced int32) and [B, C, ...] slices,
    and returns [B, C, ...] (or a tuple of such). T is padded up to a multiple
    of C; padded queries are computed and dropped.
    """
    T = per_query[0].shape[1]
    C = min(chunk, T)
    n_chunks = -(-T // C)
    if n_chunks == 1:
        return body(jnp.int32(0), *per_query)
    pad = n_chunks * C - T

    def split(x):
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(x.shape[0], n_chunks, C, *x.shape[2:])
        return jnp.moveaxis(x, 1, 0)

    chunks = [split(x) for x in per_query]
    starts = jnp.arange(n_chunks, dtype=jnp.int32) * C
    # Recompute each chunk in the backward pass: residuals stay O(C), not O(T).
    rematted = jax.checkpoint(lambda s, *xs: body(s, *xs))
    out = jax.lax.map(lambda args: rematted(*args), (starts, *chunks))

    def stitch(y):
        y = jnp.moveaxis(y, 0, 1)
        return y.reshape(y.shape[0], n_chunks * C, *y.shape[3:])[:, :T]

    return jax.tree.map(stitch, out)


def masked_softmax(s_f32: jax.Array, visible: jax.Array) -> jax.Array:
    """fp32 softmax over the last axis restricted to `visible`; rows with no visible key are 0, never NaN."""
    s_f32 = jnp.where(visible, s_f32, NEG_INF)
    m = jnp.max(s_f32, axis=-1, keepdims=True)
    p = jnp.where(visible, jnp.exp(s_f32 - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    return p / jnp.where(denom > 0, denom, 1.0)


def soft_cap(x: jax.Array, cap: float) -> jax.Array:
    """c * tanh(x / c) (Gemma 2's capped scores and logits); x itself when cap is 0."""
    return cap * jnp.tanh(x / cap) if cap else x


def masked_softmax_attend(s_f32: jax.Array, visible: jax.Array, v: jax.Array, spec: str) -> jax.Array:
    """masked_softmax(s) contracted with v by einsum `spec`, accumulated in fp32."""
    p = masked_softmax(s_f32, visible)
    return jnp.einsum(spec, p.astype(v.dtype), v, preferred_element_type=jnp.float32)


def _group(q_BxCxHxD: jax.Array, n_kv: int) -> jax.Array:
    B, C, H, D = q_BxCxHxD.shape
    return q_BxCxHxD.reshape(B, C, n_kv, H // n_kv, D)


def selection_attention_xla(
    q_BxTxHxDk: jax.Array,
    k_BxTxKxDk: jax.Array,
    v_BxTxKxDv: jax.Array,
    idx_BxTxKxN: jax.Array,
    block_size: int,
    scale: float | None = None,
    *,
    query_chunk: int = 512,
    strategy: str = "auto",
    q_offset: int | jax.Array = 0,
    softcap: float = 0.0,
) -> jax.Array:
    """Attention of q_t over positions p <= t inside its selected blocks (`softcap` c > 0: scores c tanh(s / c)).

    `strategy`: `gather` reads only the N*lp selected keys of each query
    (O(T N lp) work; the long-context path); `masked` scores a query chunk
    against all T keys under a block mask (O(T^2) work but O(C T) memory, and
    plain matmuls instead of gathers and their scatter-add gradients, which is
    much faster when the selection covers a large share of T anyway); `auto`
    takes `masked` when T <= 2 N lp (T: the keys).
    `q_offset` (int or traced int32): query row r stands at position r + q_offset
    of the keys (context parallelism: a device's queries against the whole sequence).
    """
    B, T, H, Dk = k_BxTxKxDk.shape[0], k_BxTxKxDk.shape[1], q_BxTxHxDk.shape[2], q_BxTxHxDk.shape[3]
    K, Dv = k_BxTxKxDk.shape[2], v_BxTxKxDv.shape[3]
    N = idx_BxTxKxN.shape[-1]
    scale = Dk**-0.5 if scale is None else scale
    if strategy == "auto":
        strategy = "masked" if T <= 2 * N * block_size else "gather"
    if strategy == "masked":
        return _selection_masked(
            q_BxTxHxDk, k_BxTxKxDk, v_BxTxKxDv, idx_BxTxKxN, block_size, scale, query_chunk, q_offset, softcap
        )
    if strategy != "gather":
        raise ValueError(f"selection strategy must be auto, gather or masked, got {strategy!r}")
    n_blocks = -(-T // block_size)
    pad = n_blocks * block_size - T
    # [B, K, T', D]: one contiguous row per KV head, so a block is a contiguous run.
    k_BxKxTxD = jnp.moveaxis(jnp.pad(k_BxTxKxDk, [(0, 0), (0, pad), (0, 0), (0, 0)]), 2, 1)
    v_BxKxTxD = jnp.moveaxis(jnp.pad(v_BxTxKxDv, [(0, 0), (0, pad), (0, 0), (0, 0)]), 2, 1)
    offs = jnp.arange(block_size, dtype=jnp.int32)

    def body(start, q_BxCxHxDk, idx_BxCxKxN):
        C = q_BxCxHxDk.shape[1]
        t_C = start + q_offset + jnp.arange(C, dtype=jnp.int32)
        used = idx_BxCxKxN >= 0
        pos_BxCxKxNxL = jnp.where(used, idx_BxCxKxN, 0)[..., None] * block_size + offs
        visible = used[..., None] & (pos_BxCxKxNxL <= t_C[None, :, None, None, None])
        pos_BxKxS = jnp.moveaxis(pos_BxCxKxNxL, 2, 1).reshape(B, K, C * N * block_size)
        kg = jnp.take_along_axis(k_BxKxTxD, pos_BxKxS[..., None], axis=2)
        vg = jnp.take_along_axis(v_BxKxTxD, pos_BxKxS[..., None], axis=2)
        kg_BxCxKxSxD = jnp.moveaxis(kg.reshape(B, K, C, N * block_size, Dk), 1, 2)
        vg_BxCxKxSxD = jnp.moveaxis(vg.reshape(B, K, C, N * block_size, Dv), 1, 2)
        qg = _group(q_BxCxHxDk, K)
        s = jnp.einsum("bckgd,bcksd->bckgs", qg, kg_BxCxKxSxD, preferred_element_type=jnp.float32) * scale
        s = soft_cap(s, softcap)
        vis = visible.reshape(B, C, K, 1, N * block_size)
        o = masked_softmax_attend(s, vis, vg_BxCxKxSxD, "bckgs,bcksd->bckgd")
        return o.reshape(B, C, H, Dv).astype(q_BxTxHxDk.dtype)

    return map_query_chunks(body, query_chunk, q_BxTxHxDk, idx_BxTxKxN)


def _selection_masked(
    q_BxTxHxDk, k_BxTxKxDk, v_BxTxKxDv, idx_BxTxKxN, block_size, scale, query_chunk, q_offset, softcap=0.0
):
    """Selection attention as chunked dense attention under a selected-block mask."""
    B, H = q_BxTxHxDk.shape[0], q_BxTxHxDk.shape[2]
    T, K, Dv = k_BxTxKxDk.shape[1], k_BxTxKxDk.shape[2], v_BxTxKxDv.shape[3]
    n_blocks = -(-T // block_size)
    p_T = jnp.arange(T, dtype=jnp.int32)

    def body(start, q_BxCxHxDk, idx_BxCxKxN):
        C = q_BxCxHxDk.shape[1]
        t_C = start + q_offset + jnp.arange(C, dtype=jnp.int32)
        # chosen[b, c, k, j]: block j is among the row's selected blocks (-1 matches none).
        chosen = jnp.any(idx_BxCxKxN[..., None] == jnp.arange(n_blocks, dtype=jnp.int32), axis=-2)
        # Broadcast each block's flag over its lp positions (a reshape, not a gather).
        chosen_T = jnp.broadcast_to(chosen[..., None], (*chosen.shape, block_size)).reshape(*chosen.shape[:-1], -1)
        visible = chosen_T[..., :T] & (p_T[None, None, None, :] <= t_C[None, :, None, None])
        qg = _group(q_BxCxHxDk, K)
        s = soft_cap(
            jnp.einsum("bckgd,btkd->bckgt", qg, k_BxTxKxDk, preferred_element_type=jnp.float32) * scale, softcap
        )
        o = masked_softmax_attend(s, visible[:, :, :, None, :], v_BxTxKxDv, "bckgt,btkd->bckgd")
        return o.reshape(B, C, H, Dv).astype(q_BxTxHxDk.dtype)

    return map_query_chunks(body, query_chunk, q_BxTxHxDk, idx_BxTxKxN)


def window_attention_xla(
    q_BxTxHxDk: jax.Array,
    k_BxTxKxDk: jax.Array,
    v_BxTxKxDv: jax.Array,
    window: int,
    scale: float | None = None,
    *,
    query_chunk: int = 512,
    q_offset: int | jax.Array = 0,
    softcap: float = 0.0,
) -> jax.Array:
    """Attention of q_t over positions [max(0, t - w + 1), t].

    `q_offset`: query row r stands at position t = r + q_offset of the keys
    (q_offset + T_q <= T_k; selection_attention_xla). `softcap` c > 0: scores c * tanh(s / c).
    """
    B, T, H, Dk = q_BxTxHxDk.shape
    K, Dv = k_BxTxKxDk.shape[2], v_BxTxKxDv.shape[3]
    scale = Dk**-0.5 if scale is None else scale
    w = min(window, k_BxTxKxDk.shape[1])
    C = min(query_chunk, T)
    n_chunks = -(-T // C)
    # Left pad of w - 1 puts the first key a chunk can see at padded index `start` (+ q_offset);
    # the right pad keeps the last chunk's slice inside the keys whatever the offset.
    right = n_chunks * C - T
    k_pad = jnp.pad(k_BxTxKxDk, [(0, 0), (w - 1, right), (0, 0), (0, 0)])
    v_pad = jnp.pad(v_BxTxKxDv, [(0, 0), (w - 1, right), (0, 0), (0, 0)])
    S = C + w - 1

    def body(start, q_BxCxHxDk):
        first = start + q_offset
        kc = jax.lax.dynamic_slice_in_dim(k_pad, first, S, axis=1)
        vc = jax.lax.dynamic_slice_in_dim(v_pad, first, S, axis=1)
        t_C = first + jnp.arange(C, dtype=jnp.int32)
        p_S = first - (w - 1) + jnp.arange(S, dtype=jnp.int32)
        visible_CxS = (p_S[None, :] <= t_C[:, None]) & (p_S[None, :] > t_C[:, None] - w) & (p_S[None, :] >= 0)
        qg = _group(q_BxCxHxDk, K)
        s = soft_cap(jnp.einsum("bckgd,bskd->bckgs", qg, kc, preferred_element_type=jnp.float32) * scale, softcap)
        vis = visible_CxS[None, :, None, None, :]
        o = masked_softmax_attend(s, vis, vc, "bckgs,bskd->bckgd")
        return o.reshape(B, C, H, Dv).astype(q_BxTxHxDk.dtype)

    return map_query_chunks(body, C, q_BxTxHxDk)


def compressed_attention_xla(
    q_BxTxHxDk: jax.Array,
    kc_BxTcxKxDk: jax.Array,
    vc_BxTcxKxDv: jax.Array,
    *,
    l: int,
    d: int,
    lp: int,
    scale: float,
    query_chunk: int = 512,
    q_offset: int | jax.Array = 0,
    num_blocks: int | None = None,
    pool: str | None = "sum",
    softcap: float = 0.0,
) -> tuple[jax.Array, jax.Array | None]:
    """(o [B, T, H, Dv], block scores [B, T, K, Nb]) of the compressed branch (Tc >= 1); `softcap`: its
    scores capped (Gemma 2), before the probabilities the block scores sum.

    Query t sees compressed token i iff i*d + l - 1 <= t. The scores are the
    probabilities summed over each group's heads (GQA sharing, Eq. 10), then over
    the tokens overlapping each selection block; they carry no gradient.
    `q_offset`: query row r stands at position r + q_offset; `num_blocks`: Nb, the
    selection blocks of the whole sequence (default ceil(T / lp), T the queries'). `pool`: how a
    block's overlapping tokens combine (block_scores_from_cmp); None: no scores (the attention
    alone, for a scorer that does not read the compressed probabilities; second output None).
    """
    B, T, H, Dk = q_BxTxHxDk.shape
    Tc, K, Dv = kc_BxTcxKxDk.shape[1], kc_BxTcxKxDk.shape[2], vc_BxTcxKxDv.shape[3]
    n_blocks = -(-T // lp) if num_blocks is None else num_blocks
    end_Tc = jnp.arange(Tc, dtype=jnp.int32) * d + l - 1

    def body(start, q_BxCxHxDk):
        C = q_BxCxHxDk.shape[1]
        t_C = start + q_offset + jnp.arange(C, dtype=jnp.int32)
        qg = q_BxCxHxDk.reshape(B, C, K, H // K, Dk)
        s = jnp.einsum("bckgd,bikd->bckgi", qg, kc_BxTcxKxDk, preferred_element_type=jnp.float32) * scale
        s = soft_cap(s, softcap)
        visible = (end_Tc[None, :] <= t_C[:, None])[None, :, None, None, :]
        p = masked_softmax(s, visible)
        o = jnp.einsum(
            "bckgi,bikd->bckgd", p.astype(vc_BxTcxKxDv.dtype), vc_BxTcxKxDv, preferred_element_type=jnp.float32
        )
        o = o.reshape(B, C, H, Dv).astype(q_BxTxHxDk.dtype)
        if pool is None:
            return o
        p_group = jax.lax.stop_gradient(jnp.sum(p, axis=3))  # GQA sharing, Eq. 10
        return o, block_scores_from_cmp(p_group, n_blocks, l, d, lp, pool)

    if pool is None:
        return map_query_chunks(body, query_chunk, q_BxTxHxDk), None
    o, scores = map_query_chunks(body, query_chunk, q_BxTxHxDk)
    return o, jax.lax.stop_gradient(scores)
