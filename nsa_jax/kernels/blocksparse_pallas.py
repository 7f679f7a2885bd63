"""Pallas (Triton backend) block-sparse flash kernels for the NSA selection branch at short T.

This module owns ``selection_attention_blocksparse_pallas``, the short-sequence
path of the selection branch, and the rule that picks it
(``prefers_blocksparse``, threshold ``BLOCKSPARSE_MAX_SEQ_RATIO``). Same
contract as ``selection_pallas`` (docs "Selection branch"): query ``t`` of head
``h`` attends to every position ``p <= t`` inside the blocks
``idx[b, t, h // G, :]`` (block ``j`` covers ``[j*lp, (j+1)*lp)``, ``-1`` an
unused slot); fp32 softmax, output in q's dtype, 0 for a row that sees no key.

Why a second selection kernel
-----------------------------
The gather kernel (``selection_pallas``) serves one query position per
program and loads that query's n blocks: cost ``T * n * lp`` key reads, in
16-row matmuls, plus a reverse index for dK/dV. At long T that is far below
dense attention's ``T^2 / 2``. At short T it is not: at ``T = 2 n lp``
(T = 2048, n = 16, lp = 64 in production) the ``n lp`` keys it loads per
query are as many as a dense causal attention reads on average (``T / 2``),
a query's visible selected keys are 0.73 of its causal prefix (summed over
t, with every candidate selected while fewer than n exist), and the gather
kernel's per-query loads, thin matmuls and reverse index made the branch
slower than a dense flash attention.

Here the selection is a block mask on the flash engine of ``flash_pallas``
(``banded_attention`` with ``idx`` and ``select_block=lp``; full causal key
layout), the engine the window and compressed branches use:

* forward and dQ: a program holds a tile of flattened rows ``t*G + g`` (all G
  heads of a run of positions, which share the selection) and walks the key
  tiles up to its causal end; row r sees a key tile iff its query selected the
  tile's block (any slot equal; key tiles are at most lp keys, so a tile lies
  in one block), on top of causality; a tile that no row of the program
  selected is skipped (``lax.cond``, no load). The cost is at most a dense
  causal flash attention's, with full-height matmuls.
* dK/dV: a program holds a key tile and walks the row tiles from its first
  position on, recomputing each row's mask from ``idx`` and skipping row tiles
  that did not select the block: no reverse index, no atomics, deterministic.
  The flattened rows are G times the positions, so by default each key tile's
  rows are cut into G runs, one program each (``FlashBlockSizes.dkv_splits``),
  whose fp32 partial dK/dV are summed in a fixed order: B*H*T/C programs, as
  many as a per-head flash backward, instead of B*K*T/C (64 at T = 2048, K = 2,
  C = 64, with block 0's program walking all T*G rows).
* ``jax.custom_vjp`` with the forward's log-sum-exp saved for the backward.

Under a query offset (flash_pallas, "Query offset") q holds a chunk of the
sequence's queries and k, v all of its keys: the layout is causal over the
Tk keys and each row's position is its row plus the offset.

Long sequences keep the gather kernel: there the block mask would still walk
every causal key tile (a skipped tile costs a branch, not a load), while the
gather kernel's work grows with ``T n lp``. ``kernels.selection_attention``
picks this path for ``T <= BLOCKSPARSE_MAX_SEQ_RATIO * n * lp``.

Tiles are ``FlashBlockSizes``; None tiles start at 64 (key tiles at most lp)
and shrink to the A100 shared-memory budget (``pallas_common.SMEM_BUDGET_BYTES``);
an explicit tiling over the budget, or a key tile larger than lp, is refused
at trace time with one error.
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
    q_BxTxHxDk,
    k_BxTxKxDk,
    v_BxTxKxDv,
    idx_BxTxKxN,
    block_size: int,
    scale: float | None = None,
    *,
    interpret: bool = False,
    block_sizes: FlashBlockSizes | None = None,
    q_offset=0,
):
    """NSA selection attention as a block-masked causal flash attention (fused Pallas/Triton forward and backward).

    Args:
      q_BxTxHxDk: queries; H = K*G, query head h reads KV head h // G; row r is
        the query at position r + q_offset.
      k_BxTxKxDk, v_BxTxKxDv: selection-branch keys and values, Tk >= Tq rows
        (key i at position i); their gradients cover all Tk keys.
      idx_BxTxKxN: int32 selected block ids per (query row, KV head), blocks of
        the Tk keys; -1 = unused; ids in a row are distinct; ids outside the
        sequence's blocks see nothing.
      block_size: selection block length lp (power of two >= 16).
      scale: softmax scale, default Dk**-0.5.
      interpret: run the kernels in the Pallas interpreter (CPU tests).
      block_sizes: optional ``FlashBlockSizes`` (key tiles at most lp).
      q_offset: position of q's first row, a Python int or a traced int32
        scalar; the caller keeps q_offset + Tq <= Tk.

    Returns:
      o_BxTxHxDv in q's dtype.
    """
    validate_selection(q_BxTxHxDk, k_BxTxKxDk, v_BxTxKxDv, idx_BxTxKxN, q_offset)
    dk, tk = q_BxTxHxDk.shape[-1], k_BxTxKxDk.shape[1]
    check_tile_size("block_size", block_size)
    bsz = FlashBlockSizes() if block_sizes is None else block_sizes
    scale = float(dk**-0.5 if scale is None else scale)
    lay = KeyLayout(num_keys=tk, window=tk)  # causal; the block mask does the rest
    o, _ = banded_attention(
        q_BxTxHxDk,
        k_BxTxKxDk,
        v_BxTxKxDv,
        lay,
        scale,
        bool(interpret),
        bsz,
        "nsa_selection_bsp",
        idx=idx_BxTxKxN.astype(jnp.int32),
        select_block=int(block_size),
        q_offset=q_offset,
    )
    return o
