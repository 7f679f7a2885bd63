"""Prefill, one-token NSA decode, sampling and the generation loop.

`prefill` and `decode_step` apply the model itself (nsa_jax/model.py NSALM,
the same params and modules as training) in its "prefill" and "decode" modes,
with the cache (cache.py) as the `cache` variable collection. `prefill` runs
the forward over a right-padded batch of prompts, so its logits are the
forward's, and the layers keep each branch's keys/values. `decode_step`
advances every row by one token: jitted once per (config, batch, cache
length); each row's position is data (`cache.pos_B`), layers are scanned like
the model's, and the cache is updated in place (donated).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from nsa_jax.config import ModelConfig
from nsa_jax.inference.cache import NSACache, cache_sizes, init_cache
from nsa_jax.model import NSALM


def inference_config(cfg: ModelConfig) -> ModelConfig:
    """The model config used for inference: scanned layers, no rematerialisation (no backward)."""
    return dataclasses.replace(cfg, remat="none", scan_layers=True)


def stack_layers(cfg: ModelConfig, params: dict) -> dict:
    """Params with scanned layers (`layers`, leading layer axis), whichever way they were trained."""
    if "layers" in params:
        return params
    names = [f"layer_{i}" for i in range(cfg.n_layers)]
    if not all(n in params for n in names):
        raise ValueError("params have neither 'layers' nor 'layer_0'..'layer_{L-1}'")
    out = {k: v for k, v in params.items() if k not in names}
    out["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *[params[n] for n in names])
    return out


# ---------------------------------------------------------------------------
# prefill


def _prefill(cfg: ModelConfig, max_len: int, params: dict, tokens_BxP: jax.Array, lengths_B: jax.Array):
    cfg = inference_config(cfg)
    B = tokens_BxP.shape[0]
    empty = init_cache(cfg, B, max_len).variables()
    logits_BxPxV, state = NSALM(cfg, mode="prefill").apply(
        {"params": params, "cache": empty}, tokens_BxP, lengths_B, mutable=["cache"]
    )
    last_BxV = logits_BxPxV[jnp.arange(B), lengths_B - 1]
    return last_BxV, NSACache.from_variables(state["cache"])


_prefill_jit = jax.jit(_prefill, static_argnums=(0, 1))


def prefill(
    cfg: ModelConfig, params: dict, tokens_BxP: jax.Array, lengths_B: jax.Array | None = None, *, max_len: int
) -> tuple[jax.Array, NSACache]:
    """Logits [B, V] at each row's last prompt token, and a cache holding the prompts.

    `tokens_BxP` holds left-aligned prompts, right-padded with any id;
    `lengths_B` (default: all P) gives each row's prompt length (>= 1).
    `max_len` bounds prompt + generated tokens of every row.
    """
    tokens_BxP = jnp.asarray(tokens_BxP, jnp.int32)
    B, P = tokens_BxP.shape
    lengths_B = np.full((B,), P, np.int32) if lengths_B is None else np.asarray(lengths_B, np.int32)
    if lengths_B.shape != (B,) or lengths_B.min() < 1 or lengths_B.max() > P:
        raise ValueError(f"prompt lengths must lie in [1, {P}] (one per row), got {lengths_B.tolist()}")
    if P > cache_sizes(cfg, max_len).S:
        raise ValueError(f"prompt length {P} exceeds max_len {max_len}")
    return _prefill_jit(cfg, max_len, params, tokens_BxP, lengths_B)


# ---------------------------------------------------------------------------
# one decode step


def _decode_step(cfg: ModelConfig, params: dict, cache: NSACache, tokens_B: jax.Array):
    cfg = inference_config(cfg)
    logits_Bx1xV, state = NSALM(cfg, mode="decode").apply(
        {"params": params, "cache": cache.variables()}, tokens_B[:, None], mutable=["cache"]
    )
    return logits_Bx1xV[:, 0], NSACache.from_variables(state["cache"])


# The cache is donated: each step reuses its buffers instead of copying them.
decode_step: Callable[[ModelConfig, dict, NSACache, jax.Array], tuple[jax.Array, NSACache]] = jax.jit(
    _decode_step, static_argnums=(0,), donate_argnums=(2,)
)
decode_step.__doc__ = """Feeds tokens_B[b] at position cache.pos_B[b]; returns (logits [B, V] at that position, cache).

