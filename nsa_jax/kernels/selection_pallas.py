"""Pallas (Triton backend) kernels for NSA selection attention: `selection_attention_pallas`.

Contract (docs/NSA.md "Selection branch"): query t of head h attends to every position
p <= t inside the blocks idx[b, t, h // G, :] (block j covers [j*bs, (j+1)*bs)); -1 marks
an unused slot. Softmax and accumulation in fp32; the output has q's dtype; a row that sees
no key returns 0. With `q_offset` row r stands at position r + q_offset over the whole
sequence's keys (context parallelism).

Layout: the forward and dQ are group-centric, one program per (query position, batch, KV
head) holding the G heads that share a selection (padded to 16 rows), or P consecutive
positions walking the union of their blocks (`SelectionBlockSizes.positions`); grid axis 0
is the position, so neighbours that select the same blocks share them through L2. dK/dV is
key-centric over a reverse index (kernels/reverse_index.py: the queries that chose each
block, in segments), with a deterministic per-block reduction of the segments' partial
tiles: no atomics. Every tiling is sized to an A100's 163 KiB of shared memory
(`smem_estimates`, `fit_block_sizes`). Explicit Triton CompilerParams; interpret=True runs
the same kernels on a CPU. The design, its alternatives and the measurements behind them:
docs/lab/2026-11-28-selection-kernel-design.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

from nsa_jax.kernels import pallas_common as pc
from nsa_jax.kernels.reverse_index import reverse_index


@dataclasses.dataclass(frozen=True)
class SelectionBlockSizes:
    """Tiling knobs of the selection kernels (static, hashable).

    Attributes:
      rows_dkv: flattened (query, head) rows gathered per step of the dK/dV
        kernel; a power of two >= 16. None: 64, halved while the dK/dV
        kernel's tiles exceed the shared-memory budget (``smem_estimates``).
      dkv_segment: most reverse-index entries (query, slot pairs) one dK/dV
        program handles; bounds the longest program (block 0).
      num_warps: Triton warps per forward / dQ program (None: pick from the head dim;
        the dK/dV programs always do).
      num_stages: Triton software-pipelining depth.
      positions: query positions per forward / dQ program (a power of two).
        1: one position's G heads per program, padded to 16 rows. P > 1:
        P consecutive positions x G heads share a program and walk the union
        of their selections once (``_sel_multi_kernel``), so G = 6 with
        P = 2 fills 12 of 16 rows instead of 6. Either way each program
        stores its real rows straight into o and dQ ``[B, T*H, D]``.
    """

    rows_dkv: int | None = None
    dkv_segment: int = 512
    num_warps: int | None = None
    num_stages: int = 2
    positions: int = 2


# ---------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------


def _group_rows(t, kv, num_heads: int, group: int, group_padded: int):
    """(rows of ``q[T*H, D]`` holding query ``t``'s heads of KV head ``kv``, head of each row) [Gp].

    Padded rows (g >= G) repeat head G-1: they compute its values and store them again.
    """
    g_Gp = jnp.minimum(lax.iota(jnp.int32, group_padded), group - 1)
    return t * num_heads + kv * group + g_Gp, g_Gp


def _slot_tile(s, t, idx_ref, k_ref, v_ref, *, block_size, num_blocks, q_offset):
    """Slot ``s`` of query row ``t``'s selection: K [bs, Dk], V [bs, Dv] and the mask of the keys the row
    (at position t + q_offset) sees [1, bs].

    An unused slot (-1) or an out-of-range id loads an in-bounds block and sees
    none of it, so the kernels need no branch.
    """
    blk = idx_ref[s]
    live = (blk >= 0) & (blk < num_blocks)
    start = jnp.clip(blk, 0, num_blocks - 1) * block_size
    k_SxDk = k_ref[pl.ds(start, block_size), :]
    v_SxDv = v_ref[pl.ds(start, block_size), :]
    pos_S = pc.shift(start, -q_offset) + lax.iota(jnp.int32, block_size)  # less the offset: compared with the row
    vis_1xS = ((pos_S <= t) & live)[None, :]
    return k_SxDk, v_SxDv, vis_1xS


def _sel_kernel(
    *refs,
    has_offset,
    backward,
    block_size,
    num_slots,
    num_blocks,
    num_heads,
    group,
    group_padded,
    scale,
    scale_log2,
):
    # Refs (leading batch / KV-head dims squeezed by the BlockSpecs):
    #   [q_offset [1],] idx_ref [n], q_ref [T*H, Dk], k_ref [Tp, Dk], v_ref [Tp, Dv], then
    #   forward: o [T*H, Dv], lse [Gp]; dQ: do [T*H, Dv], lse / delta [Gp], dq [T*H, Dk].
    q_offset, (idx_ref, q_ref, k_ref, v_ref, *refs) = pc.split_offset(refs, has_offset)
    t = pl.program_id(0)
    kv = pl.program_id(2)
    row_Gp, g_Gp = _group_rows(t, kv, num_heads, group, group_padded)
    rows = pc.RowPass(backward, q_ref, refs, row_Gp, scale=scale, scale_log2=scale_log2, scatter=True, stat_row=g_Gp)

    def body(s, carry):
        k_SxDk, v_SxDv, vis_1xS = _slot_tile(
            s, t, idx_ref, k_ref, v_ref, block_size=block_size, num_blocks=num_blocks, q_offset=q_offset
        )
        return rows.step(carry, k_SxDk, v_SxDv, vis_1xS)

    rows.finish(lax.fori_loop(0, num_slots, body, rows.init(group_padded)))


def _multi_rows(i, kv, *, positions, group, rows, seq, num_heads):
    """Rows of a P-position program: row r is head r % G of position i*P + r // G.

    Returns the position t [R], the ``q[T*H]`` row [R], the program-local
    position p [R] and the row's entry in the program's statistics (p*G + g) [R].
    Rows past P*G, and positions past T (the last program when P does not
    divide T), repeat a real row of the program exactly (same query, head,
    selection and statistics), so they compute its values and may store them
    again: no row needs a mask and every store lands on a real row.
    """
    r_R = jnp.minimum(lax.iota(jnp.int32, rows), positions * group - 1)
    g_R = lax.rem(r_R, group)
    t_R = jnp.minimum(i * positions + lax.div(r_R, group), seq - 1)
    p_R = t_R - i * positions
    return t_R, t_R * num_heads + kv * group + g_R, p_R, p_R * group + g_R


def _union_entry(e, p_R, idx_ref, *, slots, num_blocks):
    """Entry e of the program's P x n selection entries: (block, whether it is processed, row mask [R]).

    An entry is processed iff its block id is valid and no earlier entry holds
    the same block (the union walks every block once); row r takes part iff
    its own position selected the block.
    """
    blk = idx_ref[lax.div(e, slots), lax.rem(e, slots)]
    idx_PxN = idx_ref[...]
    shape = idx_PxN.shape
    e_PxN = lax.broadcasted_iota(jnp.int32, shape, 0) * slots + lax.broadcasted_iota(jnp.int32, shape, 1)
    seen_P = jnp.sum(jnp.where((e_PxN < e) & (idx_PxN == blk), 1, 0), axis=1)
    first = jnp.sum(seen_P, axis=0) == 0
    live = (blk >= 0) & (blk < num_blocks) & first
    idx_RxN = idx_ref[p_R, :]
    member_R = jnp.sum(jnp.where(idx_RxN == blk, 1, 0), axis=1) > 0
    return blk, live, member_R


def _union_tile(blk, t_R, member_R, k_ref, v_ref, *, block_size, num_blocks, q_offset):
    """K [bs, Dk], V [bs, Dv] of block ``blk`` and the mask [R, bs] of the keys each row sees: its own query
    (row ``t_R``, at position t_R + q_offset) selected the block (``member_R``) and the key is not after it."""
    start = jnp.clip(blk, 0, num_blocks - 1) * block_size
    k_SxDk = k_ref[pl.ds(start, block_size), :]
    v_SxDv = v_ref[pl.ds(start, block_size), :]
    pos_1xS = (pc.shift(start, -q_offset) + lax.iota(jnp.int32, block_size))[None, :]  # compared with rows
    return k_SxDk, v_SxDv, member_R[:, None] & (pos_1xS <= t_R[:, None])


def _sel_multi_kernel(
    *refs,
    has_offset,
    backward,
    block_size,
    slots,
    num_blocks,
    num_heads,
    group,
    positions,
    rows,
    seq,
    scale,
    scale_log2,
):
    # Refs: [q_offset [1],] idx [P, n], q [T*H, Dk], k [Tp, Dk], v [Tp, Dv], then
    #   forward: o [T*H, Dv], lse [R]; dQ: do [T*H, Dv], lse / delta [R], dq [T*H, Dk].
    q_offset, (idx_ref, q_ref, k_ref, v_ref, *refs) = pc.split_offset(refs, has_offset)
    kv = pl.program_id(2)
    t_R, row_R, p_R, stat_R = _multi_rows(
        pl.program_id(0), kv, positions=positions, group=group, rows=rows, seq=seq, num_heads=num_heads
    )
    pass_ = pc.RowPass(backward, q_ref, refs, row_R, scale=scale, scale_log2=scale_log2, scatter=True, stat_row=stat_R)

    def body(e, carry):
        blk, live, member_R = _union_entry(e, p_R, idx_ref, slots=slots, num_blocks=num_blocks)

        def step(carry):
            k_SxDk, v_SxDv, vis_RxS = _union_tile(
                blk, t_R, member_R, k_ref, v_ref, block_size=block_size, num_blocks=num_blocks, q_offset=q_offset
            )
            return pass_.step(carry, k_SxDk, v_SxDv, vis_RxS)

        # Entries repeating an earlier block (neighbours share most blocks) cost no tile.
        return lax.cond(live, step, lambda c: c, carry)

    pass_.finish(lax.fori_loop(0, positions * slots, body, pass_.init(rows)))


class _Segment:
    """One program's segment of a block's reverse-index list (the dK/dV kernel).

    Holds the block's first key position and its keys' positions [1, S]; ``rows``
    gives the flattened (query, head) rows of one step: the entries [lo, hi) expand
    to rows [lo*G, hi*G), row f being head f % G of query qlist[f // G]. Gathering
    whole row tiles (not one query at a time) keeps the matmuls ``rows`` tall, with
    no padding for any G.
    """

    def __init__(self, seg_blk_ref, seg_lo_ref, seg_hi_ref, *, block_size, num_blocks, group):
        p = pl.program_id(0)
        self.group = group
        self.start = jnp.clip(seg_blk_ref[p], 0, num_blocks - 1) * block_size
        self.pos_1xS = (self.start + lax.iota(jnp.int32, block_size))[None, :]
        self.f_lo = seg_lo_ref[p] * group
        self.f_hi = seg_hi_ref[p] * group

    def steps(self, rows: int):
        return lax.div(self.f_hi - self.f_lo + rows - 1, rows)

    def rows(self, it, rows: int, qlist_ref, kv, num_heads: int):
        """(flat index f [R], valid [R], query t [R], head g [R], ``q[T*H]`` row [R]) of step ``it``.

        Rows past the segment's end (valid False) repeat its first row.
        """
        f_R = self.f_lo + it * rows + lax.iota(jnp.int32, rows)
        valid_R = f_R < self.f_hi
        f_R = jnp.where(valid_R, f_R, self.f_lo)
        g_R = lax.rem(f_R, self.group)
        t_R = qlist_ref[lax.div(f_R, self.group)]
        return f_R, valid_R, t_R, g_R, t_R * num_heads + kv * self.group + g_R


def _sel_dkv_kernel(
    *refs,
    has_offset,
    block_size,
    num_blocks,
    num_heads,
    group,
    positions,
    rows_padded,
    rows,
    scale,
    scale_log2,
):
    # One program = one segment of one block's reverse-index list.
    # Refs: [q_offset [1],] seg_* [P], qlist [T*n] (query rows), q [T*H, Dk], k [Tp, Dk], v [Tp, Dv],
    #   do [T*H, Dv], lse / delta [T/P * Rp], dk [bs, Dk], dv [bs, Dv] (partials).
    q_offset, (seg_blk_ref, seg_lo_ref, seg_hi_ref, qlist_ref, *refs) = pc.split_offset(refs, has_offset)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref = refs
    kv = pl.program_id(2)
    seg = _Segment(seg_blk_ref, seg_lo_ref, seg_hi_ref, block_size=block_size, num_blocks=num_blocks, group=group)
    k_SxDk = k_ref[pl.ds(seg.start, block_size), :]
    v_SxDv = v_ref[pl.ds(seg.start, block_size), :]
    # The keys' positions less the offset, once: the causal test below then compares them with rows.
    pos_1xS = pc.shift(seg.pos_1xS, -q_offset)

    def body(it, carry):
        dk_SxDk, dv_SxDv = carry
        _, valid_R, t_R, g_R, row_R = seg.rows(it, rows, qlist_ref, kv, num_heads)
        q_RxDk = q_ref[row_R, :]
        do_RxDv = do_ref[row_R, :]
        # Statistics are stored per forward program: Rp rows for P positions x G heads.
        stat_R = lax.div(t_R, positions) * rows_padded + lax.rem(t_R, positions) * group + g_R
        lse_R = lse_ref[stat_R]
        delta_R = delta_ref[stat_R]
        vis_RxS = valid_R[:, None] & (pos_1xS <= t_R[:, None])
        p_RxS, ds_RxS = pc.softmax_grad_tile(q_RxDk, k_SxDk, v_SxDv, do_RxDv, lse_R, delta_R, vis_RxS, scale_log2)
        dv_SxDv = dv_SxDv + plgpu_triton.dot(p_RxS.astype(do_RxDv.dtype), do_RxDv, trans_a=True)
        dk_SxDk = dk_SxDk + plgpu_triton.dot(ds_RxS.astype(q_RxDk.dtype), q_RxDk, trans_a=True)
        return dk_SxDk, dv_SxDv

    init = (
        jnp.zeros((block_size, k_ref.shape[-1]), jnp.float32),
        jnp.zeros((block_size, v_ref.shape[-1]), jnp.float32),
    )
    dk_SxDk, dv_SxDv = lax.fori_loop(0, seg.steps(rows), body, init)
    dk_ref[...] = dk_SxDk * scale
    dv_ref[...] = dv_SxDv


def _segment_reduce_kernel(first_ref, count_ref, dk_part_ref, dv_part_ref, dk_ref, dv_ref):
    # Sums the partial tiles of one block in a fixed order (deterministic).
    # Refs: first / count [NB], *_part [P, bs, D], dk [bs, Dk], dv [bs, Dv].
    blk = pl.program_id(0)
    first = first_ref[blk]

    def body(c, carry):
        dk_SxDk, dv_SxDv = carry
        return dk_SxDk + dk_part_ref[first + c], dv_SxDv + dv_part_ref[first + c]

    init = (jnp.zeros(dk_ref.shape, jnp.float32), jnp.zeros(dv_ref.shape, jnp.float32))
    dk_SxDk, dv_SxDv = lax.fori_loop(0, count_ref[blk], body, init)
    dk_ref[...] = dk_SxDk.astype(dk_ref.dtype)
    dv_ref[...] = dv_SxDv.astype(dv_ref.dtype)


# ---------------------------------------------------------------------------
# pallas_call wrappers
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Dims:
    """Static sizes shared by the selection kernels."""

    batch: int
    seq: int
    heads: int
    kv_heads: int
    group: int
    group_padded: int
    dk: int  # padded head dims (what the kernels see)
    dv: int
    slots: int
    block_size: int
    num_blocks: int  # blocks of k's Tk keys (the whole sequence under a query offset)
    positions: int  # P query positions per forward / dQ program
    rows_padded: int  # Rp rows per forward / dQ program (Gp when P = 1)
    programs: int  # forward / dQ programs along T: ceil(T / P)


def _dims(q, k, v, idx, block_size, positions: int = 1) -> _Dims:
    b, t, h, _ = q.shape
    kvh = k.shape[2]
    g = h // kvh
    gp = max(pc.MIN_DOT_DIM, pc.next_pow2(g))
    return _Dims(
        b,
        t,
        h,
        kvh,
        g,
        gp,
        pc.padded_dim(q.shape[-1]),
        pc.padded_dim(v.shape[-1]),
        idx.shape[-1],
        block_size,
        pl.cdiv(k.shape[1], block_size),
        positions,
        gp if positions == 1 else max(pc.MIN_DOT_DIM, pc.next_pow2(positions * g)),
        pl.cdiv(t, positions),
    )


def _prep_kv(k, v, d: _Dims):
    tp = d.num_blocks * d.block_size
    k = pc.pad_axis(pc.pad_axis(k, 1, tp), 3, d.dk)
    v = pc.pad_axis(pc.pad_axis(v, 1, tp), 3, d.dv)
    return k, v


def _flat_heads(x_BxTxHxD, d_pad: int):
    b, t, h, _ = x_BxTxHxD.shape
    return pc.pad_axis(x_BxTxHxD, 3, d_pad).reshape(b, t * h, d_pad)


def _unflat_heads(x_BxRowsxD, d: _Dims, d_out: int):
    """[B, T*H, D_padded] -> [B, T, H, d_out] (a reshape, and a slice where D was padded)."""
    x = x_BxRowsxD.reshape(d.batch, d.seq, d.heads, -1)
    return x if x.shape[-1] == d_out else x[..., :d_out]


def _idx_spec(d: _Dims):
    """The block ids of one forward / dQ program: its position's [n], or its P positions' [P, n padded]."""
    if d.positions == 1:
        return pl.BlockSpec((None, None, None, d.slots), lambda t, b, kv: (b, t, kv, 0))
    return pl.BlockSpec((None, d.positions, None, pc.next_pow2(d.slots)), lambda i, b, kv: (b, i, kv, 0))


def _common_specs(d: _Dims):
    tp = d.num_blocks * d.block_size
    th = d.seq * d.heads
    q_spec = pl.BlockSpec((None, th, d.dk), lambda t, b, kv: (b, 0, 0))
    k_spec = pl.BlockSpec((None, tp, None, d.dk), lambda t, b, kv: (b, 0, kv, 0))
    v_spec = pl.BlockSpec((None, tp, None, d.dv), lambda t, b, kv: (b, 0, kv, 0))
    return q_spec, k_spec, v_spec


def _row_kernel(backward: bool, d, off_1, idx, block_size, scale):
    """(kernel, its leading arguments, their specs) of the forward (backward=False) or dQ program over d's rows:
    the query offset when there is one, then the block ids.

    One position's G heads per program (``_sel_kernel``) when d.positions is 1, else P
    positions over the union of their blocks (``_sel_multi_kernel``, ids laid out per program).
    """
    common = dict(block_size=block_size, num_blocks=d.num_blocks, num_heads=d.heads, group=d.group)
    common.update(has_offset=off_1 is not None, backward=backward, scale=scale, scale_log2=scale * pc.LOG2E)
    if d.positions == 1:
        kernel = functools.partial(_sel_kernel, num_slots=d.slots, group_padded=d.group_padded, **common)
    else:
        kernel = functools.partial(
            _sel_multi_kernel,
            slots=pc.next_pow2(d.slots),
            positions=d.positions,
            rows=d.rows_padded,
            seq=d.seq,
            **common,
        )
        idx = _multi_idx(idx, d)
    return kernel, [*pc.offset_operands(off_1), idx], [pc.OFFSET_SPEC] * (off_1 is not None) + [_idx_spec(d)]


def _selection_forward(q, k, v, off_1, idx, block_size, scale, interpret, bsz: SelectionBlockSizes):
    """(o [B, T, H, Dv], lse in the per-program layout [B, K, T/P * Rp])."""
    d = _dims(q, k, v, idx, block_size, bsz.positions)
    k_p, v_p = _prep_kv(k, v, d)
    q_f = _flat_heads(q, d.dk)
    q_spec, k_spec, v_spec = _common_specs(d)
    kernel, lead_args, lead_specs = _row_kernel(False, d, off_1, idx, block_size, scale)
    rows_g = d.programs * d.rows_padded
    # Each program stores its rows straight into o [B, T*H, Dv] (the layout of q), so no
    # padded rows reach memory and no transpose follows.
    o_f, lse = pl.pallas_call(
        kernel,
        grid=(d.programs, d.batch, d.kv_heads),
        in_specs=[*lead_specs, q_spec, k_spec, v_spec],
        out_specs=[
            pl.BlockSpec((None, d.seq * d.heads, d.dv), lambda i, b, kv: (b, 0, 0)),
            pl.BlockSpec((None, None, d.rows_padded), lambda i, b, kv: (b, kv, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((d.batch, d.seq * d.heads, d.dv), q.dtype),
            jax.ShapeDtypeStruct((d.batch, d.kv_heads, rows_g), jnp.float32),
        ],
        compiler_params=pc.compiler_params(bsz.num_warps, bsz.num_stages, d.dk),
        interpret=interpret,
        name="nsa_selection_fwd",
    )(*lead_args, q_f, k_p, v_p)
    return _unflat_heads(o_f, d, v.shape[-1]), lse


def _group_stat(x_BxTxH, d: _Dims):
    """[B, T, H] per-head statistic -> per-program row layout [B, K, T/P * Rp]."""
    x = x_BxTxH.reshape(d.batch, d.seq, d.kv_heads, d.group).transpose(0, 2, 1, 3)
    x = pc.pad_axis(x, 2, d.programs * d.positions)
    x = x.reshape(d.batch, d.kv_heads, d.programs, d.positions * d.group)
    return pc.pad_axis(x, 3, d.rows_padded).reshape(d.batch, d.kv_heads, d.programs * d.rows_padded)


def _multi_idx(idx_BxTxKxN, d: _Dims):
    """Block ids for P-position programs: T padded to T/P * P, slots to a power of two, with -1."""
    idx = pc.pad_axis(idx_BxTxKxN, 1, d.programs * d.positions, value=-1)
    return pc.pad_axis(idx, 3, pc.next_pow2(d.slots), value=-1)


def _selection_backward(q, k, v, off_1, idx, o, lse, do, block_size, scale, interpret, bsz: SelectionBlockSizes):
    d = _dims(q, k, v, idx, block_size, bsz.positions)
    k_p, v_p = _prep_kv(k, v, d)
    q_f = _flat_heads(q, d.dk)
    do_f = _flat_heads(do, d.dv)
    # delta_t = rowsum(dO * O): the softmax-Jacobian correction term.
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
    delta = _group_stat(delta, d)
    params = pc.compiler_params(bsz.num_warps, bsz.num_stages, d.dk)
    q_spec, k_spec, v_spec = _common_specs(d)
    do_spec = pl.BlockSpec((None, d.seq * d.heads, d.dv), lambda t, b, kv: (b, 0, 0))
    stat_spec = pl.BlockSpec((None, None, d.rows_padded), lambda i, b, kv: (b, kv, i))
    # ---- dQ: query-centric, same walk as the forward.
    dq_kernel, lead_args, lead_specs = _row_kernel(True, d, off_1, idx, block_size, scale)
    dq_f = pl.pallas_call(
        dq_kernel,
        grid=(d.programs, d.batch, d.kv_heads),
        in_specs=[*lead_specs, q_spec, k_spec, v_spec, do_spec, stat_spec, stat_spec],
        out_specs=pl.BlockSpec((None, d.seq * d.heads, d.dk), lambda i, b, kv: (b, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((d.batch, d.seq * d.heads, d.dk), q.dtype),
        compiler_params=params,
        interpret=interpret,
        name="nsa_selection_dq",
    )(*lead_args, q_f, k_p, v_p, do_f, lse, delta)
    dq = _unflat_heads(dq_f, d, q.shape[-1])
    # ---- dK/dV: key-centric over the reverse index, in segments.
    qlist, seg_blk, seg_lo, seg_hi, blk_first, blk_count = reverse_index(idx, d.num_blocks, bsz.dkv_segment)
    num_segments = seg_blk.shape[-1]
    entries = d.seq * d.slots
    rows_g = d.programs * d.rows_padded
    tp = d.num_blocks * block_size
    seg_spec = pl.BlockSpec((None, None, num_segments), lambda p, b, kv: (b, kv, 0))
    dkv_kernel = functools.partial(
        _sel_dkv_kernel,
        has_offset=off_1 is not None,
        block_size=block_size,
        num_blocks=d.num_blocks,
        num_heads=d.heads,
        group=d.group,
        positions=d.positions,
        rows_padded=d.rows_padded,
        rows=bsz.rows_dkv,
        scale=scale,
        scale_log2=scale * pc.LOG2E,
    )
    dk_part, dv_part = pl.pallas_call(
        dkv_kernel,
        grid=(num_segments, d.batch, d.kv_heads),
        in_specs=[
            *[pc.OFFSET_SPEC] * (off_1 is not None),
            seg_spec,
            seg_spec,
            seg_spec,
            pl.BlockSpec((None, None, entries), lambda p, b, kv: (b, kv, 0)),
            pl.BlockSpec((None, d.seq * d.heads, d.dk), lambda p, b, kv: (b, 0, 0)),
            pl.BlockSpec((None, tp, None, d.dk), lambda p, b, kv: (b, 0, kv, 0)),
            pl.BlockSpec((None, tp, None, d.dv), lambda p, b, kv: (b, 0, kv, 0)),
            pl.BlockSpec((None, d.seq * d.heads, d.dv), lambda p, b, kv: (b, 0, 0)),
            pl.BlockSpec((None, None, rows_g), lambda p, b, kv: (b, kv, 0)),
            pl.BlockSpec((None, None, rows_g), lambda p, b, kv: (b, kv, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, block_size, d.dk), lambda p, b, kv: (b, kv, p, 0, 0)),
            pl.BlockSpec((None, None, None, block_size, d.dv), lambda p, b, kv: (b, kv, p, 0, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((d.batch, d.kv_heads, num_segments, block_size, d.dk), jnp.float32),
            jax.ShapeDtypeStruct((d.batch, d.kv_heads, num_segments, block_size, d.dv), jnp.float32),
        ],
        compiler_params=pc.compiler_params(None, bsz.num_stages, d.dk),
        interpret=interpret,
        name="nsa_selection_dkv",
    )(*pc.offset_operands(off_1), seg_blk, seg_lo, seg_hi, qlist, q_f, k_p, v_p, do_f, lse, delta)

    blk_spec = pl.BlockSpec((None, None, d.num_blocks), lambda j, b, kv: (b, kv, 0))
    dk_p, dv_p = pl.pallas_call(
        _segment_reduce_kernel,
        grid=(d.num_blocks, d.batch, d.kv_heads),
        in_specs=[
            blk_spec,
            blk_spec,
            pl.BlockSpec((None, None, num_segments, block_size, d.dk), lambda j, b, kv: (b, kv, 0, 0, 0)),
            pl.BlockSpec((None, None, num_segments, block_size, d.dv), lambda j, b, kv: (b, kv, 0, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, block_size, None, d.dk), lambda j, b, kv: (b, j, kv, 0)),
            pl.BlockSpec((None, block_size, None, d.dv), lambda j, b, kv: (b, j, kv, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((d.batch, tp, d.kv_heads, d.dk), k.dtype),
            jax.ShapeDtypeStruct((d.batch, tp, d.kv_heads, d.dv), v.dtype),
        ],
        compiler_params=plgpu_triton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="nsa_selection_dkv_reduce",
    )(blk_first, blk_count, dk_part, dv_part)
    dk = dk_p[:, : k.shape[1], :, : k.shape[-1]]
    dv = dv_p[:, : v.shape[1], :, : v.shape[-1]]
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _selection(q, k, v, off_1, idx, block_size, scale, interpret, bsz):
    return _selection_forward(q, k, v, off_1, idx, block_size, scale, interpret, bsz)[0]


def _selection_vjp_fwd(q, k, v, off_1, idx, block_size, scale, interpret, bsz):
    o, lse = _selection_forward(q, k, v, off_1, idx, block_size, scale, interpret, bsz)
    return o, (q, k, v, off_1, idx, o, lse)


def _selection_vjp_bwd(block_size, scale, interpret, bsz, res, do):
    q, k, v, off_1, idx, o, lse = res
    dq, dk, dv = _selection_backward(q, k, v, off_1, idx, o, lse, do, block_size, scale, interpret, bsz)
    return dq, dk, dv, None, None  # the query offset and the block ids (ints, or None): no gradient


_selection.defvjp(_selection_vjp_fwd, _selection_vjp_bwd)


def smem_estimates(bsz: SelectionBlockSizes, group: int, dk: int, dv: int, block_size: int, itemsize: int):
    """Shared-memory estimate (bytes) of each selection kernel (``pallas_common.smem_estimate``).

    ``dk``, ``dv``: head dims as given (padded here like the kernels pad them).
    """
    gp = max(pc.MIN_DOT_DIM, pc.next_pow2(group if bsz.positions == 1 else bsz.positions * group))
    dk, dv = pc.padded_dim(dk), pc.padded_dim(dv)
    s, r = block_size, bsz.rows_dkv
    est = functools.partial(pc.smem_estimate, num_stages=bsz.num_stages, itemsize=itemsize)
    return {
        "nsa_selection_fwd": est(once=[gp * dk], looped=[s * dk, s * dv], staged=[gp * s]),
        "nsa_selection_dq": est(once=[gp * dk, gp * dv], looped=[s * dk, s * dv], staged=[gp * s]),
        "nsa_selection_dkv": est(once=[s * dk, s * dv], looped=[r * dk, r * dv], staged=[r * s, r * s]),
    }


def fit_block_sizes(bsz: SelectionBlockSizes, q, k, v, block_size: int) -> SelectionBlockSizes:
    """``bsz`` with ``rows_dkv`` chosen when None; raises when the tiles exceed the A100 budget."""
    group = q.shape[2] // k.shape[2]
    itemsize = max(jnp.dtype(x.dtype).itemsize for x in (q, k, v))

    def estimates(b):
        return smem_estimates(b, group, q.shape[-1], v.shape[-1], block_size, itemsize)

    def over(rows):
        return max(estimates(dataclasses.replace(bsz, rows_dkv=rows)).values()) > pc.SMEM_BUDGET_BYTES

    if bsz.rows_dkv is None:
        rows = 64
        while rows > pc.MIN_DOT_DIM and over(rows):
            rows //= 2
        bsz = dataclasses.replace(bsz, rows_dkv=rows)
    knobs = "the selection block length lp (block_size), rows_dkv or num_stages, or use attention_impl=xla"
    pc.check_smem(estimates(bsz), knobs)
    return bsz


def selection_attention_pallas(
    q_BxTxHxDk,
    k_BxTxKxDk,
    v_BxTxKxDv,
    idx_BxTxKxN,
    block_size: int,
    scale: float | None = None,
    *,
    interpret: bool = False,
    block_sizes=None,
    q_offset=0,
):
    """NSA selection attention (fused Pallas/Triton forward and backward).

    Args:
      q_BxTxHxDk: queries; H = K*G, query head h reads KV head h // G; row r is
        the query at position r + q_offset.
      k_BxTxKxDk, v_BxTxKxDv: selection-branch keys and values, Tk >= Tq rows
        (key i at position i); their gradients cover all Tk keys.
      idx_BxTxKxN: int32 selected block ids per (query row, KV head), blocks of
        the Tk keys; -1 = unused; ids in a row are distinct.
      block_size: selection block length lp (power of two >= 16).
      scale: softmax scale, default Dk**-0.5.
      interpret: run the kernels in the Pallas interpreter (CPU tests).
      block_sizes: optional ``SelectionBlockSizes``.
      q_offset: position of q's first row, a Python int or a traced int32
        scalar; the caller keeps q_offset + Tq <= Tk.

    Returns:
      o_BxTxHxDv in q's dtype.
    """
    pc.validate_selection(q_BxTxHxDk, k_BxTxKxDk, v_BxTxKxDv, idx_BxTxKxN, q_offset)
    dk = q_BxTxHxDk.shape[-1]
    pc.check_tile_size("block_size", block_size)
    bsz = SelectionBlockSizes() if block_sizes is None else block_sizes
    if bsz.rows_dkv is not None:
        pc.check_tile_size("rows_dkv", bsz.rows_dkv)
    pc.check_tile_size("positions", bsz.positions, minimum=1)
    bsz = fit_block_sizes(bsz, q_BxTxHxDk, k_BxTxKxDk, v_BxTxKxDv, block_size)
    if bsz.dkv_segment < 1:
        raise ValueError("dkv_segment must be >= 1")
    scale = float(dk**-0.5 if scale is None else scale)
    idx = idx_BxTxKxN.astype(jnp.int32)
    off_1 = pc.offset_operand(q_offset)
    return _selection(q_BxTxHxDk, k_BxTxKxDk, v_BxTxKxDv, off_1, idx, int(block_size), scale, bool(interpret), bsz)
