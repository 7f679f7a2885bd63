"""Naive references of the attention-kernel contract, for tests and benchmarks.

Written from docs/NSA.md and nothing else, and slow on purpose (keep T small):
* visibility, decided token by token: `selection_visible` / `window_visible` / `compressed_visible` give
  the sorted key positions query t of KV head kv sees; `selection_mask` / `window_mask` /
  `compressed_mask` give the same decisions as dense boolean masks;
* `reference_attention`: float64 per-token attention with its gradients written out by hand (numpy), for
  any of the visibility functions; `dense_attention`: differentiable jax attention under a dense mask, so
  gradients can also come from `jax.grad`;
* `reference_group_probs`: the compressed branch's probabilities summed over each KV group's heads,
  float64; `reference_block_scores`: their Eq. 9 sums over each selection block;
  `reference_block_selection`: the top-n rules (forced blocks, ties to the lower index, -1 for unused
  slots) over given scores; `reference_compressed_lse2`: each head's base-2 log-sum-exp over the tokens
  it sees, in the flash kernels' row layout;
* `random_block_indices`: random valid selections (forced blocks 0, current and previous, then random
  earlier blocks, -1 for slots left over), vectorised so the benchmarks can draw them at long T too.

The production package never imports this module.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# ---------------------------------------------------------------------------
# Visibility, token by token


def selection_visible(idx_BxTxKxN: np.ndarray, lp: int, T: int):
    """visible(b, t, kv) -> sorted positions p <= t inside the blocks of idx[b, t, kv] (-1: unused)."""
    idx_BxTxKxN = np.asarray(idx_BxTxKxN)

    def visible(b, t, kv):
        pos = []
        for j in idx_BxTxKxN[b, t, kv]:
            if j >= 0:
                pos.extend(p for p in range(j * lp, (j + 1) * lp) if p <= t and p < T)
        return np.array(sorted(pos), np.int64)

    return visible


def window_visible(w: int):
    """visible(b, t, kv) -> positions [max(0, t - w + 1), t]."""

    def visible(b, t, kv):
        del b, kv
        return np.arange(max(0, t - w + 1), t + 1)

    return visible


def compressed_visible(l: int, d: int, Tc: int):
    """visible(b, t, kv) -> compressed tokens i with i*d + l - 1 <= t (the block has ended)."""

    def visible(b, t, kv):
        del b, kv
        return np.array([i for i in range(Tc) if i * d + l - 1 <= t], np.int64)

    return visible


def selection_mask(idx_BxTxKxN: np.ndarray, T: int, lp: int) -> np.ndarray:
    """[B, K, T, T] bool: query t sees key p iff p <= t and p lies in a selected block."""
    B, _, K, _ = idx_BxTxKxN.shape
    visible = selection_visible(idx_BxTxKxN, lp, T)
    mask = np.zeros((B, K, T, T), bool)
    for b in range(B):
        for t in range(T):
            for k in range(K):
                mask[b, k, t, visible(b, t, k)] = True
    return mask


def window_mask(T: int, w: int) -> np.ndarray:
    """[T, T] bool: query t sees [max(0, t - w + 1), t]."""
    visible = window_visible(w)
    mask = np.zeros((T, T), bool)
    for t in range(T):
        mask[t, visible(0, t, 0)] = True
    return mask


def compressed_mask(T: int, Tc: int, l: int, d: int) -> np.ndarray:
    """[T, Tc] bool: query t sees compressed token i iff its block has ended."""
    visible = compressed_visible(l, d, Tc)
    mask = np.zeros((T, Tc), bool)
    for t in range(T):
        mask[t, visible(0, t, 0)] = True
    return mask


# ---------------------------------------------------------------------------
# Attention


def reference_attention(q, k, v, do, visible, scale=None):
    """float64 per-token attention and its hand-written gradients: (o, dq, dk, dv).

    q [B, T, H, Dk], k [B, S, K, Dk], v [B, S, K, Dv], do [B, T, H, Dv] (the
    cotangent of o; zeros when None); query head h reads KV head h // G and
    ``visible(b, t, kv)`` lists the key positions it sees. A row that sees no
    key gives 0 everywhere.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b_, t_, h, dk_ = q.shape
    kvh = k.shape[2]
    g = h // kvh
    scale = dk_**-0.5 if scale is None else scale
    do = np.zeros((b_, t_, h, v.shape[-1])) if do is None else np.asarray(do, np.float64)
    o = np.zeros(do.shape)
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for b in range(b_):
        for t in range(t_):
            for kv in range(kvh):
                pos = np.asarray(visible(b, t, kv), np.int64)
                heads = slice(kv * g, (kv + 1) * g)
                if pos.size == 0:
                    continue
                k_PxD, v_PxD = k[b, pos, kv], v[b, pos, kv]
                q_GxD, do_GxD = q[b, t, heads], do[b, t, heads]
                s = q_GxD @ k_PxD.T * scale
                p = np.exp(s - s.max(axis=1, keepdims=True))
                p /= p.sum(axis=1, keepdims=True)
                o[b, t, heads] = p @ v_PxD
                dp = do_GxD @ v_PxD.T
                ds = p * (dp - np.sum(p * dp, axis=1, keepdims=True))
                dq[b, t, heads] = scale * ds @ k_PxD
                np.add.at(dk[b, :, kv], pos, scale * ds.T @ q_GxD)
                np.add.at(dv[b, :, kv], pos, p.T @ do_GxD)
    return o, dq, dk, dv