Jitted once per (config, batch, cache length); the cache is donated.
Positions must stay below the cache length (checked by `generate`)."""


# ---------------------------------------------------------------------------
# sampling and generation


@functools.partial(jax.jit, static_argnames=("top_k",))
def sample_logits(
    logits_BxV: jax.Array,
    key: jax.Array,
    temperature: jax.Array | float,
    top_p: jax.Array | float = 1.0,
    allowed_V: jax.Array | None = None,
    *,
    top_k: int = 0,
) -> jax.Array:
    """Next ids [B]: greedy when temperature == 0, else top-k / top-p sampling at that temperature."""
    x = logits_BxV.astype(jnp.float32)
    if allowed_V is not None:
        x = jnp.where(allowed_V[None, :], x, -jnp.inf)
    greedy = jnp.argmax(x, axis=-1)
    temperature = jnp.asarray(temperature, jnp.float32)
    x = x / jnp.maximum(temperature, 1e-6)
    V = x.shape[-1]
    if 0 < top_k < V:
        kth = jax.lax.top_k(x, top_k)[0][:, -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    # Nucleus: keep the smallest prefix of the sorted distribution whose mass reaches
    # top_p (the first token always stays).
    sorted_x = -jnp.sort(-x, axis=-1)
    probs = jax.nn.softmax(sorted_x, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    keep = before < jnp.asarray(top_p, jnp.float32)
    cutoff = jnp.min(jnp.where(keep, sorted_x, jnp.inf), axis=-1, keepdims=True)
    x = jnp.where(x < cutoff, -jnp.inf, x)
    sampled = jax.random.categorical(key, x, axis=-1)
    return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def generate(
    cfg: ModelConfig,
    params: dict,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_id: int | None = None,
    allowed_V: np.ndarray | None = None,
    on_token: Callable[[int, np.ndarray, np.ndarray], None] | None = None,
) -> list[list[int]]:
    """Generates up to max_new_tokens ids after each prompt; all rows advance together.

    Prompts of different lengths share one batch: they are left-aligned and
    right-padded for the prefill, and every row decodes at its own position.
    A row stops at `eos_id` (not included in its output). `on_token(step,
    ids[B], active[B])` is called after each sampled token (for streaming).
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens < 1:
        return [[] for _ in prompts]
    # On the device once, not once per step.
    params = jax.tree.map(jnp.asarray, stack_layers(cfg, params))
    B = len(prompts)
    lengths = np.array([len(p) for p in prompts], np.int32)
    max_len = int(lengths.max()) + max_new_tokens
    # Prefill length rounded up, so prompts of nearby lengths reuse one compiled program.
    P = min(_round_up(int(lengths.max()), max(cfg.nsa.lp, 16)), cache_sizes(cfg, max_len).S)
    tokens = np.zeros((B, P), np.int32)
    for b, prompt in enumerate(prompts):
        tokens[b, : len(prompt)] = np.asarray(prompt, np.int32)
    logits, cache = prefill(cfg, params, tokens, lengths, max_len=max_len)
    allowed = None if allowed_V is None else jnp.asarray(allowed_V, bool)
    key = jax.random.PRNGKey(seed)
    out: list[list[int]] = [[] for _ in range(B)]
    active = np.ones(B, bool)
    for step in range(max_new_tokens):
        key, sub = jax.random.split(key)
        ids = np.asarray(sample_logits(logits, sub, temperature, top_p, allowed, top_k=top_k))
        if eos_id is not None:
            active &= ids != eos_id
        for b in range(B):
            if active[b]:
                out[b].append(int(ids[b]))
        if on_token is not None:
            on_token(step, ids, active.copy())
        if not active.any() or step == max_new_tokens - 1:
            break
        logits, cache = decode_step(cfg, params, cache, jnp.asarray(ids, jnp.int32))
    return out
