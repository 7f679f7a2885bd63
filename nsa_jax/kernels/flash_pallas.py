"""Pallas (Triton backend) flash-attention kernels over a key layout: the engine of the NSA branches.

`banded_attention`: a fused forward, a dQ kernel and a dK/dV kernel under `jax.custom_vjp` for keys placed
by a `KeyLayout` (pallas_common: key i at position i*stride + offset, seen by query t iff that position lies
in (t - window, t]), optionally under a per-row block mask. `banded_lse`: its forward without values, the
log-sum-exp alone, for a caller whose attention output comes from elsewhere (kernels/cudnn.py).
`window_attention_pallas`: query t attends to [max(0, t - w + 1), t] (stride 1, offset 0; docs/NSA.md,
"Selection and window attention"). compressed_pallas runs `banded_attention` with `stride=d, offset=l-1`,
blocksparse_pallas with the causal layout and its selected blocks as the mask.
Rows: the G query heads of position t of one KV head are rows t*G + g; a program owns `block_rows`
consecutive rows and loads each K/V tile once for all of them (G = 6 needs no padding to 16), gathered
straight from q[B, T*H, D] (no transpose); rows past T*G repeat the last valid row and are masked out.
Loop bounds follow from the layout: a program visits only the tiles it can see. With `q_offset`
(pallas_common, "Query offset") row r stands at position r + q_offset over Tk keys; dK/dV covers all Tk
keys, zeros for one no row sees. Block mask (`idx` [B, T, K, n], `select_block` = lp): row t*G + g also
needs key i's block i // lp among query t's blocks; key tiles are at most lp keys, and a tile no valid row
selected is skipped (`lax.cond`, no load). `FlashBlockSizes.dkv_splits` = S > 1 cuts each key tile's walk
over the row tiles into S programs, whose fp32 partial dK/dV [S, B, Tk, K, D] are added in run order.
Why a flash kernel for the window, and the kernels in detail: docs/DESIGN_NOTES.md.
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


@dataclasses.dataclass(frozen=True)
class FlashBlockSizes:
    """Tiling knobs of the flash kernels (powers of two >= 16).

    A tile left None starts at 64 and is halved (the larger tile of the kernel
    first) while the kernel's tiles exceed the shared-memory budget of an A100
    (``pallas_common.SMEM_BUDGET_BYTES``); tiles given explicitly must fit it.

    Attributes:
      block_rows: flattened (query, head) rows per forward / dQ program.
      block_keys: keys per inner step of the forward / dQ loop.
      block_keys_dkv: keys per dK/dV program.
      block_rows_dkv: flattened rows per inner step of the dK/dV loop.
      dkv_splits: dK/dV programs per key tile. The row tiles a key tile can see
        are cut into this many equal runs, one program each, whose fp32 partial
        dK/dV are summed in a fixed order afterwards. The flattened rows are G
        times the positions, so one program per key tile walks up to G times
        more steps than the longest forward program, in B*K*T/block_keys_dkv
        programs (64 at T = 2048, K = 2): too few to fill a GPU at short T.
        None: 1 for layout-only calls (window, compressed), G for a block mask
        (the selection branch at short T), which restores the B*H*T/C programs
        of a per-head flash backward.
      num_warps: Triton warps per program (None: pick from the head dim).
      num_stages: Triton software-pipelining depth.
    """

    block_rows: int | None = None
    block_keys: int | None = None
    block_keys_dkv: int | None = None
    block_rows_dkv: int | None = None
    dkv_splits: int | None = None
    num_warps: int | None = None
    num_stages: int = 2


_TILES = ("block_rows", "block_keys", "block_keys_dkv", "block_rows_dkv")
_DEFAULT_TILE = 64


def smem_estimates(bsz: FlashBlockSizes, dk: int, dv: int, itemsize: int) -> dict[str, int]:
    """Shared-memory estimate (bytes) of each flash kernel (``pallas_common.smem_estimate``); tiles resolved."""
    dk, dv = pc.padded_dim(dk), pc.padded_dim(dv)
    r, c = bsz.block_rows, bsz.block_keys
    rd, cd = bsz.block_rows_dkv, bsz.block_keys_dkv
    est = functools.partial(pc.smem_estimate, num_stages=bsz.num_stages, itemsize=itemsize)
    return {
        "flash fwd": est(once=[r * dk], looped=[c * dk, c * dv], staged=[r * c]),
        "flash dq": est(once=[r * dk, r * dv], looped=[c * dk, c * dv], staged=[r * c]),
        "flash dkv": est(once=[cd * dk, cd * dv], looped=[rd * dk, rd * dv], staged=[rd * cd, rd * cd]),
    }


def fit_block_sizes(
    bsz: FlashBlockSizes, dk: int, dv: int, itemsize: int, max_keys: int | None = None
) -> FlashBlockSizes:
    """``bsz`` with every None tile chosen; raises when the tiles exceed the A100 budget.

    ``max_keys``: a cap on the chosen key tiles (the selection block lp of a block-masked call).
    """
    auto = [name for name in _TILES if getattr(bsz, name) is None]
    key_tile = _DEFAULT_TILE if max_keys is None else min(_DEFAULT_TILE, max_keys)
    bsz = dataclasses.replace(bsz, **{name: key_tile if "keys" in name else _DEFAULT_TILE for name in auto})
    # Shrink the chosen tiles of the kernel over budget, larger tile first (keys on a tie).
    pairs = {"flash fwd": ("block_keys", "block_rows"), "flash dq": ("block_keys", "block_rows")}
    pairs["flash dkv"] = ("block_rows_dkv", "block_keys_dkv")
    while True:
        est = smem_estimates(bsz, dk, dv, itemsize)
        kernel = max(est, key=est.get)
        if est[kernel] <= pc.SMEM_BUDGET_BYTES:
            break
        shrinkable = [n for n in pairs[kernel] if n in auto and getattr(bsz, n) > pc.MIN_DOT_DIM]
        if not shrinkable:
            break
        name = max(shrinkable, key=lambda n: getattr(bsz, n))
        bsz = dataclasses.replace(bsz, **{name: getattr(bsz, name) // 2})
    pc.check_smem(smem_estimates(bsz, dk, dv, itemsize), "block_rows / block_keys (FlashBlockSizes), num_stages")
    return bsz


def _gather_rows(f_R, kv, *, seq, num_heads, group):
    """Positions, validity and ``q[T*H]`` rows of flattened rows ``f``."""
    valid_R = f_R < seq * group
    f_c = jnp.minimum(f_R, seq * group - 1)
    t_R = lax.div(f_c, group)
    row_R = t_R * num_heads + kv * group + lax.rem(f_c, group)
    return t_R, valid_R, row_R


def _key_tile_range(f0, rows, *, seq, group, lay: pc.KeyLayout, block_keys, num_tiles, q_offset):
    """Key tiles [lo, hi) that rows [f0, f0 + rows) can see (lo >= hi: none); row t*G + g stands at t + q_offset."""
    t_first = pc.shift(lax.div(f0, group), q_offset)
    t_last = pc.shift(jnp.minimum(lax.div(f0 + rows - 1, group), seq - 1), q_offset)
    # First key at or after position t_first - window + 1; one past the last at or before t_last.
    # Numerators are clamped at 0 first: lax.div truncates toward zero.
    i_lo = lax.div(jnp.maximum(t_first - lay.window + 1 - lay.offset, 0) + lay.stride - 1, lay.stride)
    i_hi = jnp.minimum(lax.div(jnp.maximum(t_last - lay.offset + lay.stride, 0), lay.stride), lay.num_keys)
    lo = lax.div(i_lo, block_keys)
    hi = jnp.minimum(lax.div(i_hi + block_keys - 1, block_keys), num_tiles)
    return lo, hi


def _rows_before(pos, q_offset, seq):
    """Query rows at positions before ``pos`` (>= 0): ``pos - q_offset`` clipped to [0, seq]."""
    if pc.is_static_zero(q_offset):
        return jnp.minimum(pos, seq)
    return jnp.clip(pos - q_offset, 0, seq)


def _row_tile_range(start, *, seq, group, lay: pc.KeyLayout, block_keys, block_rows, q_offset):
    """Row tiles [lo, hi) holding a query that sees a key of the tile [start, start + block_keys)."""
    last = jnp.minimum(start + block_keys, lay.num_keys) - 1
    pos_first = start * lay.stride + lay.offset
    pos_last = last * lay.stride + lay.offset
    # Queries at positions [pos_first, pos_last + window - 1]: the rows there (clipped to q's rows).
    t_end = _rows_before(pos_last + lay.window, q_offset, seq)
    lo = lax.div(_rows_before(pos_first, q_offset, seq) * group, block_rows)
    hi = lax.div(t_end * group + block_rows - 1, block_rows)
    return lo, hi


def _split_refs(refs, has_offset, select_block):
    """(query offset, idx_ref or None, the other refs): an offset call passes its offset [1] first,
    a block-masked call the block ids [T, Np] next."""
    q_offset, refs = pc.split_offset(refs, has_offset)
    return (q_offset, refs[0], refs[1:]) if select_block else (q_offset, None, refs)


def _rows_selecting(idx_RxN, blk):
    """[R] bool: the row's query selected block ``blk`` (any slot equal; -1 never is)."""
    # A sum of 0/1, not jnp.any: a boolean reduction has no Triton lowering.
    return jnp.sum(jnp.where(idx_RxN == blk, 1, 0), axis=1) > 0