def reference_group_probs(q, kc, visible, scale=None):
    """float64 [B, K, T, Tc]: each head's softmax over its visible tokens, summed over the group."""
    q, kc = np.asarray(q, np.float64), np.asarray(kc, np.float64)
    b_, t_, h, dk_ = q.shape
    tc, kvh = kc.shape[1], kc.shape[2]
    g = h // kvh
    scale = dk_**-0.5 if scale is None else scale
    out = np.zeros((b_, kvh, t_, tc))
    for b in range(b_):
        for t in range(t_):
            for kv in range(kvh):
                pos = visible(b, t, kv)
                if pos.size == 0:
                    continue
                s = q[b, t, kv * g : (kv + 1) * g] @ kc[b, pos, kv].T * scale
                p = np.exp(s - s.max(axis=1, keepdims=True))
                out[b, kv, t, pos] = (p / p.sum(axis=1, keepdims=True)).sum(axis=0)
    return out


def reference_compressed_lse2(q, kc, l, d, scale):
    """float64 [B, K, T*G]: the base-2 log-sum-exp of each (query, head) over the compressed tokens it sees,
    in the flash kernels' flattened-row layout (row t*G + g); 0 where a query sees no token."""
    q, kc = (np.asarray(x, np.float64) for x in (q, kc))
    b_, t_, h, _ = q.shape
    tc, kvh = kc.shape[1], kc.shape[2]
    g = h // kvh
    visible = compressed_visible(l, d, tc)
    out = np.zeros((b_, kvh, t_ * g))
    for b in range(b_):
        for t in range(t_):
            seen = visible(b, t, 0)
            for hi in range(h):
                if seen.size:
                    s = scale * (kc[b, seen, hi // g] @ q[b, t, hi])
                    m = s.max()
                    out[b, hi // g, t * g + hi % g] = (m + np.log(np.exp(s - m).sum())) / np.log(2)
    return out


def reference_block_scores(q, kc, l, d, lp, scale=None):
    """float64 [B, T, K, Nb], Nb = ceil(T / lp): the selection-block scores of Eq. 9.

    reference_group_probs over the compressed tokens each query sees, summed over
    the tokens whose span [i*d, i*d + l) overlaps block j's [j*lp, (j+1)*lp).
    """
    t_, tc = q.shape[1], kc.shape[1]
    p_BxKxTxTc = reference_group_probs(q, kc, compressed_visible(l, d, tc), scale)
    nb = -(-t_ // lp)
    overlap_TcxNb = np.array([[i * d < (j + 1) * lp and i * d + l > j * lp for j in range(nb)] for i in range(tc)])
    return np.einsum("bkti,ij->btkj", p_BxKxTxTc, overlap_TcxNb.astype(np.float64))


def reference_block_selection(scores, lp, n, tol=0.0, offset=0):
    """(indices [B, T, K, n], clear [B, T, K]): the spec's rules at positions t + offset.

    `clear` rows have no gap <= tol between consecutive ranks that decide the output.
    """
    b_, t_, kvh, nb = scores.shape
    idx = -np.ones((b_, t_, kvh, n), np.int64)
    clear = np.ones((b_, t_, kvh), bool)
    for b in range(b_):
        for row in range(t_):
            t = row + offset
            cur = t // lp
            forced = sorted({0, cur} | ({cur - 1} if cur >= 1 else set()))
            forced = [j for j in forced if j < nb]
            for kv in range(kvh):
                s = scores[b, row, kv]
                rest = sorted((j for j in range(nb) if j * lp <= t and j not in forced), key=lambda j: (-s[j], j))
                chosen = (forced + rest)[:n]
                idx[b, row, kv, : len(chosen)] = chosen
                # The ranks that decide the output: the chosen candidates and the first one left out.
                ranked = [s[j] for j in rest[: max(0, n - len(forced)) + 1]]
                clear[b, row, kv] = all(a - c > tol for a, c in zip(ranked, ranked[1:]))
    return idx, clear


def dense_attention(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, mask, scale=None):
    """softmax(q k^T * scale) v with `mask` [B or 1, K or 1, T, S]; masked rows give 0.

    Returns (o [B, T, H, Dv] fp32, p [B, H, T, S]); differentiable in q, k, v.
    """
    B, T, H, D = q_BxTxHxD.shape
    K = k_BxSxKxD.shape[2]
    G = H // K
    scale = D**-0.5 if scale is None else scale
    k_rep = jnp.repeat(k_BxSxKxD, G, axis=2)
    v_rep = jnp.repeat(v_BxSxKxD, G, axis=2)
    s = jnp.einsum("bthd,bshd->bhts", q_BxTxHxD.astype(jnp.float32), k_rep.astype(jnp.float32)) * scale
    mask = jnp.asarray(mask)
    mask_h = jnp.repeat(mask, G, axis=1) if mask.shape[1] == K and K != H else mask
    s = jnp.where(mask_h, s, -jnp.inf)
    any_visible = jnp.any(mask_h, axis=-1, keepdims=True)
    p = jax.nn.softmax(jnp.where(any_visible, s, 0.0), axis=-1)
    p = jnp.where(mask_h & any_visible, p, 0.0)
    return jnp.einsum("bhts,bshd->bthd", p, v_rep.astype(jnp.float32)), p


# ---------------------------------------------------------------------------
# Random selections


def random_block_indices(
    rng: np.random.Generator,
    B: int,
    T: int,
    K: int,
    n: int,
    lp: int,
    *,
    shuffle: bool = True,
    chunk: int = 1024,
) -> np.ndarray:
    """int32 [B, T, K, n]: valid selections of n blocks of lp per (query, KV head).

    Blocks 0, cur = t // lp and cur - 1 are always chosen, the other slots take
    distinct random blocks <= cur, and slots left over (fewer than n candidates)
    are -1. ``shuffle``: slots in random order, -1 anywhere; otherwise forced
    blocks first and -1 at the end. Drawn in chunks of query positions, so long
    sequences stay cheap in memory.
    """
    n_blocks = -(-T // lp)
    out = np.empty((B, T, K, n), np.int32)
    j_N = np.arange(n_blocks)
    for start in range(0, T, chunk):
        t_C = np.arange(start, min(start + chunk, T))
        cur_C = t_C // lp
        forced_CxN = (j_N == 0) | (j_N == cur_C[:, None]) | (j_N == cur_C[:, None] - 1)
        allowed_CxN = j_N <= cur_C[:, None]
        u = rng.random((B, len(t_C), K, n_blocks))
        score = np.where(forced_CxN[None, :, None], 2.0, np.where(allowed_CxN[None, :, None], u, -1.0))
        # The n best blocks of each row, best first: forced, then random candidates, then not allowed.
        top = np.argsort(-score, axis=-1, kind="stable")[..., :n]
        top_score = np.take_along_axis(score, top, axis=-1)
        idx = np.where(top_score >= 0.0, top, -1)
        if n > n_blocks:
            idx = np.concatenate([idx, -np.ones((*idx.shape[:-1], n - n_blocks), idx.dtype)], axis=-1)
        if shuffle:
            idx = np.take_along_axis(idx, np.argsort(rng.random(idx.shape), axis=-1), axis=-1)
        out[:, t_C] = idx
    return out
