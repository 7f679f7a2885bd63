"""Pallas (Triton backend) `rescore`'s second stage (kernels/scorers.py): cmp's candidates re-ranked.

Maps the queries, the selection keys and each query's M candidate blocks (cmp's best M, from the
fused scoring + top-n kernel; -1: unused) to the n kept [B, T, K, n], with no score tensor: one
program holds one query position's G heads (padded to 16 rows, as the selection kernel's gather
layout) and walks its candidates once:
  1. per candidate, its lp keys' logits q . k (the keys the position sees), folded into each
     head's log-sum-exp over that block: a [Gp, Mp] tile of per-block log-masses in registers;
  2. per head the log-sum-exp over the candidates, each block's mass exp2(lse_b - lse) summed over
     the group's real heads, the forced blocks (0 and the position's two local ones) first, then
     the top n of the M by mass (block_scores_pallas' merge over candidate slots: ties to cmp's
     earlier candidate), written as block ids.
The program reads M x lp key rows (M = 64, lp = 64: 4,096) whatever T is, and no value: the XLA
path (scorers.select_rescore_xla) and decode compute the same softmax; they differ by float
rounding only, which the tests bound against a float64 reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from nsa_jax.kernels import pallas_common as pc
from nsa_jax.kernels.block_scores_pallas import _floor_div, _merge_top_n, _top_n_finish, _top_n_init
from nsa_jax.kernels.xla import EXCLUDED, FORCED

__all__ = ["select_rescore_pallas"]


def _rescore_kernel(*refs, lp, num_blocks, num_heads, group, group_padded, cand_slots, n_slots, scale_log2, has_offset):
    # Refs: [q_offset [1],] cand [Mp], q [T*H, Dk], k [Tp, Dk], idx [n_slots].
    q_offset, (cand_ref, q_ref, k_ref, idx_ref) = pc.split_offset(refs, has_offset)
    t = pl.program_id(0)
    kv = pl.program_id(2)
    g_Gp = lax.iota(jnp.int32, group_padded)
    real_Gp = g_Gp < group
    q_GpxD = q_ref[t * num_heads + kv * group + jnp.minimum(g_Gp, group - 1), :]
    tpos = t + q_offset  # the row's position: what completeness and the forced blocks read
    slot_M = lax.iota(jnp.int32, cand_slots)

    def body(s, lse_GpxM):
        blk = cand_ref[s]
        live = (blk >= 0) & (blk < num_blocks)
        start = jnp.clip(blk, 0, num_blocks - 1) * lp
        k_SxD = k_ref[pl.ds(start, lp), :]
        vis_1xS = (((start + lax.iota(jnp.int32, lp)) <= tpos) & live)[None, :]
        x = jnp.where(vis_1xS, pc.scores_log2(q_GpxD, k_SxD, scale_log2), pc.MASK_VALUE)
        m_Gp = jnp.max(x, axis=1)
        s_Gp = jnp.sum(jnp.where(vis_1xS, jnp.exp2(x - m_Gp[:, None]), 0.0), axis=1)
        lse_Gp = jnp.where(s_Gp > 0, m_Gp + jnp.log2(jnp.where(s_Gp > 0, s_Gp, 1.0)), pc.MASK_VALUE)
        return jnp.where(slot_M[None, :] == s, lse_Gp[:, None], lse_GpxM)

    lse_GpxM = lax.fori_loop(0, cand_slots, body, jnp.full((group_padded, cand_slots), pc.MASK_VALUE, jnp.float32))
    seen_GpxM = lse_GpxM > pc.MASK_VALUE / 2
    top_Gp = jnp.max(lse_GpxM, axis=1)
    total_Gp = jnp.sum(jnp.where(seen_GpxM, jnp.exp2(lse_GpxM - top_Gp[:, None]), 0.0), axis=1)
    all_Gp = top_Gp + jnp.log2(jnp.where(total_Gp > 0, total_Gp, 1.0))
    share_GpxM = jnp.where(seen_GpxM & real_Gp[:, None], jnp.exp2(lse_GpxM - all_Gp[:, None]), 0.0)
    mass_1xM = jnp.sum(share_GpxM, axis=0)[None, :]
    cand_1xM = cand_ref[slot_M][None, :]
    cur = _floor_div(tpos, lp)
    forced = (cand_1xM == 0) | (cand_1xM == cur) | (cand_1xM == cur - 1)
    ranked = jnp.where(forced, FORCED, jnp.where(cand_1xM >= 0, mass_1xM, EXCLUDED))
    # Slots, not block ids, ranked: equal masses go to the earlier slot, cmp's better candidate.
    top_val, top_slot = _merge_top_n(_top_n_init(1, n_slots), ranked, slot_M, n_slots)
    keep = _top_n_finish((top_val, top_slot))[0]
    idx_ref[...] = jnp.where(keep >= 0, cand_ref[jnp.clip(keep, 0, cand_slots - 1)], -1)


def _rescore_call(q, k, cand, off_1, lp, n, scale, interpret, num_warps, num_stages):
    b, t, h, dk0 = q.shape
    kvh = k.shape[2]
    dk = pc.padded_dim(dk0)
    nb = pl.cdiv(k.shape[1], lp)
    group = h // kvh
    group_padded = max(pc.MIN_DOT_DIM, pc.next_pow2(group))
    cand_slots, n_slots = pc.next_pow2(cand.shape[-1]), pc.next_pow2(n)
    q_f = pc.pad_axis(q, 3, dk).reshape(b, t * h, dk)
    k_p = pc.pad_axis(pc.pad_axis(k.astype(q.dtype), 1, nb * lp), 3, dk)
    cand_p = pc.pad_axis(cand.astype(jnp.int32), 3, cand_slots, value=-1)
    has_offset = off_1 is not None
    kernel = functools.partial(
        _rescore_kernel,
        lp=lp, num_blocks=nb, num_heads=h, group=group, group_padded=group_padded, cand_slots=cand_slots,
        n_slots=n_slots, scale_log2=scale * pc.LOG2E, has_offset=has_offset,
    )  # fmt: skip
    idx = pl.pallas_call(
        kernel,
        grid=(t, b, kvh),
        in_specs=[
            *[pc.OFFSET_SPEC] * has_offset,
            pl.BlockSpec((None, None, None, cand_slots), lambda i, bb, kv: (bb, i, kv, 0)),
            pl.BlockSpec((None, t * h, dk), lambda i, bb, kv: (bb, 0, 0)),
            pl.BlockSpec((None, nb * lp, None, dk), lambda i, bb, kv: (bb, 0, kv, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, None, n_slots), lambda i, bb, kv: (bb, i, kv, 0)),
        out_shape=jax.ShapeDtypeStruct((b, t, kvh, n_slots), jnp.int32),
        compiler_params=pc.compiler_params(num_warps, num_stages, dk),
        interpret=interpret,
        name="nsa_rescore_select",
    )(*pc.offset_operands(off_1), cand_p, q_f, k_p)
    return idx[..., :n]


# A custom_vjp call whose outputs are unused is dead code (as minmax_pallas' call); no gradient.
@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9))
def _rescore_select(q, k, cand, off_1, lp, n, scale, interpret, num_warps, num_stages):
    return _rescore_call(q, k, cand, off_1, lp, n, scale, interpret, num_warps, num_stages)


def _rescore_select_fwd(q, k, cand, off_1, lp, n, scale, interpret, num_warps, num_stages):
    return _rescore_call(q, k, cand, off_1, lp, n, scale, interpret, num_warps, num_stages), (q, k, cand)


def _rescore_select_bwd(lp, n, scale, interpret, num_warps, num_stages, res, ct):
    del lp, n, scale, interpret, num_warps, num_stages, ct
    q, k, cand = res
    return jnp.zeros_like(q), jnp.zeros_like(k), None, None  # block ids and the query offset: ints


_rescore_select.defvjp(_rescore_select_fwd, _rescore_select_bwd)


def select_rescore_pallas(
    q_BxTxHxDk,
    k_BxTxKxDk,
    cand_BxTxKxM,
    *,
    lp: int,
    n: int,
    scale: float | None = None,
    interpret: bool = False,
    q_offset=0,
    num_warps: int | None = None,
    num_stages: int = 2,
):
    """`rescore`'s blocks [B, T, K, n] int32 from cmp's candidates [B, T, K, M] (scorers.select_rescore_xla's
    contract). `k`: the selection keys of the whole sequence; row r of q is the query at position
    r + q_offset (Python int or traced int32)."""
    if lp < 1 or n < 1 or cand_BxTxKxM.shape[-1] < 1:
        raise ValueError(f"lp={lp}, n={n} and the candidates ({cand_BxTxKxM.shape[-1]}) must be >= 1")
    b, t, h, dk = q_BxTxHxDk.shape
    pc.check_query_offset(q_offset, t)
    scale = dk**-0.5 if scale is None else scale
    sg = lax.stop_gradient
    off_1 = pc.offset_operand(q_offset)
    return _rescore_select(
        sg(q_BxTxHxDk), sg(k_BxTxKxDk), sg(cand_BxTxKxM), off_1, lp, n, scale, bool(interpret), num_warps, num_stages
    )
