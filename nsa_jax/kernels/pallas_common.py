"""Helpers and tile math shared by the Pallas kernels (selection, flash, compressed, block scores).

A kernel holds a tile of query rows and walks key tiles it picks itself, with its own visibility mask;
this module owns what is the same once a tile is loaded and its mask is known:
* the log2-domain conventions (`LOG2E`, `MASK_VALUE`) and the tile's scores `scores_log2`;
* the forward online softmax: `online_softmax_init`, one `online_softmax_step` per key tile, and
  `online_softmax_finish`, which gives the output and the base-2 log-sum-exp the backward reuses, and its
  value-free half (`softmax_stats_init` / `softmax_stats_step`) for a pass that wants the log-sum-exp alone;
* the backward of one tile, `softmax_grad_tile` (probabilities recomputed from that log-sum-exp).
These take and return arrays (never refs) and are traced into the calling kernel: no launch, no memory
traffic. Suffixes: R query rows of the tile, C keys of the tile, Dk / Dv head dims. For the `pallas_call`
wrappers: the power-of-two tile rule (`is_tile_size`, `check_tile_size`), padding (`padded_dim`,
`pad_axis`), Triton compiler parameters, q/k/v checks (`validate_qkv`), the A100 shared-memory budget
(`SMEM_BUDGET_BYTES`, `smem_estimate`, `check_smem`) and the flash key layouts (`KeyLayout`, `layout_visible`).
Query offset: query row r stands at position r + q_offset while keys keep theirs. The offset may be traced
(inside `shard_map` it comes from the device's index), so it is one more kernel input, an int32 [1] read
once (`offset_operand`, `OFFSET_SPEC`, `split_offset`); the Python int 0 adds no input and no arithmetic
(`shift` returns its argument). Where the offset enters each kernel: docs/DESIGN_NOTES.md.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

# Scores live in the log2 domain (exp2 is the cheap instruction).
LOG2E = math.log2(math.e)
# Finite "minus infinity": masked logits and the running max start here, so
# an all-masked row never produces inf - inf.
MASK_VALUE = -1e30
# Smallest M/N/K the Triton matmul accepts.
MIN_DOT_DIM = 16


# ---------------------------------------------------------------------------
# Sizes, padding, compiler parameters, argument checks
# ---------------------------------------------------------------------------


def next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def is_tile_size(value: int, minimum: int = MIN_DOT_DIM) -> bool:
    """Whether ``value`` is a power of two >= ``minimum`` (what a tile or a selection block must be)."""
    return value >= minimum and value & (value - 1) == 0


def check_tile_size(name: str, value: int, minimum: int = MIN_DOT_DIM) -> None:
    if not is_tile_size(value, minimum):
        raise ValueError(f"{name}={value} must be a power of two >= {minimum}")


def padded_dim(d: int) -> int:
    """Head dim as the kernels see it: a power of two, at least 16."""
    return max(MIN_DOT_DIM, next_pow2(d))


def pad_axis(x, axis: int, size: int, value=0):
    """Pads ``x`` along ``axis`` up to ``size`` (no-op when already there)."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def compiler_params(num_warps: int | None, num_stages: int, head_dim: int):
    if num_warps is None:
        num_warps = 4 if head_dim <= 64 else 8
    return plgpu_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def validate_qkv(q, k, v, *, same_length: bool = True):
    """Shape checks shared by the kernels; `same_length=False` lets k/v have their own length (compressed tokens)."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError("q, k, v must be [B, T, heads, D]")
    b, t, h, dk = q.shape
    if k.shape[:2] != (b, t if same_length else k.shape[1]) or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"shape mismatch: q{q.shape} k{k.shape} v{v.shape}")
    if k.shape[-1] != dk:
        raise ValueError("q and k must share the head dim")
    if h % k.shape[2]:
        raise ValueError(f"query heads {h} not a multiple of KV heads {k.shape[2]}")


# ---------------------------------------------------------------------------
# Query offset
# ---------------------------------------------------------------------------


def is_static_zero(q_offset) -> bool:
    """Whether ``q_offset`` is the Python int 0: the kernels without an offset input."""
    return isinstance(q_offset, int) and not isinstance(q_offset, bool) and q_offset == 0


def check_query_offset(q_offset, num_rows: int, num_keys: int | None = None) -> None:
    """Refuses a query offset that is not an integer scalar, and query rows that are not all positions of
    ``num_keys`` raw keys: ``[q_offset, q_offset + num_rows)`` for a Python int, ``[0, num_rows)`` at least for
    a traced one, whose range is the caller's to keep. ``num_keys`` None: the keys are not raw positions
    (compressed tokens), only ``q_offset >= 0`` is checked."""
    static = isinstance(q_offset, int) and not isinstance(q_offset, bool)
    if not static and (jnp.shape(q_offset) != () or not jnp.issubdtype(jnp.result_type(q_offset), jnp.integer)):
        raise ValueError(f"q_offset must be an integer scalar, got {q_offset!r}")
    first = q_offset if static else 0
    if first < 0:
        raise ValueError(f"q_offset={q_offset} must be >= 0")
    if num_keys is not None and first + num_rows > num_keys:
        raise ValueError(
            f"q_offset={first} puts the last of {num_rows} query rows at position {first + num_rows - 1}, past the "
            f"{num_keys} keys"
            if static
            else f"{num_rows} query rows reach past the {num_keys} keys at any q_offset"
        )


def validate_selection(q, k, v, idx, q_offset) -> None:
    """The checks of a selection call: q, k, v (``validate_qkv``; k and v hold the Tk keys of the whole
    sequence), the query offset against those keys, and idx [B, Tq, K, n] (one row per query row)."""
    validate_qkv(q, k, v, same_length=False)
    check_query_offset(q_offset, q.shape[1], k.shape[1])
    if idx.ndim != 4 or idx.shape[:3] != (*q.shape[:2], k.shape[2]):
        raise ValueError(f"block indices {idx.shape} do not match [B, T, K, n] of q{q.shape} k{k.shape}")


def offset_operand(q_offset):
    """The kernels' offset input: None for the Python int 0 (no input), else ``q_offset`` as int32 [1]."""
    if is_static_zero(q_offset):
        return None
    return jnp.asarray(q_offset, jnp.int32).reshape(1)


