"""Inference: NSA decode caches (cache.py), prefill / one-token decode / sampling (decode.py)."""

from nsa_jax.inference.cache import NSACache, cache_sizes, init_cache, ring_positions
from nsa_jax.inference.decode import decode_step, generate, prefill, sample_logits, stack_layers

__all__ = [
    "NSACache",
    "cache_sizes",
    "decode_step",
    "generate",
    "init_cache",
    "prefill",
    "ring_positions",
    "sample_logits",
    "stack_layers",
]
