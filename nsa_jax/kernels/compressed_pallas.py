"""Pallas (Triton backend) kernels for the NSA compressed branch.

Owns `compressed_attention_pallas`: attention of every query over the compressed tokens (token i
summarises raw tokens [i*d, i*d + l) and is visible to query t iff i*d + l - 1 <= t; docs/NSA.md,
"Compressed branch"); `compressed_attention_lse_pallas`, the same attention with the forward's log-sum-exp,
from which `block_scores_pallas` scores and selects blocks; and `compressed_lse_pallas`, that log-sum-exp
alone (one kernel computing q k^T only), for when the attention itself runs elsewhere (kernels/cudnn.py).

The attention is flash_pallas's `banded_attention` with the key layout `stride=d, offset=l-1` and no
window: online softmax, no score matrix, fp32 log-sum-exp kept for the backward. Every entry point takes
`q_offset` (pallas_common, "Query offset"): query row r stands at position r + q_offset and sees token i
iff i*d + l - 1 <= r + q_offset; kc and vc hold the tokens of the whole sequence, and the gradients of kc
and vc cover all of them. Why a kernel rather than XLA: docs/DESIGN_NOTES.md.
"""

from __future__ import annotations

import dataclasses

from jax import lax

from nsa_jax.kernels.flash_pallas import FlashBlockSizes, banded_attention, banded_lse, check_block_sizes
from nsa_jax.kernels.pallas_common import (
    KeyLayout,
    check_query_offset,
    is_static_zero,
    validate_qkv,
)

# The compressed layout's window under a query offset: wider than any two positions are apart (the queries'
# positions are no longer bounded by q's length), and small enough that t - window and a position + window
# stay inside int32 for positions below 2**30.
NO_WINDOW = 1 << 30


@dataclasses.dataclass(frozen=True)
class CompressedBlockSizes:
    """Tiling knobs (powers of two >= 16).

    Attributes:
      attention: the flash kernels' tiles (``FlashBlockSizes``). Three pipeline stages: on an
        H200 the branch's fwd+bwd took 4.22 / 9.97 ms at 32k / 64k against two stages' 5.52 /
        12.95 (docs/PERFORMANCE.md); the window's kernels keep two (no gain there).
    """

    attention: FlashBlockSizes = FlashBlockSizes(num_stages=3)


def cmp_layout(num_compressed: int, seq: int, l: int, d: int, q_offset=0) -> KeyLayout:
    """Compressed token i stands at its last raw position i*d + l - 1; no window (queries at positions 0..seq-1,
    or anywhere under a query offset other than the Python int 0)."""
    window = seq + l + d * num_compressed if is_static_zero(q_offset) else NO_WINDOW
    return KeyLayout(num_keys=num_compressed, window=window, stride=d, offset=l - 1)


def _checked(q, kc, vc, l: int, d: int, scale, block_sizes, q_offset):
    """(block sizes, scale as a float, key layout) of a compressed-branch call, its arguments checked."""
    validate_qkv(q, kc, vc, same_length=False)
    if l < 1 or d < 1:
        raise ValueError(f"l={l} and d={d} must be >= 1")
    check_query_offset(q_offset, q.shape[1])
    bsz = CompressedBlockSizes() if block_sizes is None else block_sizes
    check_block_sizes(bsz.attention)
    scale = float(q.shape[3] ** -0.5 if scale is None else scale)
    return bsz, scale, cmp_layout(kc.shape[1], q.shape[1], l, d, q_offset)


def compressed_attention_lse_pallas(
    q_BxTxHxDk, kc_BxTcxKxDk, vc_BxTcxKxDv, *, l: int, d: int, scale: float | None = None, interpret: bool = False,
    block_sizes: CompressedBlockSizes | None = None, q_offset=0,
):  # fmt: skip
    """Compressed-branch attention and the forward's log-sum-exp (fused Pallas/Triton kernels).

    Args:
      q_BxTxHxDk: queries; H = K*G, query head h reads KV head h // G; row r
        is the query at position t = r + q_offset.
      kc_BxTcxKxDk, vc_BxTcxKxDv: compressed keys and values; token i covers
        raw positions [i*d, i*d + l) and is visible to queries t >= i*d + l - 1.
      l, d: compression block length and stride.
      scale: softmax scale, default Dk**-0.5.
      interpret: run the kernels in the Pallas interpreter (CPU tests).
      block_sizes: optional ``CompressedBlockSizes``.
      q_offset: position of q's first row, a Python int or a traced int32 scalar.

    Returns:
      (o_BxTxHxDv, lse_BxKxRp, scale): o in q's dtype (0 for a query that sees no
      token; differentiable in q, kc, vc); lse fp32 base 2 without gradient, row
      t*G + g for query t and head g of the group, padded to the flash kernels'
      row tiles (rows past T*G are padding); the scale used, as a float.
    """
    bsz, scale, lay = _checked(q_BxTxHxDk, kc_BxTcxKxDk, vc_BxTcxKxDv, l, d, scale, block_sizes, q_offset)
    o, lse = banded_attention(
        q_BxTxHxDk, kc_BxTcxKxDk, vc_BxTcxKxDv, lay, scale, bool(interpret), bsz.attention, "nsa_cmp", q_offset=q_offset
    )
    return o, lax.stop_gradient(lse), scale


def compressed_attention_pallas(
    q_BxTxHxDk, kc_BxTcxKxDk, vc_BxTcxKxDv, *, l: int, d: int, scale: float | None = None, interpret: bool = False,
    block_sizes: CompressedBlockSizes | None = None, q_offset=0,
):  # fmt: skip
    """o_BxTxHxDv of the compressed branch: compressed_attention_lse_pallas without the log-sum-exp."""
    kw = dict(l=l, d=d, scale=scale, interpret=interpret, block_sizes=block_sizes, q_offset=q_offset)
    return compressed_attention_lse_pallas(q_BxTxHxDk, kc_BxTcxKxDk, vc_BxTcxKxDv, **kw)[0]


def compressed_lse_pallas(
    q_BxTxHxDk, kc_BxTcxKxDk, *, l: int, d: int, scale: float | None = None, interpret: bool = False,
    block_sizes: CompressedBlockSizes | None = None, q_offset=0,
):  # fmt: skip
    """(lse_BxKxRp, scale): compressed_attention_lse_pallas's log-sum-exp without the attention.

    One Pallas kernel (``nsa_cmp_lse``) walks the same key tiles as the forward and
    computes q k^T only, about half the forward's matmul work; no value is read.
    """
    bsz, scale, lay = _checked(q_BxTxHxDk, kc_BxTcxKxDk, kc_BxTcxKxDk, l, d, scale, block_sizes, q_offset)
    lse = banded_lse(q_BxTxHxDk, kc_BxTcxKxDk, lay, scale, bool(interpret), bsz.attention, "nsa_cmp", q_offset=q_offset)
    return lse, scale