def offset_operands(off_1) -> tuple:
    """``off_1`` (an ``offset_operand``) as the leading kernel arguments: () or (off_1,)."""
    return () if off_1 is None else (off_1,)


# The offset input's BlockSpec: the whole [1] array in every program, whatever the grid.
OFFSET_SPEC = pl.BlockSpec((1,), lambda *_: (0,))


def split_offset(refs, has_offset: bool):
    """(query offset, the other refs) inside a kernel: an offset call passes its [1] input first; else 0."""
    if not has_offset:
        return 0, refs
    return refs[0][0], refs[1:]


def shift(x, q_offset):
    """Positions of rows ``x``: ``x + q_offset``, or ``x`` itself for the static offset 0 (nothing traced)."""
    return x if is_static_zero(q_offset) else x + q_offset


# ---------------------------------------------------------------------------
# Shared-memory budget
# ---------------------------------------------------------------------------

# Every tiling must compile on an A100 (sm_80): 164 KiB of shared memory per SM, of which
# one thread block may opt into at most 163 KiB (166912 bytes). sm_80 has no wgmma or TMA,
# so Triton stages the operands of every matmul through shared memory itself. Hopper
# (227 KiB per block) has more, so a tiling inside this budget runs on every GPU the
# kernels target.
SMEM_BUDGET_BYTES = 163 * 1024


def smem_estimate(*, once=(), looped=(), staged=(), num_stages: int, itemsize: int) -> int:
    """Bytes of shared memory one program's tiles need, from their element counts.

    A deliberately pessimistic model of Triton's staging on sm_80: ``once``: tiles
    loaded once per program and used as matmul operands (each staged once);
    ``looped``: tiles loaded in the pipelined inner loop (``num_stages`` buffers
    each); ``staged``: tiles computed in the loop and cast to the input dtype for
    a matmul (P, dS). fp32 accumulators live in registers and are not counted.
    """
    return itemsize * (sum(once) + num_stages * sum(looped) + sum(staged))


def check_smem(estimates: dict[str, int], knobs: str) -> None:
    """Raises one ValueError naming the kernel whose tiles exceed ``SMEM_BUDGET_BYTES`` and the knobs to lower."""
    kernel, need = max(estimates.items(), key=lambda kv: kv[1])
    if need > SMEM_BUDGET_BYTES:
        raise ValueError(
            f"{kernel}: its tiles need about {need / 1024:.0f} KiB of shared memory, over the "
            f"{SMEM_BUDGET_BYTES // 1024} KiB an A100 (sm_80) block can have; lower {knobs}"
        )


# ---------------------------------------------------------------------------
# Key layouts
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KeyLayout:
    """Where the keys stand: key ``i`` at position ``i * stride + offset``, ``num_keys`` of them;
    query ``t`` sees positions in ``(t - window, t]``."""

    num_keys: int
    window: int
    stride: int = 1
    offset: int = 0


