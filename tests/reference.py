"""Naive NSA reference for the tests, written from docs/NSA.md and nothing else.

Per-token loops (numpy) decide which keys each query sees; dense T x T masks
carry those decisions into differentiable jax code, so forward values and
gradients can be compared with the production path. Slow on purpose: keep T small.

The attention-kernel references (visibility, masks, per-token float64 attention,
dense-mask attention, random selections) live in nsa_jax.kernels.reference, which
the benchmarks share; they are re-exported here. This module adds the layer:
token-by-token block selection and the whole NSA layer from its parameter tree.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from nsa_jax.kernels.reference import (  # noqa: F401  (re-exported for the tests)
    compressed_mask,
    compressed_visible,
    dense_attention,
    random_block_indices,
    reference_attention,
    reference_block_scores,
    reference_block_selection,
    reference_compressed_lse2,
    reference_group_probs,
    selection_mask,
    selection_visible,
    window_mask,
    window_visible,
)

# ---------------------------------------------------------------------------
# block selection decided token by token


def naive_selection(
    p_cmp_BxHxTxTc: np.ndarray, T: int, G: int, l: int, d: int, lp: int, n: int, scorer: str = "cmp",
    q_BxTxHxD: np.ndarray | None = None, k_BxTxKxD: np.ndarray | None = None, sub: int | None = None,
    candidates: int | None = None,
) -> np.ndarray:  # fmt: skip
    """Block indices [B, T, K, n] by the spec's rules, one query at a time, ranked by `scorer`
    (naive_block_score; minmax reads the queries and selection keys, float64; rescore re-ranks
    cmp's first `candidates` blocks by naive_rescore_mass)."""
    B, H, _, Tc = p_cmp_BxHxTxTc.shape
    K = H // G
    n_blocks = math.ceil(T / lp)
    out = -np.ones((B, T, K, n), np.int64)
    for b in range(B):
        for t in range(T):
            for k in range(K):
                score = np.zeros(n_blocks)
                if scorer in ("minmax", "mix"):
                    q_G = np.asarray(q_BxTxHxD, np.float64)[b, t, k * G : (k + 1) * G]
                    score += naive_minmax_scores(q_G, np.asarray(k_BxTxKxD, np.float64)[b, :, k], t, lp, sub or lp)
                if scorer in ("cmp", "mix", "rescore"):
                    p_G = p_cmp_BxHxTxTc[b, k * G : (k + 1) * G, t]
                    score += naive_cmp_scores(p_G, n_blocks, l, d, lp)
                cur = t // lp
                seen = [j for j in range(n_blocks) if j * lp <= t]
                forced = sorted({0, cur} | ({cur - 1} if cur - 1 >= 0 else set()))
                rest = sorted((j for j in seen if j not in forced), key=lambda j: (-score[j], j))
                chosen = (forced + rest)[: candidates if scorer == "rescore" else n]
                if scorer == "rescore":  # cmp's candidates in its order, re-ranked by their exact mass
                    q_G = np.asarray(q_BxTxHxD, np.float64)[b, t, k * G : (k + 1) * G]
                    mass = naive_rescore_mass(q_G, np.asarray(k_BxTxKxD, np.float64)[b, :, k], t, lp, chosen)
                    # forced first (in cmp's order), then by mass; ties to cmp's earlier candidate
                    order = sorted(
                        range(len(chosen)),
                        key=lambda i: (chosen[i] not in forced, -mass[i] * (chosen[i] not in forced), i),
                    )
                    chosen = [chosen[i] for i in order][:n]
                out[b, t, k, : len(chosen)] = chosen
    return out


def naive_cmp_scores(p_GxTc: np.ndarray, n_blocks: int, l: int, d: int, lp: int) -> np.ndarray:
    """Eq. 9-10 for one query and group: the group's summed compressed probability of each compressed
    token i, then summed over the tokens whose span overlaps block j."""
    Tc = p_GxTc.shape[1]
    score = np.zeros(n_blocks)
    for j in range(n_blocks):
        overlap = [float(np.sum(p_GxTc[:, i])) for i in range(Tc) if i * d < (j + 1) * lp and i * d + l > j * lp]
        if overlap:
            score[j] = sum(overlap)
    return score


def naive_rescore_mass(q_GxD: np.ndarray, k_TxD: np.ndarray, t: int, lp: int, blocks: list[int]) -> list[float]:
    """The rescore scorer's second stage for one query at t and group (docs/NSA.md "Block scorers"): per
    head, a softmax over every key the query sees (position <= t) in `blocks`, summed per block; the
    group's heads summed."""
    G, D = q_GxD.shape
    keys = [(j, p) for j in blocks for p in range(j * lp, min((j + 1) * lp, t + 1))]
    mass = {j: 0.0 for j in blocks}
    for g in range(G):
        logits = np.array([q_GxD[g] @ k_TxD[p] / math.sqrt(D) for _, p in keys])
        e = np.exp(logits - logits.max())
        for (j, _), w in zip(keys, e / e.sum()):
            mass[j] += w
    return [mass[j] for j in blocks]


def naive_minmax_scores(q_GxD: np.ndarray, k_TxD: np.ndarray, t: int, lp: int, sub: int) -> np.ndarray:
    """The minmax scorer for one query at t and group (docs/NSA.md "Block scorers"): per head, each block
    the query has complete gets the largest over its sub-blocks of sum_c max(q_c kmax_c, q_c kmin_c)
    (kmin/kmax: the sub-block's channel-wise extremes), times 1/sqrt(D); a softmax per head over
    those blocks; the group's heads summed. Blocks not complete score 0."""
    G, D = q_GxD.shape
    n_blocks = math.ceil(k_TxD.shape[0] / lp)
    score = np.zeros(n_blocks)
    done = [j for j in range(n_blocks) if (j + 1) * lp <= t + 1]
    for g in range(G):
        logits = []
        for j in done:
            bounds = []
            for s0 in range(j * lp, (j + 1) * lp, sub):
                keys = k_TxD[s0 : s0 + sub]
                bound = sum(max(q_GxD[g, c] * keys[:, c].max(), q_GxD[g, c] * keys[:, c].min()) for c in range(D))
                bounds.append(bound)
            logits.append(max(bounds) / math.sqrt(D))
        if logits:
            e = np.exp(np.asarray(logits) - max(logits))
            score[done] += e / e.sum()
    return score


# ---------------------------------------------------------------------------
# the layer, from the flax parameter tree


def rope_ref(x_BxTxHxD, positions):
    """Rotary embedding pairing dim i with dim i + D/2, angle pos * 10000^(-2i/D)."""
    D = x_BxTxHxD.shape[-1]
    half = D // 2
    freqs = np.array([10000.0 ** (-2.0 * i / D) for i in range(half)])
    ang = np.asarray(positions, np.float64)[:, None] * freqs[None, :]
    cos = jnp.asarray(np.cos(ang), jnp.float32)[None, :, None, :]
    sin = jnp.asarray(np.sin(ang), jnp.float32)[None, :, None, :]
    a, b = x_BxTxHxD[..., :half], x_BxTxHxD[..., half:]
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def compress_ref(x_BxTxKxD, p, l, d, phi):
    """phi applied block by block: token i is made from raw positions i*d .. i*d+l-1."""
    B, T, K, D = x_BxTxKxD.shape
    Tc = 0 if T < l else (T - l) // d + 1
    outs = []
    for i in range(Tc):
        raw = x_BxTxKxD[:, i * d : i * d + l]  # [B, l, K, D]
        if phi == "avg":
            outs.append(jnp.mean(raw, axis=1))
            continue
        blk = raw + p["pos"][None, :, None, :]
        flat = jnp.transpose(blk, (0, 2, 1, 3)).reshape(B, K, l * D)
        h = jax.nn.gelu(flat @ p["fc1"]["kernel"] + p["fc1"]["bias"])
        outs.append(h @ p["fc2"]["kernel"])  # [B, K, D]
    if not outs:
        return jnp.zeros((B, 0, K, D), x_BxTxKxD.dtype)
    return jnp.stack(outs, axis=1)


def nsa_layer_ref(params, x_BxTxD, cfg, idx=None, rope_pos=None):
    """NSA attention output [B, T, D] and the block indices it used.

    `idx`: block indices to use; computed token by token when None (pass them
    back in for gradient checks, since selection carries no gradient).
    `rope_pos`: the positions RoPE rotates q and k by (default 0..T-1); the masks
    always use the token indices.
    """
    a = cfg.nsa
    B, T, D = x_BxTxD.shape
    H, K, Dk, Dv = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.v_head_dim
    G = H // K
    pos = np.arange(T) if rope_pos is None else np.asarray(rope_pos)

    def lin(name, heads, dim):
        return (x_BxTxD @ params[name]["kernel"]).reshape(B, T, heads, dim)

    q = rope_ref(lin("q", H, Dk), pos)
    k_cmp, v_cmp = rope_ref(lin("k_cmp", K, Dk), pos), lin("v_cmp", K, Dv)
    k_slc, v_slc = rope_ref(lin("k_slc", K, Dk), pos), lin("v_slc", K, Dv)
    k_win, v_win = rope_ref(lin("k_win", K, Dk), pos), lin("v_win", K, Dv)

    gh = x_BxTxD @ params["gate_fc1"]["kernel"] + params["gate_fc1"]["bias"]
    g = jax.nn.sigmoid(jax.nn.silu(gh) @ params["gate_fc2"]["kernel"] + params["gate_fc2"]["bias"]).reshape(B, T, H, 3)

    kc = compress_ref(k_cmp, params.get("cmp_k", {}), a.l, a.d, a.cmp_phi)
    vc = compress_ref(v_cmp, params.get("cmp_v", {}), a.l, a.d, a.cmp_phi)
    Tc = kc.shape[1]
    if Tc:
        cmask = compressed_mask(T, Tc, a.l, a.d)[None, None]
        o_cmp, p_cmp = dense_attention(q, kc, vc, cmask)
    else:
        o_cmp, p_cmp = jnp.zeros((B, T, H, Dv)), jnp.zeros((B, H, T, 0))
    if idx is None:
        idx = naive_selection(
            np.asarray(p_cmp, np.float64), T, G, a.l, a.d, a.lp, a.n, scorer=a.scorer,
            q_BxTxHxD=np.asarray(q), k_BxTxKxD=np.asarray(k_slc), sub=a.scorer_sub or a.lp,
            candidates=a.scorer_candidates or 4 * a.n,
        )  # fmt: skip
    smask = selection_mask(idx, T, a.lp)
    o_slc, _ = dense_attention(q, k_slc, v_slc, smask)
    o_win, _ = dense_attention(q, k_win, v_win, window_mask(T, a.w)[None, None])

    branch_out = {"cmp": o_cmp, "slc": o_slc, "win": o_win}
    o = sum(g[..., i : i + 1] * branch_out[name] for i, name in enumerate(("cmp", "slc", "win")) if name in a.branches)
    return o.reshape(B, T, H * Dv) @ params["o"]["kernel"], idx
