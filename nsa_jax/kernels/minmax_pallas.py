"""Pallas (Triton backend) `minmax` block scoring fused with top-n selection (kernels/scorers.py).

Maps the queries and the selection keys' sub-block extremes (k_min, k_max [B, U, K, Dk]: one row per
sub-block of `sub` keys, `scorers.key_bounds`) to the selected blocks [B, T, K, n], with no score
tensor: one program holds P query positions of one KV head and its G heads' query tiles, and walks the
blocks it may choose twice, tile by tile of N blocks:
  1. per head, the block logits (the largest over a block's lp / sub sub-blocks of
     relu(q) . k_max + min(q, 0) . k_min, two matmuls each) folded into an online log-sum-exp over
     the blocks the query has complete;
  2. the same logits again, each head's softmax exp2(logit - lse) summed over the group, ranked by
     `select_blocks`' rules and merged into the running top-n (block_scores_pallas' merge: ties to
     the lower block).
So the kernel reads 2 x T / sub key rows per pass where the compressed scorer's reads T / d, and
keeps the XLA path's definition (scorers.select_minmax_xla); the two differ by float rounding only
(exp2 of a log-sum-exp against a softmax), which the tests bound against a float64 reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from nsa_jax.kernels import pallas_common as pc
from nsa_jax.kernels.block_scores_pallas import (
    BlockSelectSizes,
    _block_count,
    _floor_div,
    _merge_top_n,
    _ranking,
    _tile_bound,
    _top_n_finish,
    _top_n_init,
    fit_select_sizes,
)
from nsa_jax.kernels.scorers import key_bounds

__all__ = ["select_minmax_pallas"]


def _head_logits(qp_PxD, qn_PxD, kmin_ref, kmax_ref, j_N, per: int, scale_log2: float):
    """[P, N] fp32 base-2 logits of blocks j_N for one head: the largest sub-block bound, times the scale
    (positive: the scale commutes with the max)."""
    best = None
    for r in range(per):  # static: the block's sub-blocks, in order
        u_N = j_N * per + r
        kmax_NxD, kmin_NxD = kmax_ref[u_N, :], kmin_ref[u_N, :]
        ub = pc.scores_log2(qp_PxD, kmax_NxD, scale_log2) + pc.scores_log2(qn_PxD, kmin_NxD, scale_log2)
        best = ub if best is None else jnp.maximum(best, ub)
    return best


def _minmax_select_kernel(*refs, seq, heads, group, lp, per, num_blocks, block_pos, block_blocks, num_tiles,
                          n_slots, scale_log2, has_offset):  # fmt: skip
    # Refs: [q_offset [1],] q [T*H, Dk], kmin [Up, Dk], kmax [Up, Dk], idx [P, S].
    q_offset, (q_ref, kmin_ref, kmax_ref, idx_ref) = pc.split_offset(refs, has_offset)
    t_P = pl.program_id(0) * block_pos + lax.iota(jnp.int32, block_pos)
    valid_P = t_P < seq
    t_c = jnp.minimum(t_P, seq - 1)
    kv = pl.program_id(2)
    tsel_P = t_P + q_offset  # the rows' positions: what the selection rules and completeness read
    cur_P = _floor_div(tsel_P, lp)
    hi = _tile_bound(cur_P, valid_P, block_blocks, num_tiles)
    q_tiles = []
    for g in range(group):  # static: the G heads sharing this KV head's selection
        q_PxD = q_ref[t_c * heads + kv * group + g, :]
        zero = jnp.zeros((), q_PxD.dtype)
        q_tiles.append((jnp.maximum(q_PxD, zero), jnp.minimum(q_PxD, zero)))

    def logits(g, j_N):
        done_PxN = ((j_N[None, :] + 1) * lp <= tsel_P[:, None] + 1) & valid_P[:, None]
        x = _head_logits(*q_tiles[g], kmin_ref, kmax_ref, j_N, per, scale_log2)
        return jnp.where(done_PxN, x, pc.MASK_VALUE), done_PxN

    def lse_body(bt, carry):
        j_N = bt * block_blocks + lax.iota(jnp.int32, block_blocks)
        out = []
        for g, (m_P, s_P) in enumerate(carry):
            x, done = logits(g, j_N)
            m_new = jnp.maximum(m_P, jnp.max(x, axis=1))
            s_new = s_P * jnp.exp2(m_P - m_new) + jnp.sum(jnp.where(done, jnp.exp2(x - m_new[:, None]), 0.0), axis=1)
            out.append((m_new, s_new))
        return tuple(out)

    init = tuple(
        (jnp.full((block_pos,), pc.MASK_VALUE, jnp.float32), jnp.zeros((block_pos,), jnp.float32)) for _ in q_tiles
    )
    stats = lax.fori_loop(0, hi, lse_body, init)
    # A row with no complete block scores 0 everywhere (masked_softmax's empty rows).
    lse = [m_P + jnp.log2(jnp.where(s_P > 0, s_P, 1.0)) for m_P, s_P in stats]

    def select_body(bt, carry):
        j_N = bt * block_blocks + lax.iota(jnp.int32, block_blocks)
        score = jnp.zeros((block_pos, block_blocks), jnp.float32)
        for g in range(group):
            x, done = logits(g, j_N)
            score = score + jnp.where(done, jnp.exp2(x - lse[g][:, None]), 0.0)
        return _merge_top_n(carry, _ranking(score, j_N, cur_P, num_blocks), j_N, n_slots)

    carry = lax.fori_loop(0, hi, select_body, _top_n_init(block_pos, n_slots))
    idx_ref[...] = _top_n_finish(carry)


def _minmax_call(q, kmin, kmax, off_1, lp, per, nb, n, scale, interpret, bsz: BlockSelectSizes):
    b, t, h, dk0 = q.shape
    kvh = kmin.shape[2]
    dk = pc.padded_dim(dk0)
    tp = pl.cdiv(t, bsz.block_pos) * bsz.block_pos
    nbp = pl.cdiv(nb, bsz.block_blocks) * bsz.block_blocks
    up = nbp * per
    q_f = pc.pad_axis(q, 3, dk).reshape(b, t * h, dk)
    # The extremes in the queries' dtype (a bf16 key's min and max are bf16 values: exact).
    kmin_p, kmax_p = (pc.pad_axis(pc.pad_axis(x.astype(q.dtype), 1, up), 3, dk) for x in (kmin, kmax))
    n_slots = pc.next_pow2(n)
    has_offset = off_1 is not None
    kernel = functools.partial(
        _minmax_select_kernel,
        seq=t, heads=h, group=h // kvh, lp=lp, per=per, num_blocks=nb, block_pos=bsz.block_pos,
        block_blocks=bsz.block_blocks, num_tiles=nbp // bsz.block_blocks, n_slots=n_slots,
        scale_log2=scale * pc.LOG2E, has_offset=has_offset,
    )  # fmt: skip
    bound_spec = pl.BlockSpec((None, up, None, dk), lambda i, bb, kv: (bb, 0, kv, 0))
    idx = pl.pallas_call(
        kernel,
        grid=(tp // bsz.block_pos, b, kvh),
        in_specs=[
            *[pc.OFFSET_SPEC] * has_offset,
            pl.BlockSpec((None, t * h, dk), lambda i, bb, kv: (bb, 0, 0)),
            bound_spec,
            bound_spec,
        ],
        # Written in the layer's [B, T, K, n] order: no transpose after (none at all when
        # T is a multiple of the position tile and n a power of two).
        out_specs=pl.BlockSpec((None, bsz.block_pos, None, n_slots), lambda i, bb, kv: (bb, i, kv, 0)),
        out_shape=jax.ShapeDtypeStruct((b, tp, kvh, n_slots), jnp.int32),
        compiler_params=pc.compiler_params(bsz.num_warps, bsz.num_stages, dk),
        interpret=interpret,
        name="nsa_minmax_select",
    )(*pc.offset_operands(off_1), q_f, kmin_p, kmax_p)
    return idx[:, :t, :, :n]


# A custom_vjp call whose outputs are unused is dead code (a bare pallas_call is not: see
# compressed_pallas); the selection has no gradient.
@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9, 10))
def _minmax_select(q, kmin, kmax, off_1, lp, per, nb, n, scale, interpret, bsz):
    return _minmax_call(q, kmin, kmax, off_1, lp, per, nb, n, scale, interpret, bsz)


def _minmax_select_fwd(q, kmin, kmax, off_1, lp, per, nb, n, scale, interpret, bsz):
    return _minmax_call(q, kmin, kmax, off_1, lp, per, nb, n, scale, interpret, bsz), (q, kmin, kmax)


def _minmax_select_bwd(lp, per, nb, n, scale, interpret, bsz, res, ct):
    del lp, per, nb, n, scale, interpret, bsz, ct
    return (*(jnp.zeros_like(x) for x in res), None)  # the query offset: an int


_minmax_select.defvjp(_minmax_select_fwd, _minmax_select_bwd)


def select_minmax_pallas(
    q_BxTxHxDk,
    k_BxTxKxDk,
    *,
    lp: int,
    n: int,
    sub: int,
    scale: float | None = None,
    interpret: bool = False,
    select_sizes: BlockSelectSizes | None = None,
    q_offset=0,
    num_blocks: int | None = None,
):
    """The `minmax` scorer's selected blocks [B, T, K, n] int32 (scorers.select_minmax_xla's contract).

    `k`: the selection keys of the whole sequence (their sub-block extremes are made once here, in XLA);
    row r of q is the query at position r + q_offset (Python int or traced int32), whose blocks of the
    whole sequence (`num_blocks`, default ceil(keys / lp)) it ranks.
    """
    if lp < 1 or n < 1 or sub < 1 or lp % sub:
        raise ValueError(f"lp={lp}, n={n} and sub={sub} must be >= 1 with sub dividing lp")
    b, t, h, dk = q_BxTxHxDk.shape
    pc.check_query_offset(q_offset, t)
    nb = _block_count(k_BxTxKxDk.shape[1], lp, num_blocks)
    ssz = fit_select_sizes(select_sizes, pc.padded_dim(dk), q_BxTxHxDk.dtype.itemsize)
    scale = dk**-0.5 if scale is None else scale
    sg = lax.stop_gradient
    kmin, kmax = key_bounds(sg(k_BxTxKxDk), lp, sub, nb)
    off_1 = pc.offset_operand(q_offset)
    return _minmax_select(sg(q_BxTxHxDk), kmin, kmax, off_1, lp, lp // sub, nb, n, scale, bool(interpret), ssz)