def layout_visible(t_R, valid_R, i_C, lay: KeyLayout, q_offset=0):
    """[R, C] mask: row t, the query at position t + q_offset, sees key i (``vis(t + q_offset, i)`` of the
    layout, keys past num_keys never). The keys' positions are shifted by -q_offset, not the rows'."""
    pos_1xC = (i_C * lay.stride + shift(lay.offset, -q_offset))[None, :]
    t_Rx1 = t_R[:, None]
    live_1xC = (i_C < lay.num_keys)[None, :]
    return valid_R[:, None] & (pos_1xC <= t_Rx1) & (pos_1xC > t_Rx1 - lay.window) & live_1xC


# ---------------------------------------------------------------------------
# Tile math
# ---------------------------------------------------------------------------


def scores_log2(q_RxDk, k_CxDk, scale_log2: float):
    """``q k^T * scale`` in log2 units (``scale_log2 = scale * LOG2E``), fp32 [R, C]."""
    return plgpu_triton.dot(q_RxDk, k_CxDk, trans_b=True) * scale_log2


def softmax_stats_init(rows: int):
    """(running max m [R], running sum l [R]) before the first key tile."""
    return jnp.full((rows,), MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32)


def online_softmax_init(rows: int, dv: int):
    """(acc [R, Dv], running max m [R], running sum l [R]) before the first key tile."""
    return (jnp.zeros((rows, dv), jnp.float32), *softmax_stats_init(rows))


def _softmax_fold(m_R, l_R, q_RxDk, k_CxDk, vis_RxC, scale_log2: float):
    """(m_new, alpha = exp2(m - m_new), P [R, C] against m_new, l_new) of one key tile."""
    s_RxC = jnp.where(vis_RxC, scores_log2(q_RxDk, k_CxDk, scale_log2), MASK_VALUE)
    m_new_R = jnp.maximum(m_R, jnp.max(s_RxC, axis=1))
    alpha_R = jnp.exp2(m_R - m_new_R)
    # The explicit where keeps fully masked rows at exactly zero weight.
    p_RxC = jnp.where(vis_RxC, jnp.exp2(s_RxC - m_new_R[:, None]), 0.0)
    return m_new_R, alpha_R, p_RxC, l_R * alpha_R + jnp.sum(p_RxC, axis=1)


def online_softmax_step(carry, q_RxDk, k_CxDk, v_CxDv, vis_RxC, scale_log2: float):
    """Folds one key tile into the running (acc, m, l); ``vis_RxC`` may be [1, C] (one mask for all rows)."""
    acc_RxDv, m_R, l_R = carry
    m_R, alpha_R, p_RxC, l_R = _softmax_fold(m_R, l_R, q_RxDk, k_CxDk, vis_RxC, scale_log2)
    acc_RxDv = acc_RxDv * alpha_R[:, None] + plgpu_triton.dot(p_RxC.astype(v_CxDv.dtype), v_CxDv)
    return acc_RxDv, m_R, l_R


def softmax_stats_step(carry, q_RxDk, k_CxDk, vis_RxC, scale_log2: float):
    """Folds one key tile into the running (m, l) alone: online_softmax_step without the values."""
    m_R, _, _, l_R = _softmax_fold(*carry, q_RxDk, k_CxDk, vis_RxC, scale_log2)
    return m_R, l_R


def _log_sum_exp2(m_R, l_R):
    """(lse [R] base 2, 0 for a row that saw no key; l with 1 in those rows)."""
    seen_R = l_R > 0.0
    l_safe_R = jnp.where(seen_R, l_R, 1.0)
    return jnp.where(seen_R, m_R + jnp.log2(l_safe_R), 0.0), l_safe_R


def online_softmax_finish(carry):
    """(o [R, Dv] fp32, lse [R] base 2) of the walk; a row that saw no key gets o = 0 and lse = 0."""
    acc_RxDv, m_R, l_R = carry
    lse_R, l_safe_R = _log_sum_exp2(m_R, l_R)
    return acc_RxDv / l_safe_R[:, None], lse_R


