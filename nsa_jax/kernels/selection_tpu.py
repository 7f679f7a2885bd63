"""Pallas TPU (Mosaic) kernels for NSA selection attention: `selection_attention_tpu`.

The contract is the Triton kernels' (kernels/selection_pallas.py, docs/NSA.md "Selection branch"):
query t of head h attends to every position p <= t inside the blocks idx[b, t, h // G, :]; -1
marks an unused slot; softmax and accumulation in fp32; a row that sees no key returns 0; with
`q_offset` row r stands at position r + q_offset over the whole sequence's keys.

How a TPU gathers: the selected block ids are scalar-prefetched into SMEM and read by the key /
value BlockSpecs' index maps (the pattern of jax's TPU paged attention), so the pipeline DMAs
exactly the chosen blocks into VMEM while the previous step computes. Layout:
* forward and dQ: one program per (batch, KV head, tile of P query positions); the grid's last
  axis walks the n selection slots. Each program holds the tile's P x Gp query rows (the G heads
  that share a selection, padded to the 8-row sublane tile) and takes P key and P value blocks a
  step, one per position (P operands, each with its own index map), so one grid step moves P
  blocks and the per-step overhead is paid once for them;
* dK/dV: key-centric over the reverse index (kernels/reverse_index.py, its sorting form: a TPU
  sorts well and scatters badly): one program per work segment (entries of one block, ascending
  query), the segment's block loaded once and its queries' rows gathered P at a time through the
  index maps; partial tiles per segment, summed per block afterwards in XLA (sorted segment ids:
  deterministic, no atomics).
SMEM holds 1 MiB: the prefetched ids travel in chunks of at most `PREFETCH_WORDS` int32, one
`pallas_call` each. The log-sum-exp travels between the kernels as [B, K, T/P, Gp, P] (P in the
lanes); a kernel reads its position's column with a one-hot lane reduction, which needs no
dynamic lane slicing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from nsa_jax.kernels.pallas_common import MASK_VALUE, pad_axis, validate_selection
from nsa_jax.kernels.reverse_index import reverse_index_sorted

# f32 sublane tile: the query rows of a position are padded to a multiple of it.
SUBLANES = 8
LANES = 128
# int32 words one call scalar-prefetches (a quarter of the 1 MiB SMEM every TPU from v4 has).
PREFETCH_WORDS = 1 << 16
# Query positions per forward / dQ program, and queries gathered per dK/dV step.
POSITIONS = 8
# Reverse-index entries (query, slot) one dK/dV program handles.
SEGMENT = 256


def _mxu(a, b, dims):
    """A dot on the MXU, accumulated in fp32: 16-bit operands at their own precision (Mosaic refuses an fp32
    contract precision for them, which jax_default_matmul_precision=highest would ask), fp32 ones in full."""
    wide = a.dtype == jnp.float32 or b.dtype == jnp.float32
    precision = lax.Precision.HIGHEST if wide else lax.Precision.DEFAULT
    return lax.dot_general(a, b, (dims, ((), ())), precision=precision, preferred_element_type=jnp.float32)


def _dot_t(a_RxD, b_CxD):
    """a @ b^T."""
    return _mxu(a_RxD, b_CxD, ((1,), (1,)))


def _dot(a_RxC, b_CxD):
    return _mxu(a_RxC, b_CxD, ((1,), (0,)))


def _dot_tn(a_RxC, b_RxD):
    """a^T @ b."""
    return _mxu(a_RxC, b_RxD, ((0,), (0,)))


def _lane(x_GxP, lane):
    """Column `lane` of x as [G, 1], by a one-hot reduction (lane may be traced)."""
    hit = lax.broadcasted_iota(jnp.int32, x_GxP.shape, 1) == lane
    return jnp.sum(jnp.where(hit, x_GxP, 0.0), axis=1, keepdims=True)


def _visible(blk, t, rows: int, block_size: int):
    """[rows, bs] bool: key blk * bs + c is at or before position t."""
    pos = blk * block_size + lax.broadcasted_iota(jnp.int32, (rows, block_size), 1)
    return pos <= t


# ---------------------------------------------------------------------------
# forward and dQ: one program per (b, kv head, P positions), the grid's last axis over the n slots


def _slot_id(idx_ref, b, h, i, j, p, *, heads, rows, n, positions):
    """The block id of slot j of position i * P + p (chunk-local) of (b, h), from the prefetched ids."""
    return idx_ref[((b * heads + h) * rows + i * positions + p) * n + j]


def _each_live_slot(idx_ref, off_ref, body, *, heads, rows, n, positions, block_size):
    """body(p, blk, t) for each of the program's P positions whose slot at this grid step holds a block that
    begins at or before the position (a -1 slot or a block after t is skipped)."""
    b, h, i, j = (pl.program_id(a) for a in range(4))
    for p in range(positions):
        blk = _slot_id(idx_ref, b, h, i, j, p, heads=heads, rows=rows, n=n, positions=positions)
        t = off_ref[0] + i * positions + p
        pl.when((blk >= 0) & (blk * block_size <= t))(functools.partial(body, p, blk, t))


def _fwd_kernel(idx_ref, off_ref, q_ref, *refs, heads, rows, n, positions, block_size, scale):
    k_refs, v_refs = refs[:positions], refs[positions : 2 * positions]
    o_ref, lse_ref, m_ref, l_ref, acc_ref = refs[2 * positions :]
    j = pl.program_id(3)
    gp = q_ref.shape[1]

    @pl.when(j == 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def fold(p, blk, t):
        s = _dot_t(q_ref[p], k_refs[p][...]) * scale
        s = jnp.where(_visible(blk, t, gp, block_size), s, MASK_VALUE)
        m_prev = m_ref[p]  # [Gp, 128], every lane equal
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_new)
        pr = jnp.exp(s - m_new[:, :1])
        l_ref[p] = alpha * l_ref[p] + jnp.sum(pr, axis=1, keepdims=True)
        acc_ref[p] = acc_ref[p] * alpha[:, :1] + _dot(pr.astype(v_refs[p].dtype), v_refs[p][...])
        m_ref[p] = m_new

    _each_live_slot(idx_ref, off_ref, fold, heads=heads, rows=rows, n=n, positions=positions, block_size=block_size)

    @pl.when(j == n - 1)
    def _():
        lanes = lax.broadcasted_iota(jnp.int32, (gp, positions), 1)
        lse = jnp.zeros((gp, positions), jnp.float32)
        for p in range(positions):
            l = l_ref[p][:, :1]
            seen = l > 0
            o_ref[p] = jnp.where(seen, acc_ref[p] / jnp.where(seen, l, 1.0), 0.0).astype(o_ref.dtype)
            row = jnp.where(seen, m_ref[p][:, :1] + jnp.log(jnp.where(seen, l, 1.0)), 0.0)
            lse = jnp.where(lanes == p, row, lse)
        lse_ref[...] = lse


def _dq_kernel(
    idx_ref, off_ref, q_ref, do_ref, lse_ref, delta_ref, *refs, heads, rows, n, positions, block_size, scale
):
    k_refs, v_refs = refs[:positions], refs[positions : 2 * positions]
    dq_ref, acc_ref = refs[2 * positions :]
    j = pl.program_id(3)
    gp = q_ref.shape[1]

    @pl.when(j == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def grad(p, blk, t):
        k, v = k_refs[p][...], v_refs[p][...]
        s = _dot_t(q_ref[p], k) * scale
        pr = jnp.where(_visible(blk, t, gp, block_size), jnp.exp(s - _lane(lse_ref[...], p)), 0.0)
        ds = pr * (_dot_t(do_ref[p], v) - _lane(delta_ref[...], p))
        acc_ref[p] = acc_ref[p] + _dot(ds.astype(k.dtype), k) * scale

    _each_live_slot(idx_ref, off_ref, grad, heads=heads, rows=rows, n=n, positions=positions, block_size=block_size)

    @pl.when(j == n - 1)
    def _():
        dq_ref[...] = acc_ref[...].astype(dq_ref.dtype)


# ---------------------------------------------------------------------------
# dK/dV: one program per reverse-index segment (entries of one block), P queries gathered a step


def _dkv_kernel(
    qwin_ref, blk_ref, lo_ref, hi_ref, off_ref, *refs, heads, segs, window, positions, block_size, scale, num_blocks
):
    q_refs, do_refs = refs[:positions], refs[positions : 2 * positions]
    lse_refs, delta_refs = refs[2 * positions : 3 * positions], refs[3 * positions : 4 * positions]
    k_ref, v_ref, dk_ref, dv_ref, dk_acc, dv_acc = refs[4 * positions :]
    b, h, s, r = (pl.program_id(a) for a in range(4))
    seg = (b * heads + h) * segs + s
    blk = blk_ref[seg]
    gp = q_refs[0].shape[0]

    @pl.when(r == 0)
    def _():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

    for p in range(positions):
        e = lo_ref[seg] + r * positions + p
        row = qwin_ref[(b * heads + h) * window + jnp.clip(e, 0, window - 1)]
        t = off_ref[0] + row

        @pl.when((e < hi_ref[seg]) & (blk < num_blocks) & (blk * block_size <= t))
        def _(p=p, row=row, t=t):
            k, v = k_ref[...], v_ref[...]
            q, do = q_refs[p][...], do_refs[p][...]
            lane = row & (positions - 1)  # positions is a power of two (no sign op)
            s_ = _dot_t(q, k) * scale
            pr = jnp.where(_visible(blk, t, gp, block_size), jnp.exp(s_ - _lane(lse_refs[p][...], lane)), 0.0)
            dv_acc[...] += _dot_tn(pr.astype(do.dtype), do)
            ds = pr * (_dot_t(do, v) - _lane(delta_refs[p][...], lane))
            dk_acc[...] += _dot_tn(ds.astype(q.dtype), q) * scale

    @pl.when(r == pl.num_programs(3) - 1)
    def _():
        dk_ref[...] = dk_acc[...]
        dv_ref[...] = dv_acc[...]


# ---------------------------------------------------------------------------
# sizes, layouts and the calls


class _Dims:
    """Sizes of one selection call: Gp query rows a position (G padded to the sublane tile), Tq' query
    rows (a multiple of the chunk), Tk' keys (whole blocks), and the query positions one call's
    prefetched ids cover (`chunk`)."""

    def __init__(self, q, k, v, idx, block_size: int, positions: int):
        self.b, self.tq, self.h, self.dk = q.shape
        self.tk, self.heads = k.shape[1], k.shape[2]
        self.dv = v.shape[-1]
        self.n = idx.shape[-1]
        self.g = self.h // self.heads
        self.gp = -(-self.g // SUBLANES) * SUBLANES
        self.nb = -(-self.tk // block_size)
        per_position = self.b * self.heads * self.n
        if per_position * positions > PREFETCH_WORDS:
            raise ValueError(
                f"the TPU selection kernel prefetches batch x KV heads x n x positions = {per_position * positions} "
                f"block ids a call, over SMEM's {PREFETCH_WORDS}: split the batch (fewer rows per device)"
            )
        chunk = PREFETCH_WORDS // per_position // positions * positions
        self.chunk = min(chunk, -(-self.tq // positions) * positions)
        self.tq_pad = -(-self.tq // self.chunk) * self.chunk


def _heads_major(x_BxTxHxD, d: _Dims):
    """[B, T, K*G, D] -> [B, K, Tq', Gp, D] (zero rows for the padding)."""
    b, t, _, dd = x_BxTxHxD.shape
    x = x_BxTxHxD.reshape(b, t, d.heads, d.g, dd).transpose(0, 2, 1, 3, 4)
    return pad_axis(pad_axis(x, 3, d.gp), 2, d.tq_pad)


def _heads_minor(x_BxKxTxGpxD, d: _Dims):
    """The inverse of `_heads_major`."""
    b, k, _, _, dd = x_BxKxTxGpxD.shape
    return x_BxKxTxGpxD[:, :, : d.tq, : d.g].transpose(0, 2, 1, 3, 4).reshape(b, d.tq, k * d.g, dd)


def _keys_major(x_BxTxKxD, d: _Dims, block_size: int):
    """[B, Tk, K, D] -> [B, K, Tk', D]."""
    return pad_axis(x_BxTxKxD.transpose(0, 2, 1, 3), 2, d.nb * block_size)


def _stat_layout(x_BxTxH, d: _Dims, positions: int):
    """[B, Tq, K*G] fp32 -> [B, K, Tq'/P, Gp, P]: a position's rows in a lane of its tile's block."""
    b = x_BxTxH.shape[0]
    x = pad_axis(pad_axis(x_BxTxH.reshape(b, d.tq, d.heads, d.g), 3, d.gp), 1, d.tq_pad)
    return x.reshape(b, d.tq_pad // positions, positions, d.heads, d.gp).transpose(0, 3, 1, 4, 2)


def _params(*semantics):
    return pltpu.CompilerParams(dimension_semantics=semantics)


# What each call moves and computes, for XLA's cost analysis: the blocks its DMAs fetch (a custom call's
# default counts every operand whole, and the key / value arrays are P operands each).
def _row_cost(d: _Dims, rows, stats, outs, k4, block_size: int, positions: int, dq: bool) -> pl.CostEstimate:
    pairs = d.b * d.heads * d.chunk * d.n  # (position, slot) pairs of one call
    per_row = sum(x.dtype.itemsize * d.gp * x.shape[-1] for x in rows) + 4 * d.gp * len(stats)  # a position's
    out_row = sum(jnp.dtype(dt).itemsize * d.gp * (1 if w is None else w) for w, dt in outs)
    kv = pairs * block_size * (d.dk + d.dv) * k4.dtype.itemsize
    dots = (2 * d.dk + d.dv) if dq else (d.dk + d.dv)
    return pl.CostEstimate(
        flops=2 * pairs * d.gp * block_size * dots,
        transcendentals=pairs * d.gp * block_size,
        bytes_accessed=kv + d.b * d.heads * d.chunk * (per_row + out_row),
    )


def _dkv_cost(d: _Dims, q5, do5, k4, block_size: int, segs: int, segment: int, positions: int) -> pl.CostEstimate:
    entries = d.b * d.heads * segs * segment  # gathered query slots of one call (padding included)
    rows = d.gp * (q5.shape[-1] * q5.dtype.itemsize + do5.shape[-1] * do5.dtype.itemsize + 2 * 4 * positions)
    tiles = d.b * d.heads * segs * block_size * (d.dk + d.dv)
    return pl.CostEstimate(
        flops=2 * entries * d.gp * block_size * 2 * (d.dk + d.dv),
        transcendentals=entries * d.gp * block_size,
        bytes_accessed=entries * rows + tiles * (k4.dtype.itemsize + 4),
    )


def _row_pass(
    kernel, d: _Dims, ids_BxKxTxN, off_1, k4, v4, rows, stats, outs, scratch, *, positions, block_size, scale, interpret
):
    """The forward / dQ kind of call, once per chunk of query positions: `rows` ([B, K, Tq', Gp, D] operands)
    and `stats` ([B, K, Tq'/P, Gp, P]) tiled by the program's P positions, then P key and P value blocks at the
    slots' ids; `outs` (width or None for a stat, dtype) concatenated along the positions."""
    c, npos = d.chunk, d.chunk // positions
    row_spec = lambda w: pl.BlockSpec((None, None, positions, d.gp, w), lambda b, h, i, j, *_: (b, h, i, 0, 0))
    stat_spec = pl.BlockSpec((None, None, None, d.gp, positions), lambda b, h, i, j, *_: (b, h, i, 0, 0))

    def kv_spec(width, p):
        def index(b, h, i, j, idx_ref, off_ref):
            blk = _slot_id(idx_ref, b, h, i, j, p, heads=d.heads, rows=c, n=d.n, positions=positions)
            return b, h, jnp.maximum(blk, 0), 0

        return pl.BlockSpec((None, None, block_size, width), index)

    in_specs = [row_spec(x.shape[-1]) for x in rows] + [stat_spec] * len(stats)
    in_specs += [kv_spec(d.dk, p) for p in range(positions)] + [kv_spec(d.dv, p) for p in range(positions)]
    out_specs = [stat_spec if w is None else row_spec(w) for w, _ in outs]
    out_shape = [
        jax.ShapeDtypeStruct((d.b, d.heads, npos, d.gp, positions) if w is None else (d.b, d.heads, c, d.gp, w), dt)
        for w, dt in outs
    ]
    call = pl.pallas_call(
        functools.partial(
            kernel, heads=d.heads, rows=c, n=d.n, positions=positions, block_size=block_size, scale=scale
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(d.b, d.heads, npos, d.n),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=scratch,
        ),
        out_shape=out_shape,
        compiler_params=_params("parallel", "parallel", "parallel", "arbitrary"),
        interpret=interpret,
        name=kernel.__name__.strip("_"),
        cost_estimate=_row_cost(d, rows, stats, outs, k4, block_size, positions, dq=kernel is _dq_kernel),
    )
    parts = []
    for c0 in range(0, d.tq_pad, c):
        ids = lax.slice_in_dim(ids_BxKxTxN, c0, c0 + c, axis=2).reshape(-1)
        rows_c = [lax.slice_in_dim(x, c0, c0 + c, axis=2) for x in rows]
        stats_c = [lax.slice_in_dim(x, c0 // positions, (c0 + c) // positions, axis=2) for x in stats]
        parts.append(call(ids, off_1 + c0, *rows_c, *stats_c, *([k4] * positions), *([v4] * positions)))
    return [jnp.concatenate(p, axis=2) if len(p) > 1 else p[0] for p in zip(*parts)]


def _ids(idx_BxTxKxN, d: _Dims):
    return pad_axis(idx_BxTxKxN.astype(jnp.int32).transpose(0, 2, 1, 3), 2, d.tq_pad, value=-1)


def _forward(q, k, v, off_1, idx, block_size, scale, interpret, positions):
    d = _Dims(q, k, v, idx, block_size, positions)
    scratch = [pltpu.VMEM((positions, d.gp, LANES), jnp.float32)] * 2 + [
        pltpu.VMEM((positions, d.gp, d.dv), jnp.float32)
    ]
    o5, lse = _row_pass(
        _fwd_kernel, d, _ids(idx, d), off_1, _keys_major(k, d, block_size), _keys_major(v, d, block_size),
        [_heads_major(q, d)], [], [(d.dv, q.dtype), (None, jnp.float32)], scratch,
        positions=positions, block_size=block_size, scale=scale, interpret=interpret,
    )  # fmt: skip
    return _heads_minor(o5, d), lse


def _dkv_pass(d: _Dims, idx, off_1, q5, do5, lse, delta, k4, v4, *, positions, block_size, scale, interpret, segment):
    """dK, dV [B, K, Tk', D] (fp32) over the reverse index, in chunks of segments whose prefetched ids fit."""
    ri = reverse_index_sorted(idx, d.nb, segment)
    num_segs = ri.seg_blk.shape[-1]
    segs = max(1, min(num_segs, PREFETCH_WORDS // (d.b * d.heads * (segment + 3))))
    window = segs * segment
    entries = ri.qlist.shape[-1]
    qlist = pad_axis(ri.qlist, 2, entries + window)
    steps = segment // positions
    shift = positions.bit_length() - 1  # row // positions

    def gather_spec(width, p, major):
        def index(b, h, s, r, qwin_ref, blk_ref, lo_ref, hi_ref, off_ref):
            seg = (b * d.heads + h) * segs + s
            e = jnp.clip(lo_ref[seg] + r * positions + p, 0, window - 1)
            row = qwin_ref[(b * d.heads + h) * window + e]
            return b, h, row if major else lax.shift_right_logical(row, shift), 0, 0

        block = (None, None, None, d.gp, width)
        return pl.BlockSpec(block, index)

    def block_index(b, h, s, r, qwin_ref, blk_ref, lo_ref, hi_ref, off_ref):
        return b, h, jnp.minimum(blk_ref[(b * d.heads + h) * segs + s], d.nb - 1), 0

    part_spec = lambda w: pl.BlockSpec((None, None, None, block_size, w), lambda b, h, s, r, *_: (b, h, s, 0, 0))
    in_specs = [gather_spec(d.dk, p, True) for p in range(positions)]
    in_specs += [gather_spec(d.dv, p, True) for p in range(positions)]
    in_specs += [gather_spec(positions, p, False) for p in range(positions)] * 2
    in_specs += [pl.BlockSpec((None, None, block_size, d.dk), block_index)]
    in_specs += [pl.BlockSpec((None, None, block_size, d.dv), block_index)]
    call = pl.pallas_call(
        functools.partial(
            _dkv_kernel,
            heads=d.heads,
            segs=segs,
            window=window,
            positions=positions,
            block_size=block_size,
            scale=scale,
            num_blocks=d.nb,
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(d.b, d.heads, segs, steps),
            in_specs=in_specs,
            out_specs=[part_spec(d.dk), part_spec(d.dv)],
            scratch_shapes=[pltpu.VMEM((block_size, d.dk), jnp.float32), pltpu.VMEM((block_size, d.dv), jnp.float32)],
        ),
        out_shape=[jax.ShapeDtypeStruct((d.b, d.heads, segs, block_size, w), jnp.float32) for w in (d.dk, d.dv)],
        compiler_params=_params("parallel", "parallel", "parallel", "arbitrary"),
        interpret=interpret,
        name="dkv_kernel",
        cost_estimate=_dkv_cost(d, q5, do5, k4, block_size, segs, segment, positions),
    )
    chunks = -(-num_segs // segs)
    padded = chunks * segs  # unused segments: block nb, an empty range
    seg_blk, seg_lo, seg_hi = (
        pad_axis(x, 2, padded, value=v) for x, v in ((ri.seg_blk, d.nb), (ri.seg_lo, 0), (ri.seg_hi, 0))
    )
    dk_parts, dv_parts = [], []
    for s0 in range(0, padded, segs):
        blk, lo, hi = (lax.slice_in_dim(x, s0, s0 + segs, axis=2) for x in (seg_blk, seg_lo, seg_hi))
        base = lo[:, :, :1]  # segments are contiguous in qlist: the chunk's entries start at its first one
        qwin = jax.vmap(jax.vmap(lambda ql, b0: lax.dynamic_slice_in_dim(ql, b0, window)))(qlist, base[..., 0])
        dk_c, dv_c = call(qwin.reshape(-1), blk.reshape(-1), (lo - base).reshape(-1), (hi - base).reshape(-1), off_1,
                          *([q5] * positions), *([do5] * positions), *([lse] * positions), *([delta] * positions),
                          k4, v4)  # fmt: skip
        dk_parts.append(dk_c)
        dv_parts.append(dv_c)

    def per_block(parts):
        x = jnp.concatenate(parts, axis=2)
        summed = jax.vmap(jax.vmap(lambda xs, ids: jax.ops.segment_sum(xs, ids, d.nb + 1, indices_are_sorted=True)))(
            x, seg_blk
        )
        return summed[:, :, : d.nb].reshape(d.b, d.heads, d.nb * block_size, x.shape[-1])

    return per_block(dk_parts), per_block(dv_parts)


def _backward(q, k, v, off_1, idx, o, lse, do, block_size, scale, interpret, positions, segment):
    d = _Dims(q, k, v, idx, block_size, positions)
    k4, v4 = _keys_major(k, d, block_size), _keys_major(v, d, block_size)
    q5, do5 = _heads_major(q, d), _heads_major(do, d)
    delta = _stat_layout(jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1), d, positions)
    (dq5,) = _row_pass(
        _dq_kernel, d, _ids(idx, d), off_1, k4, v4, [q5, do5], [lse, delta], [(d.dk, q.dtype)],
        [pltpu.VMEM((positions, d.gp, d.dk), jnp.float32)],
        positions=positions, block_size=block_size, scale=scale, interpret=interpret,
    )  # fmt: skip
    dk4, dv4 = _dkv_pass(
        d, idx, off_1, q5, do5, lse, delta, k4, v4,
        positions=positions, block_size=block_size, scale=scale, interpret=interpret, segment=segment,
    )  # fmt: skip
    back = lambda x, like: x[:, :, : like.shape[1]].transpose(0, 2, 1, 3).astype(like.dtype)
    return _heads_minor(dq5, d), back(dk4, k), back(dv4, v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _selection(q, k, v, off_1, idx, block_size, scale, interpret, positions, segment):
    return _forward(q, k, v, off_1, idx, block_size, scale, interpret, positions)[0]


def _selection_fwd(q, k, v, off_1, idx, block_size, scale, interpret, positions, segment):
    o, lse = _forward(q, k, v, off_1, idx, block_size, scale, interpret, positions)
    return o, (q, k, v, off_1, idx, o, lse)


def _selection_bwd(block_size, scale, interpret, positions, segment, res, do):
    q, k, v, off_1, idx, o, lse = res
    dq, dk, dv = _backward(q, k, v, off_1, idx, o, lse, do, block_size, scale, interpret, positions, segment)
    return dq, dk, dv, None, None


_selection.defvjp(_selection_fwd, _selection_bwd)


def selection_attention_tpu(
    q_BxTxHxDk, k_BxTxKxDk, v_BxTxKxDv, idx_BxTxKxN, block_size: int, scale: float | None = None, *,
    interpret: bool = False, positions: int = POSITIONS, segment: int = SEGMENT, q_offset=0,
):  # fmt: skip
    """NSA selection attention on a TPU: Pallas (Mosaic) forward and backward.

    Args and result as `selection_attention_pallas` (kernels/selection_pallas.py): q [B, Tq, K*G, Dk],
    k [B, Tk, K, Dk], v [B, Tk, K, Dv], idx int32 [B, Tq, K, n] (-1 unused), block_size a power of two
    >= 16, `q_offset` a Python int or a traced int32 scalar. `positions`: query positions per forward /
    dQ program and queries gathered per dK/dV step (a power of two); `segment`: reverse-index entries per
    dK/dV program (a multiple of `positions`). `interpret`: the Pallas interpreter (CPU tests).
    """
    validate_selection(q_BxTxHxDk, k_BxTxKxDk, v_BxTxKxDv, idx_BxTxKxN, q_offset)
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size={block_size}: the TPU selection kernel takes a power of two >= 16")
    if positions < 1 or positions & (positions - 1) or segment % positions:
        raise ValueError(f"positions={positions} must be a power of two dividing segment={segment}")
    scale = q_BxTxHxDk.shape[-1] ** -0.5 if scale is None else float(scale)
    off_1 = jnp.asarray(q_offset, jnp.int32).reshape(1)
    return _selection(q_BxTxHxDk, k_BxTxKxDk, v_BxTxKxDv, off_1, idx_BxTxKxN, block_size, scale, interpret, positions,
                      segment)  # fmt: skip
