"""Pallas (Triton backend) kernels for the NSA compressed branch.

This module owns ``compressed_attention_pallas``: attention of every query over
the compressed tokens (token ``i`` summarises raw tokens ``[i*d, i*d + l)`` and
is visible to query ``t`` iff ``i*d + l - 1 <= t``; docs "Compressed branch"),
and the group probabilities the selection branch ranks blocks by.

Why a kernel
------------
In plain XLA the branch materialises fp32 probabilities ``[T, H, T/d]`` and
passes over them several times (mask, softmax, the PV product, the group sum,
the block sums, and all of it again in the rematerialised backward). On a GPU
that is memory-bound and, at long T, most of an NSA layer's time. Here:

* the attention itself is the flash kernels
  (``flash_pallas.banded_attention``) with the key layout ``stride=d,
  offset=l-1`` and no window: online softmax, no score matrix, fp32
  log-sum-exp kept for the backward and for the probabilities below;
* ``_cmp_probs_kernel`` recomputes the scores once more and writes only what
  selection needs: ``p`` summed over the G heads of each KV group
  (``[B, K, T, Tc]`` fp32, a G-th of the per-head matrix), normalised with
  the forward's log-sum-exp. Each program owns ``block_pos`` positions and
  walks every key tile, writing zeros where nothing is visible, so every
  element of the output is written. The block sums and top-n stay in XLA
  (``nsa.selection``), on this G-times smaller tensor.

The layer no longer uses ``_cmp_probs_kernel``: ``block_scores_pallas`` scores
blocks (and selects them) from the same log-sum-exp without that tensor.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from nsa_jax.kernels.flash_pallas import FlashBlockSizes, banded_attention, check_block_sizes
from nsa_jax.kernels.pallas_common import (
    LOG2E,
    KeyLayout,
    check_tile_size,
    compiler_params,
    layout_visible,
    pad_axis,
    padded_dim,
    scores_log2,
    validate_qkv,
)


@dataclasses.dataclass(frozen=True)
class CompressedBlockSizes:
    """Tiling knobs (powers of two >= 16).

    Attributes:
      attention: the flash kernels' tiles (``FlashBlockSizes``).
      block_pos: query positions per program of the probability kernel.
      block_keys: compressed tokens per inner step of the probability kernel.
    """

    attention: FlashBlockSizes = FlashBlockSizes()
    block_pos: int = 32
    block_keys: int = 64


def cmp_layout(num_compressed: int, seq: int, l: int, d: int) -> KeyLayout:
    """Compressed token i stands at its last raw position i*d + l - 1; no window."""
    return KeyLayout(num_keys=num_compressed, window=seq + l + d * num_compressed, stride=d, offset=l - 1)


def _cmp_probs_kernel(
    q_ref, k_ref, lse_ref, p_ref, *, seq, num_heads, group, lay, block_pos, block_keys, num_key_tiles, scale_log2
):
    # Refs: q [T*H, Dk], k [Tkp, Dk], lse [Rp] (row t*G + g, base 2), p [P, Tkp].
    t_P = pl.program_id(0) * block_pos + lax.iota(jnp.int32, block_pos)
    kv = pl.program_id(2)
    valid_P = t_P < seq
    t_c = jnp.minimum(t_P, seq - 1)

    def body(kt, carry):
        start = kt * block_keys
        k_CxDk = k_ref[pl.ds(start, block_keys), :]
        vis_PxC = layout_visible(t_c, valid_P, start + lax.iota(jnp.int32, block_keys), lay)
        p_PxC = jnp.zeros((block_pos, block_keys), jnp.float32)
        for g in range(group):  # static: the G heads that share this KV head's selection
            q_PxDk = q_ref[t_c * num_heads + kv * group + g, :]
            lse_P = lse_ref[t_c * group + g]
            s_PxC = scores_log2(q_PxDk, k_CxDk, scale_log2)
            p_PxC = p_PxC + jnp.where(vis_PxC, jnp.exp2(s_PxC - lse_P[:, None]), 0.0)
        p_ref[:, pl.ds(start, block_keys)] = p_PxC
        return carry

    lax.fori_loop(0, num_key_tiles, body, 0)


# A bare pallas_call is never removed as dead code (jax keeps every kernel launch), but a
# custom_vjp call whose outputs are unused is. The probabilities go through one so that
# a model without the selection branch, or a trace that only needs the parameters
# (flax's scan checks its loop invariants that way), does not launch the kernel.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _group_probs(q, kc, lse, lay: KeyLayout, scale, interpret, bsz: CompressedBlockSizes, rows_padded: int):
    """[B, K, T, Tc] fp32: softmax probabilities of the compressed branch summed over each group's heads."""
    return _group_probs_kernel(q, kc, lse, lay, scale, interpret, bsz, rows_padded)