def _any_row(x_R):
    return jnp.sum(jnp.where(x_R, 1, 0)) > 0


def _tile_selection(idx_RxN, start, t_R, valid_R, select_block, q_offset):
    """(sel_R, live) of the key tile at ``start`` for a block-masked call, (None, None) otherwise.

    ``sel_R``: the row's query selected the tile's block (a key tile lies in one
    block: its size divides ``select_block``); ``live``: some valid row selected
    it and the block has begun by that row's position ``t_R + q_offset``, so the tile is loaded.
    """
    if idx_RxN is None:
        return None, None
    sel_R = _rows_selecting(idx_RxN, lax.div(start, select_block))
    return sel_R, _any_row(sel_R & valid_R & (t_R >= pc.shift(start, -q_offset)))


def _visible(t_R, valid_R, i_C, lay: pc.KeyLayout, sel_R, q_offset):
    vis_RxC = pc.layout_visible(t_R, valid_R, i_C, lay, q_offset)
    return vis_RxC if sel_R is None else vis_RxC & sel_R[:, None]


def _maybe(live, step, carry):
    """``step(carry)``, or under ``lax.cond`` when ``live`` says whether the tile is needed at all."""
    return step(carry) if live is None else lax.cond(live, step, lambda c: c, carry)


def _win_kernel(
    *refs,
    has_offset,
    backward,
    seq,
    num_heads,
    group,
    lay,
    block_rows,
    block_keys,
    num_key_tiles,
    scale,
    scale_log2,
    select_block,
    stats_only=False,
):
    # Refs: [q_offset [1],] [idx [T, Np],] q [T*H, Dk], k [Tk, Dk], v [Tk, Dv] (not with stats_only), then
    #   forward: o [R, Dv], lse [R]; stats_only: lse [R]; dQ: do [T*H, Dv], lse / delta [R], dq [R, Dk].
    q_offset, idx_ref, (q_ref, k_ref, *rest) = _split_refs(refs, has_offset, select_block)
    v_ref = None if stats_only else rest.pop(0)
    f0 = pl.program_id(0) * block_rows
    kv = pl.program_id(2)
    dims = dict(seq=seq, num_heads=num_heads, group=group)
    t_R, valid_R, row_R = _gather_rows(f0 + lax.iota(jnp.int32, block_rows), kv, **dims)
    rows = pc.RowPass(backward, q_ref, rest, row_R, scale=scale, scale_log2=scale_log2, stats_only=stats_only)
    idx_RxN = None if idx_ref is None else idx_ref[t_R, :]

    def body(kt, carry):
        start = kt * block_keys
        sel_R, live = _tile_selection(idx_RxN, start, t_R, valid_R, select_block, q_offset)

        def step(carry):
            k_CxDk = k_ref[pl.ds(start, block_keys), :]
            v_CxDv = None if v_ref is None else v_ref[pl.ds(start, block_keys), :]
            vis_RxC = _visible(t_R, valid_R, start + lax.iota(jnp.int32, block_keys), lay, sel_R, q_offset)
            return rows.step(carry, k_CxDk, v_CxDv, vis_RxC)

        return _maybe(live, step, carry)

    tiles = dict(seq=seq, group=group, lay=lay, block_keys=block_keys, num_tiles=num_key_tiles, q_offset=q_offset)
    lo, hi = _key_tile_range(f0, block_rows, **tiles)
    rows.finish(lax.fori_loop(lo, hi, body, rows.init(block_rows)))


