"""Pallas (Triton backend) block scoring and top-n selection for the compressed branch.

Maps the compressed branch's queries, compressed keys and forward log-sum-exp to what the selection branch
needs, without the probability tensor [B, K, T, Tc] or, on the selection path, the block scores [B, K, T, T/lp]:
* `compressed_attention_select_pallas`: compressed attention (compressed_pallas's flash kernels, or cuDNN
  with a separate log-sum-exp pass: `attention="cudnn"`) and block indices [B, T, K, n], the contract of
  `kernels.xla.select_blocks` over the block scores (docs/NSA.md, "Selection");
* `compressed_attention_scores_pallas`: the same attention and the block scores [B, T, K, Nb] fp32;
* `select_blocks_pallas`: the top-n alone over a given score tensor (the test bed of the top-n rules).
Exactness: every block's score is summed in one fixed order, score[j] = sum_r (sum_g p[g, i_r]), r then g
ascending, as block_scores_from_cmp sums, so equal probabilities give bitwise-equal scores and exact ties
stay ties; the running top-n keeps select_blocks' order (value descending, index ascending, -1 for slots
without a candidate). `select_blocks_pallas` equals `select_blocks` exactly for every score tensor, ties
included. The fused kernel's scores come from the log-sum-exp, the XLA path's from a softmax, so the two
differ by float rounding: the tests hold the fused kernel to a float64 reference wherever it has no near-tie
at the cut, and on constructed exact ties. With `q_offset` (pallas_common, "Query offset") row r is the
query at position r + q_offset, the selection rules follow `t_T` and `num_blocks` gives the whole sequence's
blocks. The tiling and the top-n merge: docs/DESIGN_NOTES.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from nsa_jax.kernels import pallas_common as pc
from nsa_jax.kernels.compressed_pallas import (
    CompressedBlockSizes,
    cmp_layout,
    compressed_attention_lse_pallas,
    compressed_lse_pallas,
)
from nsa_jax.kernels.cudnn import compressed_attention_grouped
from nsa_jax.kernels.xla import EXCLUDED, FORCED  # the ranking values of select_blocks, shared

# Below every ranking value: empty slots of the running top-n and blocks past the last one.
_EMPTY = -3e38
_NO_BLOCK = 2**30


@dataclasses.dataclass(frozen=True)
class BlockSelectSizes:
    """Tiling knobs (powers of two >= 16).

    The default keeps ``nsa_block_select`` free of register spills on sm_80 and sm_90 at
    head dim 64 and G = 6: each of the G query tiles stays live across the ``win``
    key offsets of a block tile, so the position tile is the lever (64 positions
    spilled about 2 KiB per thread on sm_80; 16 spill none, with 4x the programs,
    which also fills the SMs at short T).

    Attributes:
      block_pos: query positions per program (the matmul's M dimension).
      block_blocks: selection blocks per inner step (the matmul's N dimension).
      num_warps: Triton warps per program (None: pick from the head dim).
      num_stages: Triton software-pipelining depth.
    """

    block_pos: int = 16
    block_blocks: int = 64
    num_warps: int | None = None
    num_stages: int = 2


@dataclasses.dataclass(frozen=True)
class _ScoreGeometry:
    """Static facts of one call: shapes, the overlap window and the key layout."""

    seq: int
    num_heads: int
    group: int
    lay: pc.KeyLayout
    stride: int  # s = lp / d compressed tokens per selection block
    lead: int  # l/d - 1 tokens of block j-1's span that overlap block j
    win: int  # (lp + l)/d - 1 tokens per block
    key_rows: int  # rows of the padded key buffer
    block_pos: int
    block_blocks: int
    scale_log2: float


def _block_score_tile(q_ref, k_ref, lse_ref, t_P, valid_P, kv, j_N, geo: _ScoreGeometry, q_offset):
    """fp32 [P, N] Eq. 9 scores of blocks ``j_N`` for the query rows ``t_P`` (at positions ``t_P + q_offset``),
    summed over the group.

    Order: for r ascending, (for g ascending p[g]) then added to the block's sum.
    """
    t_c = jnp.minimum(t_P, geo.seq - 1)
    score_PxN = jnp.zeros((geo.block_pos, geo.block_blocks), jnp.float32)
    for r in range(geo.win):  # static: the tokens overlapping each block, in order
        i_N = j_N * geo.stride - geo.lead + r
        # Tokens before 0 are the left padding of block 0; past num_keys, layout_visible masks them.
        vis_PxN = pc.layout_visible(t_c, valid_P, i_N, geo.lay, q_offset) & (i_N >= 0)[None, :]
        k_NxDk = k_ref[jnp.clip(i_N, 0, geo.key_rows - 1), :]
        p_PxN = jnp.zeros((geo.block_pos, geo.block_blocks), jnp.float32)
        for g in range(geo.group):  # static: the G heads sharing this KV head's selection
            q_PxDk = q_ref[t_c * geo.num_heads + kv * geo.group + g, :]
            lse_P = lse_ref[t_c * geo.group + g]
            s_PxN = pc.scores_log2(q_PxDk, k_NxDk, geo.scale_log2)
            p_PxN = p_PxN + jnp.where(vis_PxN, jnp.exp2(s_PxN - lse_P[:, None]), 0.0)
        score_PxN = score_PxN + p_PxN
    return score_PxN


def _floor_div(x, m: int):
    """Floor division by a positive constant (lax.div truncates toward zero)."""
    q = lax.div(x, m)
    return jnp.where((x < 0) & (q * m != x), q - 1, q)


def _ranking(score_PxN, j_N, cur_P, num_blocks: int):
    """select_blocks' ranking values: forced 1e9, candidates their score, others -1e9, no block _EMPTY."""
    j_1xN, cur_Px1 = j_N[None, :], cur_P[:, None]
    forced = (j_1xN == 0) | (j_1xN == cur_Px1) | (j_1xN == cur_Px1 - 1)
    ranked = jnp.where(forced, FORCED, jnp.where(j_1xN <= cur_Px1, score_PxN, EXCLUDED))
    return jnp.where(j_1xN < num_blocks, ranked, _EMPTY)


def _merge_top_n(carry, ranked_PxN, j_N, n_slots: int):
    """Running top-n (values, indices) [P, n_slots] merged with one tile of ranked blocks.

    Every running entry has a lower block index than every tile entry (tiles come
    in order), and both are searched for the lowest index holding the maximum,
    so equal values go to the lower block, as in lax.top_k.
    """
    run_val, run_idx = carry
    rows = ranked_PxN.shape[0]
    tile_idx = jnp.broadcast_to(j_N[None, :], ranked_PxN.shape)
    tile_val = ranked_PxN
    slot_1xS = lax.iota(jnp.int32, n_slots)[None, :]
    new_val = jnp.full((rows, n_slots), _EMPTY, jnp.float32)
    new_idx = jnp.full((rows, n_slots), _NO_BLOCK, jnp.int32)
    for s in range(n_slots):  # static: one extraction per slot, best first
        m_P = jnp.maximum(jnp.max(run_val, axis=1), jnp.max(tile_val, axis=1))
        m_Px1 = m_P[:, None]
        pick_P = jnp.minimum(
            jnp.min(jnp.where(run_val == m_Px1, run_idx, _NO_BLOCK), axis=1),
            jnp.min(jnp.where(tile_val == m_Px1, tile_idx, _NO_BLOCK), axis=1),
        )
        pick_Px1 = pick_P[:, None]
        new_val = jnp.where(slot_1xS == s, m_Px1, new_val)
        new_idx = jnp.where(slot_1xS == s, pick_Px1, new_idx)
        run_val = jnp.where(run_idx == pick_Px1, _EMPTY, run_val)
        tile_val = jnp.where(tile_idx == pick_Px1, _EMPTY, tile_val)
    return new_val, new_idx


def _top_n_init(rows: int, n_slots: int):
    return jnp.full((rows, n_slots), _EMPTY, jnp.float32), jnp.full((rows, n_slots), _NO_BLOCK, jnp.int32)


def _top_n_finish(carry):
    """Block indices, -1 for slots without a candidate (select_blocks: value <= -5e8)."""
    val, idx = carry
    return jnp.where(val > EXCLUDED / 2, idx, -1)


def _tile_bound(cur_P, valid_P, block_blocks: int, num_tiles: int):
    """Block tiles [0, hi) holding a forced block or a candidate of any row of the program."""
    last = jnp.max(jnp.where(valid_P, jnp.maximum(cur_P, 0), 0))
    return jnp.minimum(lax.div(last, block_blocks) + 1, num_tiles)


# ---------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------


def _scores_kernel(*refs, geo: _ScoreGeometry, num_tiles, has_offset):
    # Refs: [q_offset [1],] q [T*H, Dk], k [Tkp, Dk], lse [Rp] (row t*G + g, base 2), scores [P, Nbp].
    q_offset, (q_ref, k_ref, lse_ref, s_ref) = pc.split_offset(refs, has_offset)
    t_P = pl.program_id(0) * geo.block_pos + lax.iota(jnp.int32, geo.block_pos)
    valid_P = t_P < geo.seq
    kv = pl.program_id(2)

    def body(bt, carry):
        j0 = bt * geo.block_blocks
        j_N = j0 + lax.iota(jnp.int32, geo.block_blocks)
        s_ref[:, pl.ds(j0, geo.block_blocks)] = _block_score_tile(
            q_ref, k_ref, lse_ref, t_P, valid_P, kv, j_N, geo, q_offset
        )
        return carry

    lax.fori_loop(0, num_tiles, body, 0)


def _select_kernel(*refs, geo: _ScoreGeometry, lp, num_blocks, num_tiles, n_slots, has_offset):
    # Refs: as _scores_kernel, tsel [P] (the positions the selection rules see), idx [P, S].
    q_offset, (q_ref, k_ref, lse_ref, tsel_ref, idx_ref) = pc.split_offset(refs, has_offset)
    t_P = pl.program_id(0) * geo.block_pos + lax.iota(jnp.int32, geo.block_pos)
    valid_P = t_P < geo.seq
    kv = pl.program_id(2)
    cur_P = _floor_div(tsel_ref[...], lp)

    def body(bt, carry):
        j_N = bt * geo.block_blocks + lax.iota(jnp.int32, geo.block_blocks)
        score_PxN = _block_score_tile(q_ref, k_ref, lse_ref, t_P, valid_P, kv, j_N, geo, q_offset)
        return _merge_top_n(carry, _ranking(score_PxN, j_N, cur_P, num_blocks), j_N, n_slots)

    hi = _tile_bound(cur_P, valid_P, geo.block_blocks, num_tiles)
    carry = lax.fori_loop(0, hi, body, _top_n_init(geo.block_pos, n_slots))
    idx_ref[...] = _top_n_finish(carry)


def _select_from_scores_kernel(
    s_ref, tsel_ref, idx_ref, *, seq, lp, num_blocks, block_pos, block_blocks, num_tiles, n_slots
):
    # Refs: scores [P, Nbp] fp32, tsel [P], idx [P, S].
    t_P = pl.program_id(0) * block_pos + lax.iota(jnp.int32, block_pos)
    valid_P = t_P < seq
    cur_P = _floor_div(tsel_ref[...], lp)

    def body(bt, carry):
        j0 = bt * block_blocks
        j_N = j0 + lax.iota(jnp.int32, block_blocks)
        score_PxN = s_ref[:, pl.ds(j0, block_blocks)]
        return _merge_top_n(carry, _ranking(score_PxN, j_N, cur_P, num_blocks), j_N, n_slots)

    hi = _tile_bound(cur_P, valid_P, block_blocks, num_tiles)
    carry = lax.fori_loop(0, hi, body, _top_n_init(block_pos, n_slots))
    idx_ref[...] = _top_n_finish(carry)


# ---------------------------------------------------------------------------
# pallas_call wrappers
# ---------------------------------------------------------------------------


def _check_geometry(l: int, d: int, lp: int):
    if l < 1 or d < 1 or lp < 1:
        raise ValueError(f"l={l}, d={d} and lp={lp} must be >= 1")
    if l % d or lp % d:
        raise ValueError(f"d={d} must divide l={l} and lp={lp} (aligned selection blocks, Eq. 9)")


def _geometry(q, kc, lay, l, d, lp, scale, bsz: BlockSelectSizes, key_rows):
    _, t, h, _ = q.shape
    group = h // kc.shape[2]
    return _ScoreGeometry(
        seq=t,
        num_heads=h,
        group=group,
        lay=lay,
        stride=lp // d,
        lead=l // d - 1,
        win=(lp + l) // d - 1,
        key_rows=key_rows,
        block_pos=bsz.block_pos,
        block_blocks=bsz.block_blocks,
        scale_log2=scale * pc.LOG2E,
    )


def _score_inputs(q, kc, bsz: BlockSelectSizes):
    b, t, h, _ = q.shape
    dk = pc.padded_dim(q.shape[-1])
    tkp = pl.cdiv(kc.shape[1], 16) * 16
    q_f = pc.pad_axis(q, 3, dk).reshape(b, t * h, dk)
    k_p = pc.pad_axis(pc.pad_axis(kc, 1, tkp), 3, dk)
    tp = pl.cdiv(t, bsz.block_pos) * bsz.block_pos
    return q_f, k_p, dk, tkp, tp


def _score_specs(t_h, tkp, dk, rows_padded):
    return [
        pl.BlockSpec((None, t_h, dk), lambda i, bb, kv: (bb, 0, 0)),
        pl.BlockSpec((None, tkp, None, dk), lambda i, bb, kv: (bb, 0, kv, 0)),
        pl.BlockSpec((None, None, rows_padded), lambda i, bb, kv: (bb, kv, 0)),
    ]


def _scores_call(q, kc, lse, off_1, lay, l, d, lp, nb, scale, interpret, bsz: BlockSelectSizes):
    """[B, K, T, Nb] fp32 block scores."""
    b, t, h, _ = q.shape
    kvh = kc.shape[2]
    q_f, k_p, dk, tkp, tp = _score_inputs(q, kc, bsz)
    nbp = pl.cdiv(nb, bsz.block_blocks) * bsz.block_blocks
    geo = _geometry(q, kc, lay, l, d, lp, scale, bsz, tkp)
    has_offset = off_1 is not None
    scores = pl.pallas_call(
        functools.partial(_scores_kernel, geo=geo, num_tiles=nbp // bsz.block_blocks, has_offset=has_offset),
        grid=(tp // bsz.block_pos, b, kvh),
        in_specs=[pc.OFFSET_SPEC] * has_offset + _score_specs(t * h, tkp, dk, lse.shape[-1]),
        out_specs=pl.BlockSpec((None, None, bsz.block_pos, nbp), lambda i, bb, kv: (bb, kv, i, 0)),
        out_shape=jax.ShapeDtypeStruct((b, kvh, tp, nbp), jnp.float32),
        compiler_params=pc.compiler_params(bsz.num_warps, bsz.num_stages, dk),
        interpret=interpret,
        name="nsa_block_scores",
    )(*pc.offset_operands(off_1), q_f, k_p, lse)
    return scores[:, :, :t, :nb]


def _select_call(q, kc, lse, t_T, off_1, lay, l, d, lp, nb, n, scale, interpret, bsz: BlockSelectSizes):
    """[B, K, T, n] int32 block indices, no score tensor."""
    b, t, h, _ = q.shape
    kvh = kc.shape[2]
    q_f, k_p, dk, tkp, tp = _score_inputs(q, kc, bsz)
    nbp = pl.cdiv(nb, bsz.block_blocks) * bsz.block_blocks
    n_slots = pc.next_pow2(n)
    geo = _geometry(q, kc, lay, l, d, lp, scale, bsz, tkp)
    has_offset = off_1 is not None
    kernel = functools.partial(
        _select_kernel,
        geo=geo,
        lp=lp,
        num_blocks=nb,
        num_tiles=nbp // bsz.block_blocks,
        n_slots=n_slots,
        has_offset=has_offset,
    )
    idx = pl.pallas_call(
        kernel,
        grid=(tp // bsz.block_pos, b, kvh),
        in_specs=[
            *[pc.OFFSET_SPEC] * has_offset,
            *_score_specs(t * h, tkp, dk, lse.shape[-1]),
            pl.BlockSpec((bsz.block_pos,), lambda i, bb, kv: (i,)),
        ],
        out_specs=pl.BlockSpec((None, None, bsz.block_pos, n_slots), lambda i, bb, kv: (bb, kv, i, 0)),
        out_shape=jax.ShapeDtypeStruct((b, kvh, tp, n_slots), jnp.int32),
        compiler_params=pc.compiler_params(bsz.num_warps, bsz.num_stages, dk),
        interpret=interpret,
        name="nsa_block_select",
    )(*pc.offset_operands(off_1), q_f, k_p, lse, pc.pad_axis(t_T.astype(jnp.int32), 0, tp))
    return idx[:, :, :t, :n]


# A bare pallas_call is never removed as dead code, but a custom_vjp call whose outputs
# are unused is (see compressed_pallas): a layer without the selection branch, or a trace
# that only needs the parameters, launches neither kernel. Neither output has a gradient.
@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9, 10, 11))
def _block_scores(q, kc, lse, off_1, lay, l, d, lp, nb, scale, interpret, bsz):
    return _scores_call(q, kc, lse, off_1, lay, l, d, lp, nb, scale, interpret, bsz)


def _block_scores_fwd(q, kc, lse, off_1, lay, l, d, lp, nb, scale, interpret, bsz):
    return _scores_call(q, kc, lse, off_1, lay, l, d, lp, nb, scale, interpret, bsz), (q, kc, lse)


def _block_scores_bwd(lay, l, d, lp, nb, scale, interpret, bsz, res, ct):
    del lay, l, d, lp, nb, scale, interpret, bsz, ct
    return (*(jnp.zeros_like(x) for x in res), None)  # the query offset (int, or None): no gradient


_block_scores.defvjp(_block_scores_fwd, _block_scores_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10, 11, 12, 13))
def _block_select(q, kc, lse, t_T, off_1, lay, l, d, lp, nb, n, scale, interpret, bsz):
    return _select_call(q, kc, lse, t_T, off_1, lay, l, d, lp, nb, n, scale, interpret, bsz)


def _block_select_fwd(q, kc, lse, t_T, off_1, lay, l, d, lp, nb, n, scale, interpret, bsz):
    return _select_call(q, kc, lse, t_T, off_1, lay, l, d, lp, nb, n, scale, interpret, bsz), (q, kc, lse)


def _block_select_bwd(lay, l, d, lp, nb, n, scale, interpret, bsz, res, ct):
    del lay, l, d, lp, nb, n, scale, interpret, bsz, ct
    return (*(jnp.zeros_like(x) for x in res), None, None)  # t_T and the query offset: ints


_block_select.defvjp(_block_select_fwd, _block_select_bwd)


def select_smem_estimates(
    bsz: BlockSelectSizes, dk: int, itemsize: int, group: int = 1, win: int = 1
) -> dict[str, int]:
    """Shared-memory bytes of the scoring kernel: a query tile and a key tile per matmul of the block loop,
    or, with the call's `group` (G query tiles, each live across the block tile) and `win` (the key tiles of
    the compressed tokens overlapping a block), all of them at once as Triton keeps them: at head dim 256,
    G = 4 and win = 5 it asked an A100 for 197,120 bytes, which this gives within 1% (2 x (4 x 16 + 5 x 64)
    x 256 = 196,608)."""
    if group == 1 and win == 1:
        looped = (bsz.block_pos * dk, bsz.block_blocks * dk)
        return {"nsa_block_scores": pc.smem_estimate(looped=looped, num_stages=bsz.num_stages, itemsize=itemsize)}
    live = (group * bsz.block_pos * dk, win * bsz.block_blocks * dk)
    return {"nsa_block_scores": pc.smem_estimate(once=live, num_stages=bsz.num_stages, itemsize=itemsize)}


def fit_select_sizes(
    bsz: BlockSelectSizes | None, dk: int, itemsize: int, group: int = 1, win: int = 1
) -> BlockSelectSizes:
    """The tiling to use: the default halved (larger tile first) until it fits the A100 budget, or
    the given one, which must fit (one clear error otherwise); `group`, `win`: select_smem_estimates'."""

    def need(b):
        return select_smem_estimates(b, dk, itemsize, group, win)["nsa_block_scores"]

    if bsz is None:
        bsz = BlockSelectSizes()
        while need(bsz) > pc.SMEM_BUDGET_BYTES:
            name = "block_blocks" if bsz.block_blocks >= bsz.block_pos else "block_pos"
            if getattr(bsz, name) <= pc.MIN_DOT_DIM:
                break
            bsz = dataclasses.replace(bsz, **{name: getattr(bsz, name) // 2})
    pc.check_tile_size("block_pos", bsz.block_pos)
    pc.check_tile_size("block_blocks", bsz.block_blocks)
    knobs = "block_pos / block_blocks (BlockSelectSizes), num_stages"
    pc.check_smem(select_smem_estimates(bsz, dk, itemsize, group, win), knobs)
    return bsz


# What computes the compressed branch's attention output (the scores always come from Pallas).
ATTENTIONS = ("flash", "cudnn")


def _attention_and_lse(q, kc, vc, l, d, scale, interpret, block_sizes, attention, q_offset):
    """(o, lse, layout, scale) of the compressed branch.

    ``flash``: the branch's flash kernels, whose forward also gives the lse. ``cudnn``:
    o from one fused causal attention over the regrouped branch (kernels/cudnn.py; XLA's
    attention when interpreted, off a GPU) and the lse from its own q k^T pass; not under
    a query offset, which a plain causal mask over the regrouped sequence cannot express.
    """
    if attention not in ATTENTIONS:
        raise ValueError(f"compressed attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")
    if attention == "cudnn" and not pc.is_static_zero(q_offset):
        raise ValueError("compressed attention cudnn takes no query offset: use flash with q_offset")
    kw = dict(l=l, d=d, scale=scale, interpret=interpret, block_sizes=block_sizes, q_offset=q_offset)
    if attention == "cudnn":
        lse, scale = compressed_lse_pallas(q, kc, **kw)
        impl = "xla" if interpret else "cudnn"
        o = compressed_attention_grouped(q, kc, vc, l=l, d=d, scale=scale, implementation=impl)
    else:
        o, lse, scale = compressed_attention_lse_pallas(q, kc, vc, **kw)
    return o, lse, cmp_layout(kc.shape[1], q.shape[1], l, d, q_offset), scale


def _block_count(t: int, lp: int, num_blocks: int | None) -> int:
    """Selection blocks of the sequence: ``num_blocks``, else those of q's ``t`` positions, ceil(t / lp)."""
    if num_blocks is None:
        return pl.cdiv(t, lp)
    if num_blocks < 1:
        raise ValueError(f"num_blocks={num_blocks} must be >= 1")
    return int(num_blocks)


def _selection_positions(t: int, t_T, q_offset):
    """int32 [t]: the positions the selection rules see, ``t_T`` as given, else the rows' own q_offset + 0..t-1."""
    if t_T is None:
        return pc.shift(jnp.arange(t, dtype=jnp.int32), q_offset)
    if t_T.shape != (t,):
        raise ValueError(f"t_T must have shape ({t},), got {t_T.shape}")
    return t_T


def compressed_attention_only(q, kc, vc, *, l, d, lp, scale=None, interpret=False, attention="flash", q_offset=0,
                              num_blocks=None, block_sizes: CompressedBlockSizes | None = None):  # fmt: skip
    """o_BxTxHxDv of the compressed branch alone (a scorer that does not read its probabilities):
    the flash kernels, or cuDNN's fused attention with no log-sum-exp pass. `lp`, `num_blocks`: unused,
    for the callers' one set of arguments."""
    del num_blocks
    _check_geometry(l, d, lp)
    if attention == "cudnn":
        if not pc.is_static_zero(q_offset):
            raise ValueError("compressed attention cudnn takes no query offset: use flash with q_offset")
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        impl = "xla" if interpret else "cudnn"
        return compressed_attention_grouped(q, kc, vc, l=l, d=d, scale=scale, implementation=impl)
    return _attention_and_lse(q, kc, vc, l, d, scale, interpret, block_sizes, attention, q_offset)[0]


def compressed_attention_scores_pallas(
    q_BxTxHxDk, kc_BxTcxKxDk, vc_BxTcxKxDv, *, l: int, d: int, lp: int, scale: float | None = None,
    interpret: bool = False, block_sizes: CompressedBlockSizes | None = None,
    select_sizes: BlockSelectSizes | None = None, attention: str = "flash", q_offset=0, num_blocks: int | None = None,
):  # fmt: skip
    """Compressed-branch attention and its selection-block scores.

    Returns o_BxTxHxDv (differentiable in q, kc, vc; as compressed_attention_pallas)
    and scores_BxTxKxNb fp32, Nb = num_blocks (None: ceil(T / lp)): Eq. 9 sums of
    the group probabilities (no gradient). No [B, K, T, Tc] probability tensor exists.
    `attention`: what computes o, ``flash`` (the Pallas kernels) or ``cudnn`` (see
    compressed_attention_select_pallas). `q_offset`: row r of q is the query at
    position r + q_offset (Python int or traced int32 scalar; ``cudnn`` takes only 0).
    """
    _check_geometry(l, d, lp)
    group, win = q_BxTxHxDk.shape[2] // kc_BxTcxKxDk.shape[2], (lp + l) // d - 1  # _ScoreGeometry's
    ssz = fit_select_sizes(select_sizes, pc.padded_dim(q_BxTxHxDk.shape[-1]), q_BxTxHxDk.dtype.itemsize, group, win)
    nb = _block_count(q_BxTxHxDk.shape[1], lp, num_blocks)
    o, lse, lay, scale = _attention_and_lse(
        q_BxTxHxDk, kc_BxTcxKxDk, vc_BxTcxKxDv, l, d, scale, interpret, block_sizes, attention, q_offset
    )
    sg = lax.stop_gradient
    off_1 = pc.offset_operand(q_offset)
    s = _block_scores(sg(q_BxTxHxDk), sg(kc_BxTcxKxDk), lse, off_1, lay, l, d, lp, nb, scale, bool(interpret), ssz)
    return o, jnp.moveaxis(s, 1, 2)


def compressed_attention_select_pallas(
    q_BxTxHxDk, kc_BxTcxKxDk, vc_BxTcxKxDv, *, l: int, d: int, lp: int, n: int, t_T=None,
    scale: float | None = None, interpret: bool = False, block_sizes: CompressedBlockSizes | None = None,
    select_sizes: BlockSelectSizes | None = None, attention: str = "flash", q_offset=0, num_blocks: int | None = None,
):  # fmt: skip
    """Compressed-branch attention and the selected blocks, with no score tensor.

    Args:
      q_BxTxHxDk, kc_BxTcxKxDk, vc_BxTcxKxDv, l, d, scale, interpret, block_sizes, q_offset:
        as compressed_attention_pallas (row r of q is the query at position r + q_offset).
      lp, n: selection block length and blocks per query (d must divide l and lp).
      t_T: positions the selection rules see per row (default q_offset + 0..T-1), as
        select_blocks' ``t_T``; the compressed tokens' visibility uses the row's
        position r + q_offset.
      num_blocks: selection blocks of the whole sequence (None: ceil(T / lp)).
      select_sizes: optional ``BlockSelectSizes``.
      attention: what computes o: ``flash``, the branch's Pallas flash kernels, whose
        forward gives the log-sum-exp the scores need; ``cudnn``, one fused causal
        attention over the regrouped branch (kernels/cudnn.py; XLA's attention when
        interpreted) and the log-sum-exp from a separate q k^T pass
        (compressed_lse_pallas); only with the query offset 0.

    Returns:
      o_BxTxHxDv and idx_BxTxKxN int32: for each row and KV group, the forced
      blocks (0, t//lp, t//lp - 1) and the best candidates j*lp <= t by group
      block score, ties to the lower index, -1 for unused slots, in
      select_blocks' order (see the module docstring on exactness).
    """
    _check_geometry(l, d, lp)
    if n < 1:
        raise ValueError(f"n={n} must be >= 1")
    group, win = q_BxTxHxDk.shape[2] // kc_BxTcxKxDk.shape[2], (lp + l) // d - 1  # _ScoreGeometry's
    ssz = fit_select_sizes(select_sizes, pc.padded_dim(q_BxTxHxDk.shape[-1]), q_BxTxHxDk.dtype.itemsize, group, win)
    t = q_BxTxHxDk.shape[1]
    nb = _block_count(t, lp, num_blocks)
    t_T = _selection_positions(t, t_T, q_offset)
    o, lse, lay, scale = _attention_and_lse(
        q_BxTxHxDk, kc_BxTcxKxDk, vc_BxTcxKxDv, l, d, scale, interpret, block_sizes, attention, q_offset
    )
    sg = lax.stop_gradient
    off_1 = pc.offset_operand(q_offset)
    q, kc = sg(q_BxTxHxDk), sg(kc_BxTcxKxDk)
    idx = _block_select(q, kc, lse, sg(t_T), off_1, lay, l, d, lp, nb, n, scale, bool(interpret), ssz)
    return o, jnp.moveaxis(idx, 1, 2)


def select_blocks_pallas(
    scores_BxTxKxNb,
    lp: int,
    n: int,
    t_T=None,
    *,
    interpret: bool = False,
    select_sizes: BlockSelectSizes | None = None,
    q_offset=0,
):
    """select_blocks (kernels.xla) as a kernel reading the scores tile by tile; same output, bitwise.

    The block count is the scores' last axis; ``t_T`` defaults to the rows' positions
    q_offset + 0..T-1 (Python int or traced int32 scalar ``q_offset``)."""
    if lp < 1 or n < 1:
        raise ValueError(f"lp={lp} and n={n} must be >= 1")
    bsz = BlockSelectSizes() if select_sizes is None else select_sizes
    pc.check_tile_size("block_pos", bsz.block_pos)  # no matmul here: only the tile rule
    pc.check_tile_size("block_blocks", bsz.block_blocks)
    b, t, kvh, nb = scores_BxTxKxNb.shape
    pc.check_query_offset(q_offset, t)
    t_T = _selection_positions(t, t_T, q_offset)
    tp = pl.cdiv(t, bsz.block_pos) * bsz.block_pos
    nbp = pl.cdiv(nb, bsz.block_blocks) * bsz.block_blocks
    n_slots = pc.next_pow2(n)
    s = jnp.moveaxis(lax.stop_gradient(scores_BxTxKxNb).astype(jnp.float32), 2, 1)
    s = pc.pad_axis(pc.pad_axis(s, 2, tp), 3, nbp)
    kernel = functools.partial(
        _select_from_scores_kernel,
        seq=t,
        lp=lp,
        num_blocks=nb,
        block_pos=bsz.block_pos,
        block_blocks=bsz.block_blocks,
        num_tiles=nbp // bsz.block_blocks,
        n_slots=n_slots,
    )
    idx = pl.pallas_call(
        kernel,
        grid=(tp // bsz.block_pos, b, kvh),
        in_specs=[
            pl.BlockSpec((None, None, bsz.block_pos, nbp), lambda i, bb, kv: (bb, kv, i, 0)),
            pl.BlockSpec((bsz.block_pos,), lambda i, bb, kv: (i,)),
        ],
        out_specs=pl.BlockSpec((None, None, bsz.block_pos, n_slots), lambda i, bb, kv: (bb, kv, i, 0)),
        out_shape=jax.ShapeDtypeStruct((b, kvh, tp, n_slots), jnp.int32),
        compiler_params=pc.compiler_params(bsz.num_warps, bsz.num_stages, 64),
        interpret=interpret,
        name="nsa_select_from_scores",
    )(s, pc.pad_axis(t_T.astype(jnp.int32), 0, tp))
    return jnp.moveaxis(idx[:, :, :t, :n], 1, 2)