def softmax_grad_tile(q_RxDk, k_CxDk, v_CxDv, do_RxDv, lse_R, delta_R, vis_RxC, scale_log2: float):
    """(P, dS) of one tile, fp32 [R, C], for the backward kernels.

    P is recomputed from the forward's log-sum-exp instead of stored (no T x T
    matrix). dS = P * (dO V^T - delta), with delta = rowsum(dO * O), is the
    gradient of the logits ``scale * q k^T``; the callers' dQ / dK sums take
    the remaining factor ``scale`` once, at the end.
    """
    s_RxC = scores_log2(q_RxDk, k_CxDk, scale_log2)
    p_RxC = jnp.where(vis_RxC, jnp.exp2(s_RxC - lse_R[:, None]), 0.0)
    dp_RxC = plgpu_triton.dot(do_RxDv, v_CxDv, trans_b=True)
    return p_RxC, p_RxC * (dp_RxC - delta_R[:, None])


class RowPass:
    """What one forward or dQ program does to its query rows, whichever key tiles it walks.

    The forward and the dQ kernel of a branch walk the same key tiles with the same
    masks; they differ only in the per-tile update and the outputs, which live here,
    so each branch writes its tile walk once:

    * forward (``refs`` = o [R, Dv], lse [R]): ``init`` the online softmax, ``step``
      one tile into it, ``finish`` writes o and the base-2 log-sum-exp;
    * dQ (``refs`` = do [T*H, Dv], lse [R], delta [R], dq [R, Dk]): ``init`` zeros,
      ``step`` adds dS K of one tile, ``finish`` writes dq * scale;
    * ``stats_only`` (a forward; ``refs`` = lse [R]): the running max and sum alone, no
      values: ``finish`` writes the log-sum-exp the forward would (``step`` takes v=None).

    Built inside the kernel: the constructor loads the rows ``row`` of q (and of dO,
    with lse and delta, for dQ), so the loads come where a kernel would write them.
    ``scatter``: o and dq are the whole ``[T*H, D]`` arrays and each row is stored at
    its own ``row``; otherwise they are the program's own ``[R, D]`` tiles. With
    ``scatter`` a row that repeats another must compute the same values (it stores
    them again): ``stat_row`` [R] then names the entry of the program's lse / delta
    that each row reads (the repeated row's own), default the row's.
    """

    def __init__(
        self,
        backward: bool,
        q_ref,
        refs,
        row,
        *,
        scale: float,
        scale_log2: float,
        scatter=False,
        stat_row=None,
        stats_only=False,
    ):
        if backward and stats_only:
            raise ValueError("RowPass: stats_only is a forward")
        self.backward, self.scale, self.scale_log2 = backward, scale, scale_log2
        self.stats_only = stats_only
        self.row, self.scatter = row, scatter
        self.q_RxDk = q_ref[row, :]
        if backward:
            do_ref, lse_ref, delta_ref, self.dq_ref = refs
            self.do_RxDv = do_ref[row, :]
            self.lse_R = lse_ref[...] if stat_row is None else lse_ref[stat_row]
            self.delta_R = delta_ref[...] if stat_row is None else delta_ref[stat_row]
        elif stats_only:
            (self.lse_ref,) = refs
        else:
            self.o_ref, self.lse_ref = refs

    def init(self, rows: int):
        if self.backward:
            return jnp.zeros((rows, self.q_RxDk.shape[-1]), jnp.float32)
        if self.stats_only:
            return softmax_stats_init(rows)
        return online_softmax_init(rows, self.o_ref.shape[-1])

    def step(self, carry, k_CxDk, v_CxDv, vis_RxC):
        if self.stats_only:
            return softmax_stats_step(carry, self.q_RxDk, k_CxDk, vis_RxC, self.scale_log2)
        if not self.backward:
            return online_softmax_step(carry, self.q_RxDk, k_CxDk, v_CxDv, vis_RxC, self.scale_log2)
        _, ds_RxC = softmax_grad_tile(
            self.q_RxDk, k_CxDk, v_CxDv, self.do_RxDv, self.lse_R, self.delta_R, vis_RxC, self.scale_log2
        )
        return carry + plgpu_triton.dot(ds_RxC.astype(k_CxDk.dtype), k_CxDk)

    def _store(self, ref, x_RxD) -> None:
        if self.scatter:
            ref[self.row, :] = x_RxD.astype(ref.dtype)
        else:
            ref[...] = x_RxD.astype(ref.dtype)

    def finish(self, carry) -> None:
        if self.backward:
            self._store(self.dq_ref, carry * self.scale)
            return
        if self.stats_only:
            self.lse_ref[...] = _log_sum_exp2(*carry)[0]
            return
        o_RxDv, lse_R = online_softmax_finish(carry)
        self._store(self.o_ref, o_RxDv)
        self.lse_ref[...] = lse_R
