"""Pallas (Triton backend) kernels for NSA selection attention.

This module owns the fused GPU path of the selection branch:
``selection_attention_pallas`` (forward + backward under ``jax.custom_vjp``)
and its reverse index. Padding, compiler parameters, argument checks and the
softmax math on a loaded tile are shared with the other kernels through
``pallas_common``.

Contract (see docs "Selection branch"): query ``t`` of head ``h`` attends to
every position ``p <= t`` inside the blocks ``idx[b, t, h // G, :]`` (block
``j`` covers ``[j*bs, (j+1)*bs)``); ``-1`` marks an unused slot. Softmax and
accumulation run in fp32; the output has the dtype of ``q``. A row that sees
no key returns 0.

Kernel layout
-------------
* Group-centric forward and dq: one program per (query position, batch, KV
  head) holds the G query heads that share the KV head's selection, padded
  to ``Gp = max(16, next_pow2(G))`` rows because the matrix units need at
  least 16 rows. It walks the n slots once, loading each selected K/V block
  of ``bs`` rows a single time for all G heads (online softmax in the
  forward; the log-sum-exp, base 2, is kept for the backward). Grid axis 0
  is the query position so neighbouring programs, which select mostly the
  same blocks, run close together and share K/V through L2.
* The query rows of a group are gathered straight from ``q[B, T*H, D]`` (a
  free reshape), and each program stores its rows of o and dQ straight into
  ``[B, T*H, D]`` the same way, so q, dO, o and dQ are never transposed or
  padded in memory. A padded row repeats a real row (same query, head,
  blocks and statistics), computes its values and stores them again.
* Several positions per program (``SelectionBlockSizes.positions = P > 1``;
  kernels.SELECTION_KERNELS says which the layer runs): with G < 16 the rows
  above are mostly padding (production G = 6: 10 of 16 rows wasted). A
  program then holds P consecutive positions x G heads (row r = head r % G
  of position r // G, padded to ``Rp = max(16, next_pow2(P*G))``: G = 6,
  P = 2 fills 12 of 16) and walks the union of their selections: the P*n
  (position, slot) entries in order, skipping (``lax.cond``, no tile load)
  an entry whose block an earlier entry already brought, and masking each
  row to the blocks its own position selected. When neighbours share most
  blocks the union is close to n blocks and each K/V tile feeds P*G rows;
  when they do not (random selections) the walk grows towards P*n tiles.
  Forward and dQ share this walk; the log-sum-exp and delta are stored per
  program (``T/P * Rp`` rows), which the dK/dV kernel indexes by
  (t // P, t % P, g). The -1-padded block ids ``[P, next_pow2(n)]`` are the
  only extra input.
* On an H200 (docs/PERFORMANCE.md) the walk is bound by loading K/V tiles,
  not by the padded rows: one position with one warp per program is the
  fastest tiling for random selections, four positions when runs of 8
  queries share a selection. A key-centric forward (per block, the rows
  that chose it in full tiles, merged exactly over two passes with atomic
  adds) and dQ added with atomics from the dK/dV kernel were both slower
  at every T and were removed (measured at commit 3a09e79).

dK/dV strategy: reverse index, not atomics
------------------------------------------
Every selected block receives gradient from every query that picked it.
Two ways to collect that without a TxT matrix:

1. Atomic adds from the query-centric programs. Block 0 and the recent
   blocks are picked by (almost) every query, so thousands of programs would
   hammer the same ``bs x D`` tiles: heavy contention, ``T*n*bs*(Dk+Dv)``
   fp32 atomics in total, and a run-to-run non-deterministic sum order.
   (In jax 0.10.2 the primitive is ``jax.experimental.pallas.triton.atomic_add``
   -- there is no ``pl.atomic_add`` -- and it runs in interpret mode only
   unmasked, and it rejects bf16 buffers.)
2. A reverse index: the ``T*n`` (query, slot) entries of each (batch, KV
   head) grouped by block id, ascending t within a block, give per block the
   list of queries that selected it (CSR form, O(T*n) int32). A key-centric
   kernel then loads the K/V block once and streams the queries that chose it.
   The index is a counting sort (``reverse_index``) in two digits of the block
   id, each pass placing entries by their digit's exclusive-cumsum offsets
   plus their rank among equal digits from cumulative counts; no comparison
   sort, integer arithmetic only, so it is exact and deterministic, and its
   counters grow as T^1.5 rather than T x T / lp.

We use (2): no atomics, bitwise deterministic, and the inner loop gathers
``rows_dkv`` flattened (query, head) rows per step, so its matmuls are
``bs x rows`` instead of 16-row slivers. The one hazard is load imbalance:
block 0 is picked by all T queries while the average block is picked by
about ``n*bs`` of them. Each block's list is therefore cut into segments of
at most ``dkv_segment`` entries, one program per segment (at most
``ceil(T*n/S) + T/bs`` programs, a static bound); the partial dK/dV tiles
(fp32, O(T*D) memory) are summed per block by a small deterministic
reduction kernel, which also writes dK/dV in the input layout.

Shared memory (A100)
--------------------
Every tiling must fit an A100 block's 163 KiB of shared memory
(``pallas_common.SMEM_BUDGET_BYTES``). ``smem_estimates`` computes each
kernel's need from lp, the padded head dims, the dtype, ``rows_dkv`` and
``num_stages`` at trace time; ``rows_dkv=None`` is halved from 64 until the
dK/dV kernel fits, and a configuration that still does not fit (lp = 512 at
head dim 128, say) is refused with one error naming the kernel and the knobs.

Query offset
------------
With ``q_offset`` (``pallas_common``, "Query offset") query row ``r`` stands
at position ``r + q_offset``: q, dO, o, dQ and idx ``[B, Tq, K, n]`` are
indexed by row, and the causal test ``p <= t`` inside the selected blocks
takes the row's position. k and v hold the whole sequence (``Tk`` keys, idx's
block ids are blocks of it), and dK/dV cover all of it: the reverse index
lists rows, and a block that no row selected gets zeros. The kernels read the
offset from their first input; the Python int 0 adds none.

All kernels are plain ``pl.pallas_call``s with explicit Triton
``CompilerParams`` so they lower through Triton (A100 and newer), not
Mosaic GPU. ``interpret=True`` runs the same kernels on CPU for testing.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

from nsa_jax.kernels.pallas_common import (
    LOG2E,
    MIN_DOT_DIM,
    OFFSET_SPEC,
    SMEM_BUDGET_BYTES,
    RowPass,
    check_smem,
    check_tile_size,
    compiler_params,
    next_pow2,
    offset_operand,
    offset_operands,
    pad_axis,
    padded_dim,
    shift,
    smem_estimate,
    softmax_grad_tile,
    split_offset,
    validate_selection,
)


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
    pos_S = shift(start, -q_offset) + lax.iota(jnp.int32, block_size)  # less the offset: compared with the row
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
    q_offset, (idx_ref, q_ref, k_ref, v_ref, *refs) = split_offset(refs, has_offset)
    t = pl.program_id(0)
    kv = pl.program_id(2)
    row_Gp, g_Gp = _group_rows(t, kv, num_heads, group, group_padded)
    rows = RowPass(backward, q_ref, refs, row_Gp, scale=scale, scale_log2=scale_log2, scatter=True, stat_row=g_Gp)

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
    pos_1xS = (shift(start, -q_offset) + lax.iota(jnp.int32, block_size))[None, :]  # compared with rows
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
    q_offset, (idx_ref, q_ref, k_ref, v_ref, *refs) = split_offset(refs, has_offset)
    kv = pl.program_id(2)
    t_R, row_R, p_R, stat_R = _multi_rows(
        pl.program_id(0), kv, positions=positions, group=group, rows=rows, seq=seq, num_heads=num_heads
    )
    pass_ = RowPass(backward, q_ref, refs, row_R, scale=scale, scale_log2=scale_log2, scatter=True, stat_row=stat_R)

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
    q_offset, (seg_blk_ref, seg_lo_ref, seg_hi_ref, qlist_ref, *refs) = split_offset(refs, has_offset)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref = refs
    kv = pl.program_id(2)
    seg = _Segment(seg_blk_ref, seg_lo_ref, seg_hi_ref, block_size=block_size, num_blocks=num_blocks, group=group)
    k_SxDk = k_ref[pl.ds(seg.start, block_size), :]
    v_SxDv = v_ref[pl.ds(seg.start, block_size), :]
    # The keys' positions less the offset, once: the causal test below then compares them with rows.
    pos_1xS = shift(seg.pos_1xS, -q_offset)

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
        p_RxS, ds_RxS = softmax_grad_tile(q_RxDk, k_SxDk, v_SxDv, do_RxDv, lse_R, delta_R, vis_RxS, scale_log2)
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
    gp = max(MIN_DOT_DIM, next_pow2(g))
    return _Dims(
        b,
        t,
        h,
        kvh,
        g,
        gp,
        padded_dim(q.shape[-1]),
        padded_dim(v.shape[-1]),
        idx.shape[-1],
        block_size,
        pl.cdiv(k.shape[1], block_size),
        positions,
        gp if positions == 1 else max(MIN_DOT_DIM, next_pow2(positions * g)),
        pl.cdiv(t, positions),
    )


def _prep_kv(k, v, d: _Dims):
    tp = d.num_blocks * d.block_size
    k = pad_axis(pad_axis(k, 1, tp), 3, d.dk)
    v = pad_axis(pad_axis(v, 1, tp), 3, d.dv)
    return k, v


def _flat_heads(x_BxTxHxD, d_pad: int):
    b, t, h, _ = x_BxTxHxD.shape
    return pad_axis(x_BxTxHxD, 3, d_pad).reshape(b, t * h, d_pad)


def _unflat_heads(x_BxRowsxD, d: _Dims, d_out: int):
    """[B, T*H, D_padded] -> [B, T, H, d_out] (a reshape, and a slice where D was padded)."""
    x = x_BxRowsxD.reshape(d.batch, d.seq, d.heads, -1)
    return x if x.shape[-1] == d_out else x[..., :d_out]


def _idx_spec(d: _Dims):
    """The block ids of one forward / dQ program: its position's [n], or its P positions' [P, n padded]."""
    if d.positions == 1:
        return pl.BlockSpec((None, None, None, d.slots), lambda t, b, kv: (b, t, kv, 0))
    return pl.BlockSpec((None, d.positions, None, next_pow2(d.slots)), lambda i, b, kv: (b, i, kv, 0))


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
    common.update(has_offset=off_1 is not None, backward=backward, scale=scale, scale_log2=scale * LOG2E)
    if d.positions == 1:
        kernel = functools.partial(_sel_kernel, num_slots=d.slots, group_padded=d.group_padded, **common)
    else:
        kernel = functools.partial(
            _sel_multi_kernel, slots=next_pow2(d.slots), positions=d.positions, rows=d.rows_padded, seq=d.seq, **common
        )
        idx = _multi_idx(idx, d)
    return kernel, [*offset_operands(off_1), idx], [OFFSET_SPEC] * (off_1 is not None) + [_idx_spec(d)]


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
        compiler_params=compiler_params(bsz.num_warps, bsz.num_stages, d.dk),
        interpret=interpret,
        name="nsa_selection_fwd",
    )(*lead_args, q_f, k_p, v_p)
    return _unflat_heads(o_f, d, v.shape[-1]), lse


def _group_stat(x_BxTxH, d: _Dims):
    """[B, T, H] per-head statistic -> per-program row layout [B, K, T/P * Rp]."""
    x = x_BxTxH.reshape(d.batch, d.seq, d.kv_heads, d.group).transpose(0, 2, 1, 3)
    x = pad_axis(x, 2, d.programs * d.positions)
    x = x.reshape(d.batch, d.kv_heads, d.programs, d.positions * d.group)
    return pad_axis(x, 3, d.rows_padded).reshape(d.batch, d.kv_heads, d.programs * d.rows_padded)


def _multi_idx(idx_BxTxKxN, d: _Dims):
    """Block ids for P-position programs: T padded to T/P * P, slots to a power of two, with -1."""
    idx = pad_axis(idx_BxTxKxN, 1, d.programs * d.positions, value=-1)
    return pad_axis(idx, 3, next_pow2(d.slots), value=-1)


def _ranks_within_key(key_BxKxTxN, num_keys: int, chunk_elems: int = 1 << 22):
    """rank [B, K, T, n]: entries before (t, s) in (query, slot) order with the same key; counts [B, K, num_keys].

    A counting sort's placement, without a comparison sort. Across queries: a
    scan over chunks of C query positions scatter-adds each query's key counts
    into [B, K, C, num_keys] (integer adds: exact in any order), and an
    inclusive cumsum along the chunk plus the running total of the earlier
    chunks gives, for each query, how many earlier queries hold each key. Within
    a query: an n x n comparison of its own slots (n is small), which keeps
    duplicate keys in one row (several unused slots) in slot order. The work is
    O(T * num_keys + T * n^2) int32, memory O(C * num_keys) with
    ``C * num_keys * B * K <= chunk_elems``.
    """
    b, kvh, t, n = key_BxKxTxN.shape
    c = max(1, min(t, chunk_elems // max(1, b * kvh * num_keys)))
    num_chunks = pl.cdiv(t, c)
    # Padded queries take key num_keys: counted in no bucket (dropped by the scatter).
    key = pad_axis(key_BxKxTxN, 2, num_chunks * c, value=num_keys)
    s_N = jnp.arange(n)
    earlier_NxN = s_N[None, :] < s_N[:, None]  # [s, s']: slot s' comes before slot s
    in_row = jnp.sum((key[..., :, None] == key[..., None, :]) & earlier_NxN, axis=-1, dtype=jnp.int32)
    key_PxBxKxCxN = jnp.moveaxis(key.reshape(b, kvh, num_chunks, c, n), 2, 0)
    b_i = jnp.arange(b)[:, None, None, None]
    k_i = jnp.arange(kvh)[None, :, None, None]
    c_i = jnp.arange(c)[None, None, :, None]

    def step(total_BxKxM, key_BxKxCxN):
        cnt_BxKxCxM = jnp.zeros((b, kvh, c, num_keys), jnp.int32).at[b_i, k_i, c_i, key_BxKxCxN].add(1, mode="drop")
        before_BxKxCxM = jnp.cumsum(cnt_BxKxCxM, axis=2) - cnt_BxKxCxM + total_BxKxM[:, :, None, :]
        key_c = jnp.minimum(key_BxKxCxN, num_keys - 1)  # padded entries: any in-bounds bucket, dropped later
        rank_BxKxCxN = jnp.take_along_axis(before_BxKxCxM, key_c, axis=3)
        return total_BxKxM + jnp.sum(cnt_BxKxCxM, axis=2), rank_BxKxCxN

    counts_BxKxM, rank_PxBxKxCxN = lax.scan(step, jnp.zeros((b, kvh, num_keys), jnp.int32), key_PxBxKxCxN)
    rank = jnp.moveaxis(rank_PxBxKxCxN, 0, 2).reshape(b, kvh, num_chunks * c, n)[:, :, :t]
    return rank + in_row[:, :, :t], counts_BxKxM


def _stable_positions(key_BxKxTxN, num_keys: int, scan_elems: int) -> jax.Array:
    """[B, K, T*n]: where each (t, s) entry lands in a stable sort of the entries by key (keys in [0, num_keys)).

    A least-significant-digit radix sort in two counting passes, key = hi * R1 + lo:
    entries stably by lo in (t, s) order (``_ranks_within_key`` over the rows of n slots:
    T x R1 counters in all), then the result stably by hi (one entry a row: T n x R2
    counters), so equal keys keep (t, s) order. One pass over the whole key would count
    T x num_keys: with num_keys = T / lp + 1 that grows as T^2 (41 GiB moved at T = 256k
    for the a100_pcie layer). R1 = sqrt(n num_keys) balances the two passes: about
    2 T sqrt(n T / lp) counters, 5.6x fewer than one pass at T = 64k and 11x at 256k.
    """
    b, kvh, t, n = key_BxKxTxN.shape
    entries = t * n
    r_lo = min(num_keys, max(1, math.isqrt(n * num_keys - 1) + 1))  # ceil(sqrt(n num_keys))
    r_hi = pl.cdiv(num_keys, r_lo)
    b_i, k_i = jnp.arange(b)[:, None, None], jnp.arange(kvh)[None, :, None]

    def placed(digit_BxKxE, rank_BxKxE, counts_BxKxR):
        starts_BxKxR = jnp.cumsum(counts_BxKxR, axis=-1) - counts_BxKxR
        return jnp.take_along_axis(starts_BxKxR, digit_BxKxE, axis=-1) + rank_BxKxE

    lo_BxKxTxN = key_BxKxTxN % r_lo
    rank_lo, counts_lo = _ranks_within_key(lo_BxKxTxN, r_lo, scan_elems)
    pos1_BxKxE = placed(lo_BxKxTxN.reshape(b, kvh, entries), rank_lo.reshape(b, kvh, entries), counts_lo)
    if r_hi == 1:
        return pos1_BxKxE
    # The high digits in pass-1 order (pos1 is a permutation of [0, T*n) per (b, k)).
    hi_sorted_BxKxE = (
        jnp.zeros((b, kvh, entries), jnp.int32)
        .at[b_i, k_i, pos1_BxKxE]
        .set((key_BxKxTxN // r_lo).reshape(b, kvh, entries), unique_indices=True)
    )
    rank_hi, counts_hi = _ranks_within_key(hi_sorted_BxKxE[..., None], r_hi, scan_elems)
    pos2_BxKxE = placed(hi_sorted_BxKxE, rank_hi[..., 0], counts_hi)
    # Entry e sits at pos1[e] after pass 1, and that slot moves to pos2[pos1[e]].
    return jnp.take_along_axis(pos2_BxKxE, pos1_BxKxE, axis=-1)


class ReverseIndex(NamedTuple):
    """A selection's CSR reverse index, cut into work segments (``reverse_index``); all int32."""

    qlist: jax.Array  # [B, K, T*n]
    seg_blk: jax.Array  # [B, K, P]
    seg_lo: jax.Array  # [B, K, P]
    seg_hi: jax.Array  # [B, K, P]
    blk_first: jax.Array  # [B, K, NB]
    blk_count: jax.Array  # [B, K, NB]


