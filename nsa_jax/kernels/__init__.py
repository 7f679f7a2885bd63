"""Attention kernels for the NSA branches, and their dispatch.

`attention_impl`: `xla` (the reference and CPU path: kernels/xla.py for selection
and window, nsa/compression.py for the compressed branch), `pallas`
(Triton-backend Pallas kernels for all three branches; interpreted when the backend
is not a GPU), or `auto` (pallas on GPU, xla elsewhere; the selection branch also
stays on xla when its block length lp is not a power of two >= 16, which its kernel
needs: `pallas` asked for explicitly raises instead).
"""

from __future__ import annotations

import jax

from nsa_jax.kernels.xla import selection_attention_xla, window_attention_xla


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
    return block_size >= 16 and block_size & (block_size - 1) == 0


def _resolve_selection(impl: str, block_size: int | None, backend: str | None = None) -> str:
    chosen = resolve_impl(impl, backend)
    if impl == "auto" and chosen == "pallas" and block_size is not None and not selection_kernel_fits(block_size):
        return "xla"
    return chosen


def describe_impl(impl: str, backend: str | None = None, block_size: int | None = None) -> dict[str, str]:
    """What each branch runs, for env.json and the boot heartbeat (`block_size`: the selection lp)."""
    backend = jax.default_backend() if backend is None else backend

    def kind(chosen: str) -> str:
        if chosen == "pallas":
            return "pallas-triton" if backend in ("gpu", "cuda") else "pallas-interpret"
        return "xla-chunked"

    chosen = kind(resolve_impl(impl, backend))
    return {"cmp": chosen, "slc": kind(_resolve_selection(impl, block_size, backend)), "win": chosen}


def interpret_pallas() -> bool:
    """Pallas kernels run compiled on a GPU and in the interpreter elsewhere."""
    return jax.default_backend() not in ("gpu", "cuda")


def selection_attention(q, k, v, idx, block_size, scale=None, *, impl="xla", query_chunk=512):
    """Selection attention through the chosen implementation (contract: docs/NSA.md, the kernels section)."""
    if _resolve_selection(impl, block_size) == "pallas":
        from nsa_jax.kernels.selection_pallas import selection_attention_pallas

        return selection_attention_pallas(q, k, v, idx, block_size, scale, interpret=interpret_pallas())
    return selection_attention_xla(q, k, v, idx, block_size, scale, query_chunk=query_chunk)


def window_attention(q, k, v, window, scale=None, *, impl="xla", query_chunk=512):
    """Sliding-window attention through the chosen implementation."""
    if resolve_impl(impl) == "pallas":
        from nsa_jax.kernels.window_pallas import window_attention_pallas

        return window_attention_pallas(q, k, v, window, scale, interpret=interpret_pallas())
    return window_attention_xla(q, k, v, window, scale, query_chunk=query_chunk)
