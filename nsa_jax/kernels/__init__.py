"""Attention kernels for the NSA branches, and their dispatch.

One entry point per NSA branch (`compressed_attention`, `selection_attention`,
`window_attention`) runs the implementation `attention_impl` names: `xla` (the
reference and CPU path, kernels/xla.py), `pallas` (Triton-backend Pallas kernels:
compressed_pallas with block_scores_pallas, selection_pallas, flash_pallas;
interpreted when the backend is not a GPU), or `auto` (pallas on GPU, xla elsewhere; the selection branch also
stays on xla when its block length lp is not a power of two >= 16, which its kernel
needs: `pallas` asked for explicitly raises instead). A branch named by
`set_xla_fallback` (the boot-time kernel guard, kernels/guard.py, after its kernel
failed to compile or disagreed with XLA) also runs xla under `auto`.

The selection branch has two Pallas kernels (``SELECTION_KERNELS``): ``blocksparse``
(blocksparse_pallas, a causal flash attention under the selected-block mask, whose cost
is at most dense causal attention's) and ``gather`` (selection_pallas walking each
query's n blocks). ``NSAConfig.selection_kernel`` names one, or ``auto`` takes
blocksparse for a short sequence, T <= blocksparse_pallas.BLOCKSPARSE_MAX_SEQ_RATIO * n * lp
(2 n lp; n = idx.shape[-1]), and gather above. `xla` is the same at every T.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nsa_jax.kernels.block_scores_pallas import compressed_attention_scores_pallas, compressed_attention_select_pallas
from nsa_jax.kernels.blocksparse_pallas import (
    prefers_blocksparse,
    selection_attention_blocksparse_pallas,
)
from nsa_jax.kernels.flash_pallas import window_attention_pallas
from nsa_jax.kernels.pallas_common import is_tile_size
from nsa_jax.kernels.selection_pallas import SelectionBlockSizes, selection_attention_pallas
from nsa_jax.kernels.xla import (
    compressed_attention_xla,
    select_blocks,
    selection_attention_xla,
    window_attention_xla,
)

# The selection kernels a config may name, with the tiles each runs (None: blocksparse's own).
# gather: one query position per program (its G heads padded to 16 rows) with one warp: the
# fastest gather tiling on an H200 for random selections (docs/PERFORMANCE.md).
SELECTION_KERNELS: dict[str, SelectionBlockSizes | None] = {
    "blocksparse": None,
    "gather": SelectionBlockSizes(positions=1, num_warps=1),
}

# Branches ("cmp", "slc", "win") that `auto` runs on xla for the rest of the process.
_XLA_FALLBACK: frozenset[str] = frozenset()


def set_xla_fallback(branches) -> None:
    """Makes `auto` run `branches` on xla (replacing any earlier set; () clears it)."""
    global _XLA_FALLBACK
    unknown = set(branches) - {"cmp", "slc", "win"}
    if unknown:
        raise ValueError(f"unknown NSA branches {sorted(unknown)}")
    _XLA_FALLBACK = frozenset(branches)


def xla_fallback() -> frozenset[str]:
    """The branches `auto` runs on xla after the kernel guard (set_xla_fallback)."""
    return _XLA_FALLBACK


def resolve_branch(impl: str, branch: str, backend: str | None = None) -> str:
    """resolve_impl for one branch: `auto` gives xla for a branch in xla_fallback()."""
    chosen = resolve_impl(impl, backend)
    return "xla" if impl == "auto" and branch in _XLA_FALLBACK else chosen


def resolve_impl(impl: str, backend: str | None = None) -> str:
    """The implementation `impl` stands for on `backend` (default: jax's)."""
    if impl not in ("auto", "pallas", "xla"):
        raise ValueError(f"attention_impl must be auto, pallas or xla, got {impl!r}")
    if impl != "auto":
        return impl
    backend = jax.default_backend() if backend is None else backend
    return "pallas" if backend in ("gpu", "cuda", "rocm") else "xla"


def selection_kernel_fits(block_size: int) -> bool:
    """Whether the Pallas selection kernel takes blocks of `block_size` (a power of two >= 16)."""
    return is_tile_size(block_size)


def _resolve_selection(impl: str, block_size: int | None, backend: str | None = None) -> str:
    chosen = resolve_branch(impl, "slc", backend)
    if impl == "auto" and chosen == "pallas" and block_size is not None and not selection_kernel_fits(block_size):
        return "xla"
    return chosen


def describe_impl(
    impl: str,
    backend: str | None = None,
    block_size: int | None = None,
    seq: int | None = None,
    slots: int | None = None,
    choice: str = "auto",
) -> dict[str, str]:
    """What each branch runs, for env.json and the boot heartbeat.

    `block_size`: the selection lp; with `seq` (T) and `slots` (n) as well, a Pallas
    selection also names its kernel (`pallas-triton/blocksparse` or `.../gather`;
    `choice` is NSAConfig.selection_kernel).
    """
    backend = jax.default_backend() if backend is None else backend

    def kind(chosen: str) -> str:
        if chosen == "pallas":
            return "pallas-triton" if backend in ("gpu", "cuda") else "pallas-interpret"
        return "xla-chunked"

    slc = kind(_resolve_selection(impl, block_size, backend))
    if slc != "xla-chunked" and None not in (block_size, seq, slots):
        slc += "/" + selection_kernel(impl, seq, slots, block_size, backend, choice)
    return {
        "cmp": kind(resolve_branch(impl, "cmp", backend)),
        "slc": slc,
        "win": kind(resolve_branch(impl, "win", backend)),
    }


def interpret_pallas() -> bool:
    """Pallas kernels run compiled on a GPU and in the interpreter elsewhere."""
    return jax.default_backend() not in ("gpu", "cuda")


def selection_kernel(
    impl: str, seq: int, slots: int, block_size: int, backend: str | None = None, choice: str = "auto"
) -> str:
    """Which selection kernel runs: one of SELECTION_KERNELS, or `xla`.

    `choice` (NSAConfig.selection_kernel) names one; `auto` takes `blocksparse` for
    T <= BLOCKSPARSE_MAX_SEQ_RATIO * n * lp and `gather` above.
    """
    if choice != "auto" and choice not in SELECTION_KERNELS:
        raise ValueError(f"selection_kernel must be auto or one of {', '.join(SELECTION_KERNELS)}, got {choice!r}")
    if _resolve_selection(impl, block_size, backend) != "pallas":
        return "xla"
    if choice != "auto":
        return choice
    return "blocksparse" if prefers_blocksparse(seq, slots, block_size) else "gather"


def selection_attention(q, k, v, idx, block_size, scale=None, *, impl="xla", query_chunk=512, kernel="auto"):
    """Selection attention through the chosen implementation (contract: docs/NSA.md, the kernels section).

    On the Pallas path `kernel` (NSAConfig.selection_kernel) picks the kernel through `selection_kernel`.
    """
    kernel = selection_kernel(impl, q.shape[1], idx.shape[-1], block_size, choice=kernel)
    if kernel == "blocksparse":
        return selection_attention_blocksparse_pallas(q, k, v, idx, block_size, scale, interpret=interpret_pallas())
    if kernel in SELECTION_KERNELS:
        return selection_attention_pallas(
            q, k, v, idx, block_size, scale, interpret=interpret_pallas(), block_sizes=SELECTION_KERNELS[kernel]
        )
    return selection_attention_xla(q, k, v, idx, block_size, scale, query_chunk=query_chunk)


def window_attention(q, k, v, window, scale=None, *, impl="xla", query_chunk=512):
    """Sliding-window attention through the chosen implementation."""
    if resolve_branch(impl, "win") == "pallas":
        return window_attention_pallas(q, k, v, window, scale, interpret=interpret_pallas())
    return window_attention_xla(q, k, v, window, scale, query_chunk=query_chunk)


def compressed_attention(q, kc, vc, *, l, d, lp, scale=None, impl="xla", query_chunk=512, select_n=None, t_T=None):
    """Compressed-branch attention and the selection-block scores (or blocks) through the chosen implementation.

    Query t sees compressed token i iff i*d + l - 1 <= t; a query that sees none
    gets 0. Returns o [B, T, H, Dv] in q's dtype and the group block scores
    [B, T, K, Nb] fp32 (probabilities summed over the G heads of each group, then
    over the compressed tokens overlapping each selection block of lp; no gradient).
    With `select_n`, the second output is instead the selected blocks
    [B, T, K, select_n] int32, select_blocks(scores, lp, select_n, t_T)'s contract:
    `xla` runs select_blocks over its own scores; `pallas` scores and selects in one
    kernel (block_scores_pallas), so no probability or block-score tensor exists.
    """
    B, T, H, Dk = q.shape
    Tc, K, Dv = kc.shape[1], kc.shape[2], vc.shape[3]
    n_blocks = -(-T // lp)
    scale = Dk**-0.5 if scale is None else scale
    if Tc == 0:
        o, scores = jnp.zeros((B, T, H, Dv), q.dtype), jnp.zeros((B, T, K, n_blocks), jnp.float32)
    elif resolve_branch(impl, "cmp") == "pallas":
        kw = dict(l=l, d=d, lp=lp, scale=scale, interpret=interpret_pallas())
        if select_n is None:
            return compressed_attention_scores_pallas(q, kc, vc, **kw)
        return compressed_attention_select_pallas(q, kc, vc, n=select_n, t_T=t_T, **kw)
    else:
        o, scores = compressed_attention_xla(q, kc, vc, l=l, d=d, lp=lp, scale=scale, query_chunk=query_chunk)
    return o, (scores if select_n is None else select_blocks(scores, lp, select_n, t_T))