def reverse_index(idx_BxTxKxN, num_blocks: int, segment: int, *, scan_elems: int = 1 << 22) -> ReverseIndex:
    """CSR reverse index of a selection, cut into work segments (no comparison sort).

    Returns a ``ReverseIndex`` (all int32):
      qlist [B, K, T*n]: query positions grouped by the block they selected,
        ascending t within a block (what a stable sort by block id gives);
        unused slots (-1, or ids outside [0, num_blocks)) fill the tail.
      seg_blk, seg_lo, seg_hi [B, K, P]: segment p covers entries
        ``qlist[seg_lo:seg_hi]`` of block ``seg_blk`` (``num_blocks`` and an
        empty range for the unused tail); ``P = ceil(T*n/segment) + NB``.
      blk_first, blk_count [B, K, NB]: each block's segments are
        ``seg_first .. seg_first + blk_count - 1``.

    Built as a counting sort of the entries by block id (``_stable_positions``: two
    counting passes, one per digit of the id, holding at most ``scan_elems``
    counters at a time), then the per-block counts' exclusive cumsum as the
    segments' offsets. A comparison sort of the T*n entries (what XLA emits for
    argsort) costs O(E log^2 E) on a GPU and was the largest non-kernel op of the
    backward.
    """
    b, t, kvh, n = idx_BxTxKxN.shape
    entries = t * n
    idx_BxKxTxN = idx_BxTxKxN.transpose(0, 2, 1, 3)
    live = (idx_BxKxTxN >= 0) & (idx_BxKxTxN < num_blocks)
    key_BxKxTxN = jnp.where(live, idx_BxKxTxN, num_blocks).astype(jnp.int32)
    pos_BxKxE = _stable_positions(key_BxKxTxN, num_blocks + 1, scan_elems)
    b_i, k_i = jnp.arange(b)[:, None, None], jnp.arange(kvh)[None, :, None]
    counts_BxKxM = (
        jnp.zeros((b, kvh, num_blocks + 1), jnp.int32).at[b_i, k_i, key_BxKxTxN.reshape(b, kvh, entries)].add(1)
    )
    t_E = jnp.repeat(jnp.arange(t, dtype=jnp.int32), n)
    # pos is a permutation of [0, T*n) per (b, k): every element is written once.
    qlist = (
        jnp.zeros((b, kvh, entries), jnp.int32)
        .at[jnp.arange(b)[:, None, None], jnp.arange(kvh)[None, :, None], pos_BxKxE]
        .set(jnp.broadcast_to(t_E, pos_BxKxE.shape), unique_indices=True)
    )

    def per_row(counts_M):
        counts = counts_M[:num_blocks]
        starts = jnp.cumsum(counts) - counts
        nseg = (counts + segment - 1) // segment
        seg_end = jnp.cumsum(nseg)
        seg_first = seg_end - nseg
        num_segments = pl.cdiv(entries, segment) + num_blocks
        p = jnp.arange(num_segments, dtype=jnp.int32)
        blk = jnp.searchsorted(seg_end, p, side="right").astype(jnp.int32)
        used = blk < num_blocks
        blk_c = jnp.minimum(blk, num_blocks - 1)
        lo = starts[blk_c] + (p - seg_first[blk_c]) * segment
        hi = jnp.minimum(lo + segment, starts[blk_c] + counts[blk_c])
        lo = jnp.where(used, lo, 0)
        hi = jnp.where(used, hi, 0)
        return blk, lo.astype(jnp.int32), hi.astype(jnp.int32), seg_first.astype(jnp.int32), nseg.astype(jnp.int32)

    per_bk = jax.vmap(jax.vmap(per_row))
    seg_blk, seg_lo, seg_hi, blk_first, blk_count = per_bk(counts_BxKxM)
    return ReverseIndex(qlist, seg_blk, seg_lo, seg_hi, blk_first, blk_count)


