"""Decoding: the cache's slot arithmetic, prefill's fill and the one-token step of both cores.

NSA (docs/NSA.md "Decode"): `fill_cache` writes each branch's state from a prefill of a
right-padded prompt, `decode_branches` attends one new token per row at its own position
from it and advances it. Dense attention: `fill_ring` / `decode_ring` keep its keys and values
in the window ring (kwin/vwin). The cache layout (names, sizes) is nsa_jax/inference/cache.py's;
the arrays carry the scanned layers' leading axis, indexed by `layer` (they travel in the scan
carry, so a step's writes are in place).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nsa_jax.config import ModelConfig
from nsa_jax.kernels.scorers import candidate_mass, minmax_row_scores, pick_candidates, scorer_candidates
from nsa_jax.kernels.xla import block_scores_from_cmp, masked_softmax, masked_softmax_attend, select_blocks, soft_cap

# Per-layer decode state in the `cache` collection (layout: nsa_jax/inference/cache.py).
CACHE_NAMES = ("kslc", "vslc", "kwin", "vwin", "ktail", "vtail", "kcmp", "vcmp", "kmin", "kmax")
# Smallest number of compressed tokens a decode step reads (then doubling up to the cache's).
CMP_BUCKET = 64


def missing_cache(what: str):
    """The init function of a cache variable: a prefill or decode called without the cache."""

    def fail(name: str):
        raise ValueError(
            f"{what} prefill/decode found no cache variable {name!r}: pass variables "
            "{'params': ..., 'cache': nsa_jax.inference.init_cache(...).variables()} with mutable=['cache']"
        )

    return fail


def ring_positions(last_B: jax.Array, size: int) -> jax.Array:
    """[B, size]: the position held by each ring slot once positions <= last are written.

    Slot s holds p = last - ((last - s) mod size), the latest p <= last with
    p = s (mod size); p < 0 means the slot was never written.
    """
    s = jnp.arange(size, dtype=jnp.int32)
    last = last_B.astype(jnp.int32)[:, None]
    return last - jnp.mod(last - s[None, :], size)


def compressed_visible(t_B: jax.Array, Tc: int, l: int, d: int) -> jax.Array:
    """[B, Tc]: compressed token i is visible to query t iff its block ended: i*d + l - 1 <= t."""
    end_Tc = jnp.arange(Tc, dtype=jnp.int32) * d + l - 1
    return end_Tc[None, :] <= t_B[:, None]


def gather_rows(x_BxTxKxD: jax.Array, pos_BxN: jax.Array) -> jax.Array:
    """x[b, pos[b, j]] -> [B, N, K, D], zero where pos < 0."""
    g = jnp.take_along_axis(x_BxTxKxD, jnp.maximum(pos_BxN, 0)[:, :, None, None], axis=1)
    return jnp.where((pos_BxN >= 0)[:, :, None, None], g, jnp.zeros((), g.dtype))


def fill_cache(cfg: ModelConfig, cache: dict, layer: jax.Array, lengths_B: jax.Array, kv: dict, kc, vc) -> None:
    """Writes layer `layer` of the cache from a prefill of a right-padded prompt [B, P].

    `kv` holds the forward's RoPE'd keys and values of every branch [B, P, K, D]
    (kcmp/vcmp: the raw compression inputs), kc/vc its compressed tokens
    [B, Tc(P), K, D]. Row b keeps its first lengths_B[b] positions; the rest is
    zeroed (raw, compressed) or never gathered (rings).
    """
    a = cfg.nsa
    B, P = kv["kslc"].shape[:2]
    S, R, Tc = cache["kslc"].value.shape[2], cache["kwin"].value.shape[2], cache["kcmp"].value.shape[2]
    lengths_B = lengths_B.astype(jnp.int32)
    live_BxP = jnp.arange(P, dtype=jnp.int32)[None, :] < lengths_B[:, None]

    def put(name, x_BxNxKxD, n):
        x = jnp.pad(x_BxNxKxD, [(0, 0), (0, n - x_BxNxKxD.shape[1]), (0, 0), (0, 0)])
        v = cache[name].value
        cache[name].value = v.at[layer].set(x.astype(v.dtype))

    for name in ("kslc", "vslc"):
        put(name, jnp.where(live_BxP[:, :, None, None], kv[name], jnp.zeros((), kv[name].dtype)), S)
    win_pos = ring_positions(lengths_B - 1, R)
    tail_pos = ring_positions(lengths_B - 1, a.l)
    for name in ("kwin", "vwin"):
        put(name, gather_rows(kv[name], win_pos), R)
    for name, src in (("ktail", "kcmp"), ("vtail", "vcmp")):
        put(name, gather_rows(kv[src], tail_pos), a.l)
    for name, x in (("kcmp", kc), ("vcmp", vc)):
        Tp = min(x.shape[1], Tc)
        done = compressed_visible(lengths_B - 1, Tp, a.l, a.d)[:, :, None, None]
        put(name, jnp.where(done, x[:, :Tp], jnp.zeros((), x.dtype)), Tc)
    U = cache["kmin"].value.shape[2]
    if U:  # the minmax scorer: each sub-block's extremes over the row's live keys (0 where none is)
        sub = S // U
        P_sub = -(-P // sub) * sub
        k = jnp.pad(kv["kslc"].astype(jnp.float32), [(0, 0), (0, P_sub - P), (0, 0), (0, 0)])
        live = jnp.pad(live_BxP, [(0, 0), (0, P_sub - P)])[:, :, None, None]
        k, live = k.reshape(B, P_sub // sub, sub, *k.shape[2:]), live.reshape(B, P_sub // sub, sub, 1, 1)
        any_live = jnp.any(live, axis=2)
        for name, reduce, fill in (("kmin", jnp.min, jnp.inf), ("kmax", jnp.max, -jnp.inf)):
            put(name, jnp.where(any_live, reduce(jnp.where(live, k, fill), axis=2), 0.0), U)


def cmp_buckets(Tc: int) -> tuple[int, ...]:
    """Static sizes a decode step may read of Tc compressed slots: CMP_BUCKET, doubling, then Tc."""
    sizes = []
    n = CMP_BUCKET
    while n < Tc:
        sizes.append(n)
        n *= 2
    return (*sizes, Tc)


def _compressed_step(qg_BxKxGxDk, kcmp, vcmp, layer, t_B, a, n_blocks: int, scale: float, softcap: float = 0.0):
    """Compressed attention of one query per row, and its selection-block scores [B, K, Nb].

    Reads only a prefix of the compressed slots: the smallest bucket that holds
    every compressed token visible to some row. Slots beyond are invisible to
    every row, so the result equals the read of all Tc slots.
    """
    B, Tc, K, Dv = vcmp.shape[1], vcmp.shape[2], vcmp.shape[3], vcmp.shape[4]
    G = qg_BxKxGxDk.shape[2]

    def attend(Tb):
        def run():
            kc = jax.lax.dynamic_slice(kcmp, (layer, 0, 0, 0, 0), (1, B, Tb, K, kcmp.shape[4]))[0]
            vc = jax.lax.dynamic_slice(vcmp, (layer, 0, 0, 0, 0), (1, B, Tb, K, Dv))[0]
            s = soft_cap(
                jnp.einsum("bkgd,bikd->bkgi", qg_BxKxGxDk, kc, preferred_element_type=jnp.float32) * scale, softcap
            )
            p = masked_softmax(s, compressed_visible(t_B, Tb, a.l, a.d)[:, None, None, :])
            o = jnp.einsum("bkgi,bikd->bkgd", p.astype(vc.dtype), vc, preferred_element_type=jnp.float32)
            # GQA sharing (Eq. 10); blocks past Tb overlap only zero-probability tokens.
            scores = block_scores_from_cmp(jnp.sum(p, axis=2), n_blocks, a.l, a.d, a.lp)
            return o, scores

        return run

    sizes = cmp_buckets(Tc)
    if len(sizes) == 1:
        return attend(Tc)()
    need = jnp.max(jnp.where(t_B + 1 >= a.l, (t_B + 1 - a.l) // a.d + 1, 0))
    branch = jnp.sum(jnp.asarray(sizes[:-1], jnp.int32) < need)
    o, scores = jax.lax.switch(branch, [attend(n) for n in sizes])
    assert o.shape == (B, K, G, Dv)
    return o, scores


def decode_branches(cfg: ModelConfig, cache: dict, layer, t_B, q_BxHxDk, new: dict, compressor, window=None) -> dict:
    """One decode step of every branch; writes position t_B[b] of each row into the cache first.

    `new` holds the token's RoPE'd keys/values per branch [B, K, D]; `compressor`
    builds the layer's Compressor submodules by name; `window`: the window branch's keys
    (default model.nsa.w; a local layer's model.dense_window, maybe traced). Returns branch
    outputs [B, H, Dv].
    """
    a = cfg.nsa
    B, H, Dk = q_BxHxDk.shape
    K, Dv = cfg.n_kv_heads, cfg.v_head_dim
    G = H // K
    scale = Dk**-0.5
    S, R, Tc = cache["kslc"].value.shape[2], cache["kwin"].value.shape[2], cache["kcmp"].value.shape[2]
    b_B = jnp.arange(B)
    t_B = t_B.astype(jnp.int32)

    def write(name, slot_B, x_BxKxD, keep_B=None):
        v = cache[name].value
        x = x_BxKxD.astype(v.dtype)
        if keep_B is not None:
            x = jnp.where(keep_B[:, None, None], x, v[layer, b_B, slot_B])
        # Scatter into the scan carry: in place.
        cache[name].value = v.at[layer, b_B, slot_B].set(x)

    for name in ("kslc", "vslc"):
        write(name, t_B, new[name])
    for name in ("kwin", "vwin"):
        write(name, t_B % R, new[name])
    write("ktail", t_B % a.l, new["kcmp"])
    write("vtail", t_B % a.l, new["vcmp"])
    U = cache["kmin"].value.shape[2]
    if U:  # the minmax scorer's bounds: a sub-block's first key starts them, the others extend them
        sub, slot_B = S // U, t_B // (S // U)
        first_B = (t_B % sub == 0)[:, None, None]
        for name, extend in (("kmin", jnp.minimum), ("kmax", jnp.maximum)):
            old = cache[name].value[layer, b_B, slot_B].astype(jnp.float32)
            k_new = new["kslc"].astype(jnp.float32)
            write(name, slot_B, jnp.where(first_B, k_new, extend(old, k_new)))

    qg_BxKxGxDk = q_BxHxDk.reshape(B, K, G, Dk)
    outputs = {}
    if "cmp" in a.branches or "slc" in a.branches:
        # Compression block (t + 1 - l) / d completes at t: compress its l raw K/V (the tail
        # ring) with the layer's compressor and store it before attending, so the query at t
        # sees it, as in the forward (i*d + l - 1 <= t).
        emit_B = (t_B + 1 >= a.l) & (jnp.mod(t_B + 1 - a.l, a.d) == 0)
        ci_B = jnp.clip((t_B + 1 - a.l) // a.d, 0, Tc - 1)
        slots_Bxl = jnp.mod(t_B[:, None] + 1 - a.l + jnp.arange(a.l, dtype=jnp.int32)[None, :], a.l)
        for name, tail, cname in (("kcmp", "ktail", "cmp_k"), ("vcmp", "vtail", "cmp_v")):
            tail_BxlxKxD = jnp.take_along_axis(cache[tail].value[layer], slots_Bxl[:, :, None, None], axis=1)
            write(name, ci_B, compressor(cname)(tail_BxlxKxD)[:, 0], emit_B)
        o_cmp, scores_BxKxNb = _compressed_step(
            qg_BxKxGxDk, cache["kcmp"].value, cache["vcmp"].value, layer, t_B, a, S // a.lp, scale, cfg.attn_softcap
        )
        outputs["cmp"] = o_cmp.reshape(B, H, Dv).astype(q_BxHxDk.dtype)

    if "slc" in a.branches:
        if U:  # minmax's scores (mix: added to cmp's)
            kb = (cache["kmin"].value[layer], cache["kmax"].value[layer])
            mm = minmax_row_scores(qg_BxKxGxDk, *kb, t_B, lp=a.lp, sub=S // U, scale=scale)
            scores_BxKxNb = mm + scores_BxKxNb if a.scorer == "mix" else mm
        # Rows as select_blocks' query axis, so each row gets its own position.
        if a.scorer == "rescore":
            idx_BxKxN = _rescore_step(qg_BxKxGxDk, cache["kslc"].value[layer], scores_BxKxNb, t_B, a, scale)
        else:
            idx_BxKxN = select_blocks(scores_BxKxNb[None], a.lp, a.n, t_B)[0]
        used = idx_BxKxN >= 0
        pos_BxKxNxLp = jnp.where(used, idx_BxKxN, 0)[..., None] * a.lp + jnp.arange(a.lp, dtype=jnp.int32)
        vis = (used[..., None] & (pos_BxKxNxLp <= t_B[:, None, None, None])).reshape(B, K, 1, a.n * a.lp)
        pos_BxKxM = pos_BxKxNxLp.reshape(B, K, a.n * a.lp)
        k_idx = jnp.arange(K)[None, :, None]
        # Gather only the selected blocks from the full buffer (no per-layer copy of it).
        kg = cache["kslc"].value[layer, b_B[:, None, None], pos_BxKxM, k_idx]
        vg = cache["vslc"].value[layer, b_B[:, None, None], pos_BxKxM, k_idx]
        s = soft_cap(
            jnp.einsum("bkgd,bkmd->bkgm", qg_BxKxGxDk, kg, preferred_element_type=jnp.float32) * scale, cfg.attn_softcap
        )
        o = masked_softmax_attend(s, vis, vg, "bkgm,bkmd->bkgd")
        outputs["slc"] = o.reshape(B, H, Dv).astype(q_BxHxDk.dtype)

    if "win" in a.branches:
        w = a.w if window is None else window
        o = ring_attend(qg_BxKxGxDk, cache["kwin"].value[layer], cache["vwin"].value[layer], t_B, w, cfg.attn_softcap)
        outputs["win"] = o.reshape(B, H, Dv).astype(q_BxHxDk.dtype)
    return outputs


def ring_attend(qg_BxKxGxDk, kw_BxRxKxDk, vw_BxRxKxDv, t_B, window, softcap: float = 0.0) -> jax.Array:
    """One decode query per row over a ring of the last R keys (the window branch's, and dense
    attention's): [B, K, G, Dv] fp32. Ring slots hold positions in (t - R, t]; with R <= window
    only never-written slots and those older than the window are masked. `window` may be traced
    (a local or global layer of the scan); `softcap`: model.attn_softcap."""
    wp_BxR = ring_positions(t_B, kw_BxRxKxDk.shape[1])
    vis = ((wp_BxR >= 0) & (wp_BxR > t_B[:, None] - window))[:, None, None, :]
    scale = qg_BxKxGxDk.shape[-1] ** -0.5
    s = jnp.einsum("bkgd,brkd->bkgr", qg_BxKxGxDk, kw_BxRxKxDk, preferred_element_type=jnp.float32) * scale
    return masked_softmax_attend(soft_cap(s, softcap), vis, vw_BxRxKxDv, "bkgr,brkd->bkgd")


def fill_ring(ring: dict, k_BxPxKxD, v_BxPxKxD, layer, lengths_B) -> None:
    """Dense attention's prefill: the ring (kwin/vwin variables) holds each row's last R positions of its
    prompt (R: the cache's ring length)."""
    pos_BxR = ring_positions(lengths_B.astype(jnp.int32) - 1, ring["kwin"].value.shape[2])
    for name, x in (("kwin", k_BxPxKxD), ("vwin", v_BxPxKxD)):
        cache = ring[name].value
        ring[name].value = cache.at[layer].set(gather_rows(x, pos_BxR).astype(cache.dtype))


def decode_ring(ring: dict, q_BxHxDk, k_BxKxDk, v_BxKxDv, layer, t_B, window, softcap: float = 0.0) -> jax.Array:
    """Dense attention's decode step: writes position t_B[b] of each row into the ring, then attends over
    it: [B, H, Dv]."""
    B, H, Dk = q_BxHxDk.shape
    K = k_BxKxDk.shape[1]
    R = ring["kwin"].value.shape[2]
    t_B = t_B.astype(jnp.int32)
    b_B = jnp.arange(B)
    for name, x in (("kwin", k_BxKxDk), ("vwin", v_BxKxDv)):
        cache = ring[name].value
        ring[name].value = cache.at[layer, b_B, t_B % R].set(x.astype(cache.dtype))
    qg = q_BxHxDk.reshape(B, K, H // K, Dk)
    o = ring_attend(qg, ring["kwin"].value[layer], ring["vwin"].value[layer], t_B, window, softcap)
    return o.reshape(B, H, -1).astype(q_BxHxDk.dtype)


def _rescore_step(qg_BxKxGxDk, kslc_BxSxKxDk, scores_BxKxNb, t_B, a, scale: float) -> jax.Array:
    """[B, K, n]: `rescore` for one query a row (kernels/scorers.py): cmp's best scorer_candidates
    blocks, their keys gathered from the cache, re-ranked by each head's mass over them."""
    B, K = scores_BxKxNb.shape[:2]
    cand_BxKxM = select_blocks(scores_BxKxNb[None], a.lp, scorer_candidates(a), t_B)[0]
    pos_BxKxMxL = jnp.maximum(cand_BxKxM, 0)[..., None] * a.lp + jnp.arange(a.lp, dtype=jnp.int32)
    vis = (cand_BxKxM >= 0)[..., None] & (pos_BxKxMxL <= t_B[:, None, None, None])
    M = cand_BxKxM.shape[-1]
    kg = kslc_BxSxKxDk[jnp.arange(B)[:, None, None], pos_BxKxMxL.reshape(B, K, -1), jnp.arange(K)[None, :, None]]
    s = jnp.einsum("bkgd,bkmd->bkgm", qg_BxKxGxDk, kg, preferred_element_type=jnp.float32) * scale
    mass = candidate_mass(s.reshape(*s.shape[:3], M, a.lp), vis)
    return pick_candidates(mass, cand_BxKxM, t_B[:, None], a.lp, a.n)