def _win_dkv_kernel(
    *refs,
    has_offset,
    seq,
    num_heads,
    group,
    lay,
    block_keys,
    block_rows,
    scale,
    scale_log2,
    select_block,
    splits,
):
    # Refs: [q_offset [1],] [idx [T, Np],] q [T*H, Dk], k [Tk, Dk], v [Tk, Dv], do [T*H, Dv],
    #   lse / delta [Rp], dk [C, Dk], dv [C, Dv] (this split's part when splits > 1).
    q_offset, idx_ref, refs = _split_refs(refs, has_offset, select_block)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref = refs
    start = lax.div(pl.program_id(0), splits) * block_keys
    kv = pl.program_id(2)
    dims = dict(seq=seq, num_heads=num_heads, group=group)
    k_CxDk = k_ref[pl.ds(start, block_keys), :]
    v_CxDv = v_ref[pl.ds(start, block_keys), :]
    i_C = start + lax.iota(jnp.int32, block_keys)

    def body(rt, carry):
        f0 = rt * block_rows
        t_R, valid_R, row_R = _gather_rows(f0 + lax.iota(jnp.int32, block_rows), kv, **dims)
        # The key tile stays and the rows move: the rows are shifted to positions (shifting the keys
        # instead spills in the block-masked kernel on sm_80).
        pos_R = pc.shift(t_R, q_offset)
        # The block mask is recomputed per row tile from the block ids: no reverse index.
        idx_RxN = None if idx_ref is None else idx_ref[t_R, :]
        sel_R, live = _tile_selection(idx_RxN, start, pos_R, valid_R, select_block, q_offset=0)

        def step(carry):
            dk_CxDk, dv_CxDv = carry
            q_RxDk = q_ref[row_R, :]
            do_RxDv = do_ref[row_R, :]
            lse_R = lse_ref[pl.ds(f0, block_rows)]
            delta_R = delta_ref[pl.ds(f0, block_rows)]
            vis_RxC = _visible(pos_R, valid_R, i_C, lay, sel_R, q_offset=0)
            p_RxC, ds_RxC = pc.softmax_grad_tile(q_RxDk, k_CxDk, v_CxDv, do_RxDv, lse_R, delta_R, vis_RxC, scale_log2)
            dv_CxDv = dv_CxDv + plgpu_triton.dot(p_RxC.astype(do_RxDv.dtype), do_RxDv, trans_a=True)
            dk_CxDk = dk_CxDk + plgpu_triton.dot(ds_RxC.astype(q_RxDk.dtype), q_RxDk, trans_a=True)
            return dk_CxDk, dv_CxDv

        return _maybe(live, step, carry)

    lo, hi = _row_tile_range(
        start, seq=seq, group=group, lay=lay, block_keys=block_keys, block_rows=block_rows, q_offset=q_offset
    )
    if splits > 1:  # this program's run of the row tiles
        run = lax.div(jnp.maximum(hi - lo, 0) + splits - 1, splits)
        lo = lo + lax.rem(pl.program_id(0), splits) * run
        hi = jnp.minimum(lo + run, hi)
    init = (
        jnp.zeros((block_keys, k_ref.shape[-1]), jnp.float32),
        jnp.zeros((block_keys, v_ref.shape[-1]), jnp.float32),
    )
    dk_CxDk, dv_CxDv = lax.fori_loop(lo, hi, body, init)
    dk_ref[...] = (dk_CxDk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_CxDv.astype(dv_ref.dtype)


@dataclasses.dataclass(frozen=True)
class _WinDims:
    batch: int
    seq: int
    heads: int
    kv_heads: int
    group: int
    dk: int
    dv: int
    rows_padded: int  # T*G rounded up to every row tile
    keys_padded: int  # Tk rounded up to every key tile


def _win_dims(q, k, v, bsz: FlashBlockSizes) -> _WinDims:
    b, t, h, _ = q.shape
    kvh = k.shape[2]
    g = h // kvh
    row_tile = max(bsz.block_rows, bsz.block_rows_dkv)
    key_tile = max(bsz.block_keys, bsz.block_keys_dkv)
    return _WinDims(
        b,
        t,
        h,
        kvh,
        g,
        pc.padded_dim(q.shape[-1]),
        pc.padded_dim(v.shape[-1]),
        pl.cdiv(t * g, row_tile) * row_tile,
        pl.cdiv(k.shape[1], key_tile) * key_tile,
    )


def _prep(q, k, v, d: _WinDims):
    q_f = pc.pad_axis(q, 3, d.dk).reshape(d.batch, d.seq * d.heads, d.dk)
    k_p = pc.pad_axis(pc.pad_axis(k, 1, d.keys_padded), 3, d.dk)
    v_p = pc.pad_axis(pc.pad_axis(v, 1, d.keys_padded), 3, d.dv)
    return q_f, k_p, v_p


def _ungroup_rows(x_BxKxRpxD, d: _WinDims, d_out: int):
    """[B, K, Rp, D] flattened-row layout -> [B, T, H, d_out]."""
    x = x_BxKxRpxD[:, :, : d.seq * d.group, :d_out]
    x = x.reshape(d.batch, d.kv_heads, d.seq, d.group, d_out)
    return x.transpose(0, 2, 1, 3, 4).reshape(d.batch, d.seq, d.heads, d_out)


def _group_rows_stat(x_BxTxH, d: _WinDims):
    """[B, T, H] per-head statistic -> flattened-row layout [B, K, Rp]."""
    x = x_BxTxH.reshape(d.batch, d.seq, d.kv_heads, d.group)
    x = x.transpose(0, 2, 1, 3).reshape(d.batch, d.kv_heads, d.seq * d.group)
    return pc.pad_axis(x, 2, d.rows_padded)


def _in_specs(d: _WinDims):
    q_spec = pl.BlockSpec((None, d.seq * d.heads, d.dk), lambda i, b, kv: (b, 0, 0))
    k_spec = pl.BlockSpec((None, d.keys_padded, None, d.dk), lambda i, b, kv: (b, 0, kv, 0))
    v_spec = pl.BlockSpec((None, d.keys_padded, None, d.dv), lambda i, b, kv: (b, 0, kv, 0))
    do_spec = pl.BlockSpec((None, d.seq * d.heads, d.dv), lambda i, b, kv: (b, 0, 0))
    return q_spec, k_spec, v_spec, do_spec


def _idx_spec(d: _WinDims, slots: int):
    return pl.BlockSpec((None, d.seq, None, slots), lambda i, b, kv: (b, 0, kv, 0))


def _leading_args(off_1, idx, select_block, d: _WinDims):
    """(arguments, specs) before q: the query offset [1] when there is one (``offset_operand``), then the block
    ids of a block-masked call with slots padded to a power of two with -1 (a Triton tile dimension)."""
    args, specs = list(pc.offset_operands(off_1)), [pc.OFFSET_SPEC] * (off_1 is not None)
    if select_block:
        args.append(pc.pad_axis(idx.astype(jnp.int32), 3, pc.next_pow2(idx.shape[-1]), value=-1))
        specs.append(_idx_spec(d, args[-1].shape[-1]))
    return args, specs


def _banded_forward(
    q, k, v, off_1, idx, lay: pc.KeyLayout, scale, interpret, bsz, name, select_block, stats_only=False
):
    """(o [B, T, H, Dv], lse [B, K, Rp] base 2 in the flattened-row layout); with `stats_only`
    (v is None) the lse alone, from a kernel that never loads a value."""
    v_like = k if stats_only else v  # stats_only: the value operand's shapes are the keys' (never loaded)
    d = _win_dims(q, k, v_like, bsz)
    q_f, k_p, v_p = _prep(q, k, v_like, d)
    q_spec, k_spec, v_spec, _ = _in_specs(d)
    lead_args, lead_specs = _leading_args(off_1, idx, select_block, d)
    r = bsz.block_rows
    kernel = functools.partial(
        _win_kernel,
        has_offset=off_1 is not None,
        backward=False,
        seq=d.seq,
        num_heads=d.heads,
        group=d.group,
        lay=lay,
        block_rows=r,
        block_keys=bsz.block_keys,
        num_key_tiles=d.keys_padded // bsz.block_keys,
        scale=scale,
        scale_log2=scale * pc.LOG2E,
        select_block=select_block,
        stats_only=stats_only,
    )
    lse_spec = pl.BlockSpec((None, None, r), lambda i, b, kv: (b, kv, i))
    lse_shape = jax.ShapeDtypeStruct((d.batch, d.kv_heads, d.rows_padded), jnp.float32)
    o_spec = pl.BlockSpec((None, None, r, d.dv), lambda i, b, kv: (b, kv, i, 0))
    o_shape = jax.ShapeDtypeStruct((d.batch, d.kv_heads, d.rows_padded, d.dv), q.dtype)
    outs = pl.pallas_call(
        kernel,
        grid=(d.rows_padded // r, d.batch, d.kv_heads),
        in_specs=[*lead_specs, q_spec, k_spec, *([] if stats_only else [v_spec])],
        out_specs=[lse_spec] if stats_only else [o_spec, lse_spec],
        out_shape=[lse_shape] if stats_only else [o_shape, lse_shape],
        compiler_params=pc.compiler_params(bsz.num_warps, bsz.num_stages, d.dk),
        interpret=interpret,
        name=f"{name}_lse" if stats_only else f"{name}_fwd",
    )(*lead_args, q_f, k_p, *([] if stats_only else [v_p]))
    if stats_only:
        return outs[0]
    o_rows, lse = outs
    return _ungroup_rows(o_rows, d, v.shape[-1]), lse


def _banded_backward(q, k, v, off_1, idx, o, lse, do, lay: pc.KeyLayout, scale, interpret, bsz, name, select_block):
    d = _win_dims(q, k, v, bsz)
    q_f, k_p, v_p = _prep(q, k, v, d)
    do_f = pc.pad_axis(do, 3, d.dv).reshape(d.batch, d.seq * d.heads, d.dv)
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
    delta = _group_rows_stat(delta, d)
    q_spec, k_spec, v_spec, do_spec = _in_specs(d)
    lead_args, lead_specs = _leading_args(off_1, idx, select_block, d)
    params = pc.compiler_params(bsz.num_warps, bsz.num_stages, d.dk)
    common = dict(
        has_offset=off_1 is not None,
        seq=d.seq,
        num_heads=d.heads,
        group=d.group,
        lay=lay,
        scale=scale,
        scale_log2=scale * pc.LOG2E,
        select_block=select_block,
    )

    r = bsz.block_rows
    stat_spec = pl.BlockSpec((None, None, r), lambda i, b, kv: (b, kv, i))
    dq_rows = pl.pallas_call(
        functools.partial(
            _win_kernel,
            backward=True,
            block_rows=r,
            block_keys=bsz.block_keys,
            num_key_tiles=d.keys_padded // bsz.block_keys,
            **common,
        ),
        grid=(d.rows_padded // r, d.batch, d.kv_heads),
        in_specs=[*lead_specs, q_spec, k_spec, v_spec, do_spec, stat_spec, stat_spec],
        out_specs=pl.BlockSpec((None, None, r, d.dk), lambda i, b, kv: (b, kv, i, 0)),
        out_shape=jax.ShapeDtypeStruct((d.batch, d.kv_heads, d.rows_padded, d.dk), q.dtype),
        compiler_params=params,
        interpret=interpret,
        name=f"{name}_dq",
    )(*lead_args, q_f, k_p, v_p, do_f, lse, delta)
    dq = _ungroup_rows(dq_rows, d, q.shape[-1])

    c = bsz.block_keys_dkv
    splits = bsz.dkv_splits
    full_stat = pl.BlockSpec((None, None, d.rows_padded), lambda i, b, kv: (b, kv, 0))
    if splits == 1:  # written in place, in the input dtype
        out_specs = [
            pl.BlockSpec((None, c, None, d.dk), lambda i, b, kv: (b, i, kv, 0)),
            pl.BlockSpec((None, c, None, d.dv), lambda i, b, kv: (b, i, kv, 0)),
        ]
        out_shape = [
            jax.ShapeDtypeStruct((d.batch, d.keys_padded, d.kv_heads, d.dk), k.dtype),
            jax.ShapeDtypeStruct((d.batch, d.keys_padded, d.kv_heads, d.dv), v.dtype),
        ]
    else:  # fp32 parts [S, B, Tk, K, D]; program i: key tile i // S, split i % S
        out_specs = [
            pl.BlockSpec((None, None, c, None, dim), lambda i, b, kv: (i % splits, b, i // splits, kv, 0))
            for dim in (d.dk, d.dv)
        ]
        out_shape = [
            jax.ShapeDtypeStruct((splits, d.batch, d.keys_padded, d.kv_heads, dim), jnp.float32) for dim in (d.dk, d.dv)
        ]
    dk_p, dv_p = pl.pallas_call(
        functools.partial(_win_dkv_kernel, block_keys=c, block_rows=bsz.block_rows_dkv, splits=splits, **common),
        grid=(d.keys_padded // c * splits, d.batch, d.kv_heads),
        in_specs=[*lead_specs, q_spec, k_spec, v_spec, do_spec, full_stat, full_stat],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=params,
        interpret=interpret,
        name=f"{name}_dkv",
    )(*lead_args, q_f, k_p, v_p, do_f, lse, delta)
    if splits > 1:
        # Elementwise adds in split order: the same sum on every run (no reduction whose order may vary).
        dk_p = functools.reduce(jnp.add, [dk_p[i] for i in range(splits)]).astype(k.dtype)
        dv_p = functools.reduce(jnp.add, [dv_p[i] for i in range(splits)]).astype(v.dtype)
    n_keys = k.shape[1]
    dk = dk_p[:, :n_keys, :, : k.shape[-1]]
    dv = dv_p[:, :n_keys, :, : v.shape[-1]]
    return dq, dk, dv


def banded_attention(
    q,
    k,
    v,
    lay: pc.KeyLayout,
    scale: float,
    interpret: bool,
    bsz: FlashBlockSizes,
    name: str,
    *,
    idx=None,
    select_block: int | None = None,
    q_offset=0,
):
    """(o [B, T, H, Dv], lse [B, K, Rp]) of attention over keys placed by ``lay``.

    Differentiable in q, k, v through o; lse (base 2, flattened-row layout: row
    ``t*G + g``, 0 for a row that sees no key) is a statistic for callers that
    recompute probabilities, and its cotangent is ignored: use it under
    stop_gradient only. ``bsz``'s None tiles are chosen to fit the shared-memory
    budget, and an explicit tiling over it is refused here, at trace time.

    ``q_offset`` (Python int or traced int32 scalar): query row t stands at
    position ``t + q_offset`` in the layout; k has its own length Tk (``lay``
    places its keys), and dk, dv cover all of them. The Python int 0 runs the
    kernels without an offset input.

    Block mask (``select_block`` = lp, with ``idx`` [B, T, K, n] int32): query row t
    of KV head kv also needs key i's block ``i // lp`` among ``idx[b, t, kv]``
    (-1: unused slot), on top of the layout; a key tile no row of the program
    selected is skipped. Key tiles must lie in one block (``block_keys`` and
    ``block_keys_dkv`` at most lp; the default tiles are capped there). No
    gradient flows to ``idx`` or ``q_offset``.
    """
    if (idx is None) != (not select_block):
        raise ValueError("banded_attention: idx and select_block go together")
    check_block_sizes(bsz)
    itemsize = max(jnp.dtype(x.dtype).itemsize for x in (q, k, v))
    bsz = fit_block_sizes(bsz, q.shape[-1], v.shape[-1], itemsize, max_keys=select_block or None)
    if select_block:
        for tile in ("block_keys", "block_keys_dkv"):
            if getattr(bsz, tile) > select_block:
                raise ValueError(
                    f"{tile}={getattr(bsz, tile)} is larger than the selection block lp={select_block}: "
                    "a key tile must lie in one block, so set it to at most lp (or leave it None)"
                )
    if bsz.dkv_splits is None:
        bsz = dataclasses.replace(bsz, dkv_splits=q.shape[2] // k.shape[2] if select_block else 1)
    off_1 = pc.offset_operand(q_offset)
    return _banded(q, k, v, off_1, idx, lay, scale, interpret, bsz, name, select_block or None)


def banded_lse(q, k, lay: pc.KeyLayout, scale: float, interpret: bool, bsz: FlashBlockSizes, name: str, *, q_offset=0):
    """lse [B, K, Rp] of attention over keys placed by ``lay``, as ``banded_attention``
    returns it (base 2, flattened-row layout, 0 for a row that sees no key; row t at
    position ``t + q_offset``), from one kernel ``{name}_lse`` that walks the same key
    tiles and computes only q k^T: no value is loaded and no output written. No gradient
    (a statistic)."""
    check_block_sizes(bsz)
    itemsize = max(jnp.dtype(x.dtype).itemsize for x in (q, k))
    bsz = fit_block_sizes(bsz, q.shape[-1], k.shape[-1], itemsize)
    q, k = lax.stop_gradient(q), lax.stop_gradient(k)  # no tangent reaches the kernel: it has no derivative
    off_1 = pc.offset_operand(q_offset)
    return _stats_forward(q, k, off_1, lay, scale, interpret, bsz, name)


# A jit around the one kernel called outside a custom_vjp. jax < 0.12 never drops an unused
# pallas_call from a jaxpr (its DCE rule keeps every call), so a flax scan's invariance check
# (flax >= 0.12.10 finds it by DCE) saw the lse pass read the layer's inputs and refused to
# init the scanned model; an unused jit is dropped whole (tests/test_model.py).
@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6, 7))
def _stats_forward(q, k, off_1, lay, scale, interpret, bsz, name):
    return _banded_forward(q, k, None, off_1, None, lay, scale, interpret, bsz, name, None, True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10))
def _banded(q, k, v, off_1, idx, lay, scale, interpret, bsz, name, select_block):
    return _banded_forward(q, k, v, off_1, idx, lay, scale, interpret, bsz, name, select_block)


def _banded_vjp_fwd(q, k, v, off_1, idx, lay, scale, interpret, bsz, name, select_block):
    o, lse = _banded_forward(q, k, v, off_1, idx, lay, scale, interpret, bsz, name, select_block)
    return (o, lse), (q, k, v, off_1, idx, o, lse)


def _banded_vjp_bwd(lay, scale, interpret, bsz, name, select_block, res, cts):
    q, k, v, off_1, idx, o, lse = res
    do, _ = cts  # lse is a statistic: see banded_attention
    dq, dk, dv = _banded_backward(q, k, v, off_1, idx, o, lse, do, lay, scale, interpret, bsz, name, select_block)
    # The query offset and idx (ints, or None) take no gradient.
    return dq, dk, dv, None, None


_banded.defvjp(_banded_vjp_fwd, _banded_vjp_bwd)


def check_block_sizes(bsz: FlashBlockSizes) -> None:
    for name in _TILES:
        if getattr(bsz, name) is not None:
            pc.check_tile_size(name, getattr(bsz, name))
    if bsz.dkv_splits is not None and bsz.dkv_splits < 1:
        raise ValueError(f"dkv_splits={bsz.dkv_splits} must be >= 1 (or None)")


def window_attention_pallas(
    q_BxTxHxDk,
    k_BxTxKxDk,
    v_BxTxKxDv,
    window: int,
    scale: float | None = None,
    *,
    interpret: bool = False,
    block_sizes=None,
    q_offset=0,
):
    """Sliding-window attention (fused Pallas/Triton forward and backward).

    Query t of head h attends to positions [max(0, t - window + 1), t] of KV
    head h // G. Softmax in fp32; the output has q's dtype.

    Args:
      q_BxTxHxDk: window-branch queries, Tq rows: row r is the query at position r + q_offset.
      k_BxTxKxDk, v_BxTxKxDv: window-branch keys and values, Tk >= Tq rows: key i at position i.
      window: w >= 1 (w >= Tk gives full causal attention).
      scale: softmax scale, default Dk**-0.5.
      interpret: run the kernels in the Pallas interpreter (CPU tests).
      block_sizes: optional ``FlashBlockSizes``.
      q_offset: position of q's first row, a Python int or a traced int32 scalar (0: queries and keys
        start together); the caller keeps q_offset + Tq <= Tk. The gradients of k and v cover all Tk keys.
    """
    pc.validate_qkv(q_BxTxHxDk, k_BxTxKxDk, v_BxTxKxDv, same_length=False)
    pc.check_query_offset(q_offset, q_BxTxHxDk.shape[1], k_BxTxKxDk.shape[1])
    if window < 1:
        raise ValueError(f"window={window} must be >= 1")
    bsz = FlashBlockSizes() if block_sizes is None else block_sizes
    dk = q_BxTxHxDk.shape[-1]
    scale = float(dk**-0.5 if scale is None else scale)
    # A window longer than the keys is full causal attention; clamping
    # keeps the static loop bounds small.
    tk = k_BxTxKxDk.shape[1]
    lay = pc.KeyLayout(num_keys=tk, window=int(min(window, tk)))
    o, _ = banded_attention(
        q_BxTxHxDk, k_BxTxKxDk, v_BxTxKxDv, lay, scale, bool(interpret), bsz, "nsa_window", q_offset=q_offset
    )
    return o
