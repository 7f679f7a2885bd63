"""The selection backward's reverse index: which queries selected each block, without a comparison sort.

`reverse_index(idx, num_blocks, segment)` groups the T*n (query, slot) entries of each
(batch, KV head) by block id, ascending t within a block (CSR form), and cuts each block's
list into work segments for the dK/dV kernel (kernels/selection_pallas.py). The grouping
is a least-significant-digit radix sort in two counting passes (`stable_positions`),
integer arithmetic only: exact, deterministic, and its counters grow as T^1.5 rather than
T x T / lp. Plain XLA: it runs on any backend and the tests hold it to numpy's stable argsort.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from nsa_jax.kernels.pallas_common import pad_axis


def ranks_within_key(key_BxKxTxN, num_keys: int, chunk_elems: int = 1 << 22):
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
    num_chunks = -(-t // c)
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


def stable_positions(key_BxKxTxN, num_keys: int, scan_elems: int) -> jax.Array:
    """[B, K, T*n]: where each (t, s) entry lands in a stable sort of the entries by key (keys in [0, num_keys)).

    A least-significant-digit radix sort in two counting passes, key = hi * R1 + lo:
    entries stably by lo in (t, s) order (``ranks_within_key`` over the rows of n slots:
    T x R1 counters in all), then the result stably by hi (one entry a row: T n x R2
    counters), so equal keys keep (t, s) order. One pass over the whole key would count
    T x num_keys: with num_keys = T / lp + 1 that grows as T^2 (41 GiB moved at T = 256k
    for the a100_pcie layer). R1 = sqrt(n num_keys) balances the two passes: about
    2 T sqrt(n T / lp) counters, 5.6x fewer than one pass at T = 64k and 11x at 256k.
    """
    b, kvh, t, n = key_BxKxTxN.shape
    entries = t * n
    r_lo = min(num_keys, max(1, math.isqrt(n * num_keys - 1) + 1))  # ceil(sqrt(n num_keys))
    r_hi = -(-num_keys // r_lo)
    b_i, k_i = jnp.arange(b)[:, None, None], jnp.arange(kvh)[None, :, None]

    def placed(digit_BxKxE, rank_BxKxE, counts_BxKxR):
        starts_BxKxR = jnp.cumsum(counts_BxKxR, axis=-1) - counts_BxKxR
        return jnp.take_along_axis(starts_BxKxR, digit_BxKxE, axis=-1) + rank_BxKxE

    lo_BxKxTxN = key_BxKxTxN % r_lo
    rank_lo, counts_lo = ranks_within_key(lo_BxKxTxN, r_lo, scan_elems)
    pos1_BxKxE = placed(lo_BxKxTxN.reshape(b, kvh, entries), rank_lo.reshape(b, kvh, entries), counts_lo)
    if r_hi == 1:
        return pos1_BxKxE
    # The high digits in pass-1 order (pos1 is a permutation of [0, T*n) per (b, k)).
    hi_sorted_BxKxE = (
        jnp.zeros((b, kvh, entries), jnp.int32)
        .at[b_i, k_i, pos1_BxKxE]
        .set((key_BxKxTxN // r_lo).reshape(b, kvh, entries), unique_indices=True)
    )
    rank_hi, counts_hi = ranks_within_key(hi_sorted_BxKxE[..., None], r_hi, scan_elems)
    pos2_BxKxE = placed(hi_sorted_BxKxE, rank_hi[..., 0], counts_hi)
    # Entry e sits at pos1[e] after pass 1, and that slot moves to pos2[pos1[e]].
    return jnp.take_along_axis(pos2_BxKxE, pos1_BxKxE, axis=-1)


def _segments(counts_M, num_blocks: int, entries: int, segment: int):
    """One (batch, KV head)'s segments from its per-block counts (see ``reverse_index``)."""
    counts = counts_M[:num_blocks]
    starts = jnp.cumsum(counts) - counts
    nseg = (counts + segment - 1) // segment
    seg_end = jnp.cumsum(nseg)
    seg_first = seg_end - nseg
    num_segments = -(-entries // segment) + num_blocks
    p = jnp.arange(num_segments, dtype=jnp.int32)
    blk = jnp.searchsorted(seg_end, p, side="right").astype(jnp.int32)
    used = blk < num_blocks
    blk_c = jnp.minimum(blk, num_blocks - 1)
    lo = starts[blk_c] + (p - seg_first[blk_c]) * segment
    hi = jnp.minimum(lo + segment, starts[blk_c] + counts[blk_c])
    lo = jnp.where(used, lo, 0)
    hi = jnp.where(used, hi, 0)
    return blk, lo.astype(jnp.int32), hi.astype(jnp.int32), seg_first.astype(jnp.int32), nseg.astype(jnp.int32)


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

    Built as a counting sort of the entries by block id (``stable_positions``: two
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
    pos_BxKxE = stable_positions(key_BxKxTxN, num_blocks + 1, scan_elems)
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

    return _index(qlist, counts_BxKxM, num_blocks, entries, segment)


def _index(qlist_BxKxE, counts_BxKxM, num_blocks: int, entries: int, segment: int) -> ReverseIndex:
    per_bk = jax.vmap(jax.vmap(lambda c: _segments(c, num_blocks, entries, segment)))
    return ReverseIndex(qlist_BxKxE, *per_bk(counts_BxKxM))


def reverse_index_sorted(idx_BxTxKxN, num_blocks: int, segment: int) -> ReverseIndex:
    """``reverse_index`` through one stable comparison sort of the entries by block id: on a TPU the sort is
    a compiled sorting network while the counting passes' scatter-adds run element by element (at T = 8192,
    n = 16, 2 KV heads the counting form moves 33 GiB there); the per-block counts come from a binary
    search of the sorted ids. The same ReverseIndex, entry for entry."""
    b, t, kvh, n = idx_BxTxKxN.shape
    entries = t * n
    idx_BxKxE = idx_BxTxKxN.transpose(0, 2, 1, 3).reshape(b, kvh, entries)
    live = (idx_BxKxE >= 0) & (idx_BxKxE < num_blocks)
    key_BxKxE = jnp.where(live, idx_BxKxE, num_blocks).astype(jnp.int32)
    t_BxKxE = jnp.broadcast_to(jnp.repeat(jnp.arange(t, dtype=jnp.int32), n), key_BxKxE.shape)
    key_sorted, qlist = lax.sort((key_BxKxE, t_BxKxE), dimension=2, is_stable=True, num_keys=1)
    edges_M = jnp.arange(num_blocks + 2, dtype=jnp.int32)
    starts = jax.vmap(jax.vmap(lambda ks: jnp.searchsorted(ks, edges_M, side="left", method="compare_all")))(key_sorted)
    return _index(qlist, jnp.diff(starts, axis=-1).astype(jnp.int32), num_blocks, entries, segment)