def _group_probs_fwd(q, kc, lse, lay, scale, interpret, bsz, rows_padded):
    return _group_probs_kernel(q, kc, lse, lay, scale, interpret, bsz, rows_padded), (q, kc, lse)


def _group_probs_bwd(lay, scale, interpret, bsz, rows_padded, res, ct):
    del lay, scale, interpret, bsz, rows_padded, ct
    return tuple(jnp.zeros_like(x) for x in res)  # selection scores carry no gradient


_group_probs.defvjp(_group_probs_fwd, _group_probs_bwd)


def _group_probs_kernel(q, kc, lse, lay: KeyLayout, scale, interpret, bsz: CompressedBlockSizes, rows_padded: int):
    b, t, h, _ = q.shape
    tc, kvh = kc.shape[1], kc.shape[2]
    group = h // kvh
    dk = padded_dim(q.shape[-1])
    p_pos, c = bsz.block_pos, bsz.block_keys
    tp = pl.cdiv(t, p_pos) * p_pos
    tkp = pl.cdiv(tc, c) * c
    q_f = pad_axis(q, 3, dk).reshape(b, t * h, dk)
    k_p = pad_axis(pad_axis(kc, 1, tkp), 3, dk)
    kernel = functools.partial(
        _cmp_probs_kernel,
        seq=t,
        num_heads=h,
        group=group,
        lay=lay,
        block_pos=p_pos,
        block_keys=c,
        num_key_tiles=tkp // c,
        scale_log2=scale * LOG2E,
    )
    p = pl.pallas_call(
        kernel,
        grid=(tp // p_pos, b, kvh),
        in_specs=[
            pl.BlockSpec((None, t * h, dk), lambda i, bb, kv: (bb, 0, 0)),
            pl.BlockSpec((None, tkp, None, dk), lambda i, bb, kv: (bb, 0, kv, 0)),
            pl.BlockSpec((None, None, rows_padded), lambda i, bb, kv: (bb, kv, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, p_pos, tkp), lambda i, bb, kv: (bb, kv, i, 0)),
        out_shape=jax.ShapeDtypeStruct((b, kvh, tp, tkp), jnp.float32),
        compiler_params=compiler_params(bsz.attention.num_warps, bsz.attention.num_stages, dk),
        interpret=interpret,
        name="nsa_cmp_probs",
    )(q_f, k_p, lse)
    return p[:, :, :t, :tc]


def compressed_attention_pallas(
    q_BxTxHxDk,
    kc_BxTcxKxDk,
    vc_BxTcxKxDv,
    *,
    l: int,
    d: int,
    scale: float | None = None,
    interpret: bool = False,
    block_sizes: CompressedBlockSizes | None = None,
):
    """Compressed-branch attention and its group probabilities (fused Pallas/Triton kernels).

    Args:
      q_BxTxHxDk: queries; H = K*G, query head h reads KV head h // G.
      kc_BxTcxKxDk, vc_BxTcxKxDv: compressed keys and values; token i covers
        raw positions [i*d, i*d + l) and is visible to queries t >= i*d + l - 1.
      l, d: compression block length and stride.
      scale: softmax scale, default Dk**-0.5.
      interpret: run the kernels in the Pallas interpreter (CPU tests).
      block_sizes: optional ``CompressedBlockSizes``.

    Returns:
      o_BxTxHxDv in q's dtype (0 for a query that sees no token; differentiable
      in q, kc, vc) and p_BxKxTxTc, the fp32 probabilities summed over the G
      heads of each group (no gradient), from which selection scores blocks.
    """
    validate_qkv(q_BxTxHxDk, kc_BxTcxKxDk, vc_BxTcxKxDv, same_length=False)
    t, dk = q_BxTxHxDk.shape[1], q_BxTxHxDk.shape[3]
    if l < 1 or d < 1:
        raise ValueError(f"l={l} and d={d} must be >= 1")
    bsz = CompressedBlockSizes() if block_sizes is None else block_sizes
    check_block_sizes(bsz.attention)
    check_tile_size("block_pos", bsz.block_pos)
    check_tile_size("block_keys", bsz.block_keys)
    scale = float(dk**-0.5 if scale is None else scale)
    lay = cmp_layout(kc_BxTcxKxDk.shape[1], t, l, d)
    o, lse = banded_attention(
        q_BxTxHxDk, kc_BxTcxKxDk, vc_BxTcxKxDv, lay, scale, bool(interpret), bsz.attention, "nsa_cmp"
    )
    # lse rows are t*G + g, padded to the flash kernels' row tiles.
    sg = lax.stop_gradient
    p = _group_probs(sg(q_BxTxHxDk), sg(kc_BxTcxKxDk), sg(lse), lay, scale, bool(interpret), bsz, lse.shape[-1])
    return o, p