def _selection_backward(q, k, v, off_1, idx, o, lse, do, block_size, scale, interpret, bsz: SelectionBlockSizes):
    d = _dims(q, k, v, idx, block_size, bsz.positions)
    k_p, v_p = _prep_kv(k, v, d)
    q_f = _flat_heads(q, d.dk)
    do_f = _flat_heads(do, d.dv)
    # delta_t = rowsum(dO * O): the softmax-Jacobian correction term.
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
    delta = _group_stat(delta, d)
    params = compiler_params(bsz.num_warps, bsz.num_stages, d.dk)
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
        scale_log2=scale * LOG2E,
    )
    dk_part, dv_part = pl.pallas_call(
        dkv_kernel,
        grid=(num_segments, d.batch, d.kv_heads),
        in_specs=[
            *[OFFSET_SPEC] * (off_1 is not None),
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
        compiler_params=compiler_params(None, bsz.num_stages, d.dk),
        interpret=interpret,
        name="nsa_selection_dkv",
    )(*offset_operands(off_1), seg_blk, seg_lo, seg_hi, qlist, q_f, k_p, v_p, do_f, lse, delta)

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
    gp = max(MIN_DOT_DIM, next_pow2(group if bsz.positions == 1 else bsz.positions * group))
    dk, dv = padded_dim(dk), padded_dim(dv)
    s, r = block_size, bsz.rows_dkv
    est = functools.partial(smem_estimate, num_stages=bsz.num_stages, itemsize=itemsize)
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
        return max(estimates(dataclasses.replace(bsz, rows_dkv=rows)).values()) > SMEM_BUDGET_BYTES

    if bsz.rows_dkv is None:
        rows = 64
        while rows > MIN_DOT_DIM and over(rows):
            rows //= 2
        bsz = dataclasses.replace(bsz, rows_dkv=rows)
    knobs = "the selection block length lp (block_size), rows_dkv or num_stages, or use attention_impl=xla"
    check_smem(estimates(bsz), knobs)
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
    validate_selection(q_BxTxHxDk, k_BxTxKxDk, v_BxTxKxDv, idx_BxTxKxN, q_offset)
    dk = q_BxTxHxDk.shape[-1]
    check_tile_size("block_size", block_size)
    bsz = SelectionBlockSizes() if block_sizes is None else block_sizes
    if bsz.rows_dkv is not None:
        check_tile_size("rows_dkv", bsz.rows_dkv)
    check_tile_size("positions", bsz.positions, minimum=1)
    bsz = fit_block_sizes(bsz, q_BxTxHxDk, k_BxTxKxDk, v_BxTxKxDv, block_size)
    if bsz.dkv_segment < 1:
        raise ValueError("dkv_segment must be >= 1")
    scale = float(dk**-0.5 if scale is None else scale)
    idx = idx_BxTxKxN.astype(jnp.int32)
    off_1 = offset_operand(q_offset)
    return _selection(q_BxTxHxDk, k_BxTxKxDk, v_BxTxKxDv, off_1, idx, int(block_size), scale, bool(interpret), bsz)
