"""Pallas (Triton backend) block-sparse flash kernels for the NSA selection branch at short T.

Owns `selection_attention_blocksparse_pallas`, the short-sequence path of the selection branch, and the
rule that picks it (`prefers_blocksparse`: T <= BLOCKSPARSE_MAX_SEQ_RATIO * n * lp; longer T keeps the
gather kernel, selection_pallas). Same contract as selection_pallas (docs/NSA.md, "Selection and window
attention"): query t of head h attends to every position p <= t inside the blocks idx[b, t, h // G, :]
(block j covers [j*lp, (j+1)*lp), -1 an unused slot); fp32 softmax, output in q's dtype, 0 for a row that
sees no key.

The selection is a block mask on flash_pallas's engine (`banded_attention` with `idx` and `select_block=lp`,
causal key layout) under `jax.custom_vjp`, the forward's log-sum-exp saved. Forward and dQ: a program holds
a tile of rows t*G + g and walks the causal key tiles (at most lp keys, so each lies in one block); a row
sees a tile iff its query selected the block, and a tile no row selected is skipped (`lax.cond`, no load).
dK/dV: a program holds a key tile and walks the row tiles, recomputing the mask from idx: no reverse index,
no atomics, deterministic; each key tile's rows are cut into G runs (`FlashBlockSizes.dkv_splits`) whose
fp32 parts are summed in a fixed order. Under a query offset q holds a chunk of the queries, k and v all
the keys. None tiles start at 64 and shrink to the A100 budget (`SMEM_BUDGET_BYTES`); an explicit tiling
over it, or a key tile larger than lp, is refused at trace time. Why a second selection kernel:
docs/DESIGN_NOTES.md.
"""

from __future__ import annotations

import jax.numpy as jnp

from nsa_jax.kernels.flash_pallas import FlashBlockSizes, banded_attention
from nsa_jax.kernels.pallas_common import KeyLayout, check_tile_size, validate_selection

# The block-sparse path runs when T <= BLOCKSPARSE_MAX_SEQ_RATIO * n * lp: the
# selected keys (n * lp per query) are then at least half of the longest causal
# prefix, so walking the causal key tiles under a mask costs about what the
# gather kernel reads, in full-height matmuls and without a reverse index.
BLOCKSPARSE_MAX_SEQ_RATIO = 2


def prefers_blocksparse(seq: int, slots: int, block_size: int) -> bool:
    """Whether a selection of ``slots`` blocks of ``block_size`` over ``seq`` positions takes the block-sparse path."""
    return seq <= BLOCKSPARSE_MAX_SEQ_RATIO * slots * block_size


def selection_attention_blocksparse_pallas(
    q_BxTxHxDk, k_BxTxKxDk, v_BxTxKxDv, idx_BxTxKxN, block_size: int, scale: float | None = None, *,
    interpret: bool = False, block_sizes: FlashBlockSizes | None = None, q_offset=0,
):  # fmt: skip
    """NSA selection attention as a block-masked causal flash attention (fused Pallas/Triton forward and backward).

    Args and result as `selection_attention_pallas` (kernels/selection_pallas.py), but: ids outside the
    sequence's blocks see nothing, and `block_sizes` is an optional ``FlashBlockSizes`` (key tiles at most lp).
    """
    validate_selection(q_BxTxHxDk, k_BxTxKxDk, v_BxTxKxDv, idx_BxTxKxN, q_offset)
    dk, tk = q_BxTxHxDk.shape[-1], k_BxTxKxDk.shape[1]
    check_tile_size("block_size", block_size)
    bsz = FlashBlockSizes() if block_sizes is None else block_sizes
    scale = float(dk**-0.5 if scale is None else scale)
    lay = KeyLayout(num_keys=tk, window=tk)  # causal; the block mask does the rest
    idx = idx_BxTxKxN.astype(jnp.int32)
    o, _ = banded_attention(
        q_BxTxHxDk, k_BxTxKxDk, v_BxTxKxDv, lay, scale, bool(interpret), bsz, "nsa_selection_bsp", idx=idx,
        select_block=int(block_size), q_offset=q_offset,
    )  # fmt: skip
    return o
