"""Prefill, one-token NSA decode, sampling and the generation loop.

`prefill` runs the model's own forward pass (NSALM.apply, the same params, so
the same logits) over a right-padded batch of prompts and keeps the per-branch
keys/values it computed, captured from the attention's Dense and Compressor
submodules, in an NSACache (cache.py). `decode_step` then advances every row
by one token from that cache: jitted once per (config, batch, cache length);
each row's position is data (`cache.pos_B`), layers are scanned like the
model's, and the per-layer caches are updated in place inside the scan carry.

Decode of token t repeats the forward's math at position t: the same
projections, RoPE, gates and compressor modules (applied with the layer's
params), compressed attention over the visible compressed tokens, block scores
from its probabilities with the GQA group sum, `select_blocks` (forced blocks,
top-n, ties to the lower index), selection attention over the chosen blocks of
the raw K_slc/V_slc cache and window attention over the ring buffer.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from nsa_jax.config import ModelConfig
from nsa_jax.inference.cache import (
    NSACache,
    cache_sizes,
    compressed_visible,
    fill_from_prefill,
    ring_positions,
)
from nsa_jax.kernels.xla import masked_softmax_attend
from nsa_jax.layers import RMSNorm, SwiGLU, rope
from nsa_jax.model import NSALM
from nsa_jax.nsa.compression import Compressor
from nsa_jax.nsa.selection import block_scores_from_cmp, select_blocks

# Submodules of NSAAttention whose outputs the prefill keeps.
_CAPTURED = ("k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win", "cmp_k", "cmp_v")


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


def _capture_filter(mdl: nn.Module, method_name: str) -> bool:
    return method_name == "__call__" and mdl.name in _CAPTURED


def _prefill(cfg: ModelConfig, max_len: int, params: dict, tokens_BxP: jax.Array, lengths_B: jax.Array):
    cfg = inference_config(cfg)
    logits_BxPxV, state = NSALM(cfg).apply(
        {"params": params}, tokens_BxP, capture_intermediates=_capture_filter, mutable=["intermediates"]
    )
    attn = state["intermediates"]["layers"]["attn"]
    captured = {name: attn[name]["__call__"][0] for name in _CAPTURED}
    cache = fill_from_prefill(cfg, captured, lengths_B, max_len)
    B = tokens_BxP.shape[0]
    last_BxV = logits_BxPxV[jnp.arange(B), lengths_B - 1]
    return last_BxV, cache


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


def _attention_step(cfg: ModelConfig, p: dict, h_Bx1xD: jax.Array, t_B: jax.Array, i: jax.Array, arrays: dict):
    """NSA attention of one new token per row at position t_B[b]; writes its K/V into layer i."""
    a = cfg.nsa
    B = h_Bx1xD.shape[0]
    D, H, K, Dk, Dv = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.v_head_dim
    G = H // K
    dt = jnp.dtype(cfg.dtype)
    scale = Dk**-0.5
    S = arrays["kslc"].shape[2]
    R = arrays["kwin"].shape[2]
    Tc = arrays["kcmp"].shape[2]
    b_B = jnp.arange(B)

    def proj(name, heads, dim):
        y = nn.Dense(heads * dim, use_bias=False, dtype=dt).apply({"params": p[name]}, h_Bx1xD)
        return y.reshape(B, 1, heads, dim)

    def roped(y_Bx1xHxD):
        # Each row sits at its own position.
        return jax.vmap(lambda yb, tb: rope(yb[None], tb[None], cfg.rope_theta)[0])(y_Bx1xHxD, t_B)

    q = roped(proj("q", H, Dk))
    new = {
        "kcmp_raw": roped(proj("k_cmp", K, Dk))[:, 0],
        "vcmp_raw": proj("v_cmp", K, Dv)[:, 0],
        "kslc": roped(proj("k_slc", K, Dk))[:, 0],
        "vslc": proj("v_slc", K, Dv)[:, 0],
        "kwin": roped(proj("k_win", K, Dk))[:, 0],
        "vwin": proj("v_win", K, Dv)[:, 0],
    }
    gh = nn.Dense(a.gate_hidden, dtype=dt).apply({"params": p["gate_fc1"]}, h_Bx1xD)
    g = nn.Dense(3 * H, dtype=dt).apply({"params": p["gate_fc2"]}, nn.silu(gh))
    g_Bx1xHx3 = jax.nn.sigmoid(g.astype(jnp.float32)).reshape(B, 1, H, 3)

    # Write position t. Scatters into the scan carry, so the caches are updated in place.
    arrays = dict(arrays)
    for name in ("kslc", "vslc"):
        arrays[name] = arrays[name].at[i, b_B, t_B].set(new[name].astype(dt))
    for name in ("kwin", "vwin"):
        arrays[name] = arrays[name].at[i, b_B, t_B % R].set(new[name].astype(dt))
    for name in ("ktail", "vtail"):
        arrays[name] = arrays[name].at[i, b_B, t_B % a.l].set(new[name[0] + "cmp_raw"].astype(dt))

    # Compression block i_c = (t + 1 - l) / d completes at t: compress its l raw K/V
    # (the tail ring) with the layer's compressor and store it before attending, so
    # the query at t sees it, as in the forward (i*d + l - 1 <= t).
    emit_B = (t_B + 1 >= a.l) & (jnp.mod(t_B + 1 - a.l, a.d) == 0)
    ci_B = jnp.clip((t_B + 1 - a.l) // a.d, 0, Tc - 1)
    slots_Bxl = jnp.mod(t_B[:, None] + 1 - a.l + jnp.arange(a.l, dtype=jnp.int32)[None, :], a.l)
    compressor = Compressor(a.l, a.d, a.cmp_phi, a.cmp_mlp_hidden, dtype=dt)
    for name, cname in (("kcmp", "cmp_k"), ("vcmp", "cmp_v")):
        tail_BxlxKxD = jnp.take_along_axis(arrays[name[0] + "tail"][i], slots_Bxl[:, :, None, None], axis=1)
        comp_BxKxD = compressor.apply({"params": p.get(cname, {})}, tail_BxlxKxD)[:, 0].astype(dt)
        old_BxKxD = arrays[name][i, b_B, ci_B]
        arrays[name] = arrays[name].at[i, b_B, ci_B].set(jnp.where(emit_B[:, None, None], comp_BxKxD, old_BxKxD))

    qg_BxKxGxDk = q.reshape(B, K, G, Dk)

    # Compressed branch (mirrors compressed_attention's formula).
    kc, vc = arrays["kcmp"][i], arrays["vcmp"][i]
    s = jnp.einsum("bkgd,bikd->bkgi", qg_BxKxGxDk, kc, preferred_element_type=jnp.float32) * scale
    vis = compressed_visible(t_B, Tc, a.l, a.d)[:, None, None, :]
    s_masked = jnp.where(vis, s, -1e30)
    m = jnp.max(s_masked, axis=-1, keepdims=True)
    pr = jnp.where(vis, jnp.exp(s_masked - m), 0.0)
    pr = pr / jnp.maximum(jnp.sum(pr, axis=-1, keepdims=True), 1e-30)
    o_cmp = jnp.einsum("bkgi,bikd->bkgd", pr.astype(vc.dtype), vc, preferred_element_type=jnp.float32)
    outputs = {"cmp": o_cmp.reshape(B, 1, H, Dv).astype(q.dtype)}

    if "slc" in a.branches:
        # Scores over the whole cache's blocks: blocks after t are not candidates, and
        # compressed tokens not yet visible have probability 0, as in the forward.
        p_group_Bx1xKxTc = jnp.sum(pr, axis=2)[:, None]  # GQA sharing, Eq. 10
        scores_Bx1xKxNb = block_scores_from_cmp(p_group_Bx1xKxTc, S // a.lp, a.l, a.d, a.lp)
        # Rows as select_blocks' query axis, so each row gets its own position.
        idx_BxKxN = select_blocks(jnp.moveaxis(scores_Bx1xKxNb, 1, 0), a.lp, a.n, t_B)[0]
        used = idx_BxKxN >= 0
        pos_BxKxNxLp = jnp.where(used, idx_BxKxN, 0)[..., None] * a.lp + jnp.arange(a.lp, dtype=jnp.int32)
        vis_slc = (used[..., None] & (pos_BxKxNxLp <= t_B[:, None, None, None])).reshape(B, K, 1, a.n * a.lp)
        pos_BxKxM = pos_BxKxNxLp.reshape(B, K, a.n * a.lp)
        k_idx = jnp.arange(K)[None, :, None]
        # Gather only the selected blocks from the full buffer (no per-layer copy of it).
        kg = arrays["kslc"][i, b_B[:, None, None], pos_BxKxM, k_idx]
        vg = arrays["vslc"][i, b_B[:, None, None], pos_BxKxM, k_idx]
        s = jnp.einsum("bkgd,bkmd->bkgm", qg_BxKxGxDk, kg, preferred_element_type=jnp.float32) * scale
        o = masked_softmax_attend(s, vis_slc, vg, "bkgm,bkmd->bkgd")
        outputs["slc"] = o.reshape(B, 1, H, Dv).astype(q.dtype)

    if "win" in a.branches:
        wp_BxR = ring_positions(t_B, R)
        # Ring slots hold positions in (t - R, t]; R <= w, so only never-written slots are masked.
        vis_win = ((wp_BxR >= 0) & (wp_BxR > t_B[:, None] - a.w))[:, None, None, :]
        kw, vw = arrays["kwin"][i], arrays["vwin"][i]
        s = jnp.einsum("bkgd,brkd->bkgr", qg_BxKxGxDk, kw, preferred_element_type=jnp.float32) * scale
        o = masked_softmax_attend(s, vis_win, vw, "bkgr,brkd->bkgd")
        outputs["win"] = o.reshape(B, 1, H, Dv).astype(q.dtype)

    o = jnp.zeros((B, 1, H, Dv), jnp.float32)
    for j, name in enumerate(("cmp", "slc", "win")):
        if name in a.branches:
            o = o + g_Bx1xHx3[..., j : j + 1] * outputs[name].astype(jnp.float32)
    o = o.astype(dt).reshape(B, 1, H * Dv)
    out = nn.Dense(D, use_bias=False, dtype=dt).apply({"params": p["o"]}, o)
    return out, arrays


_ARRAYS = {
    "kslc": "kslc_LxBxSxKxDk",
    "vslc": "vslc_LxBxSxKxDv",
    "kwin": "kwin_LxBxRxKxDk",
    "vwin": "vwin_LxBxRxKxDv",
    "ktail": "ktail_LxBxlxKxDk",
    "vtail": "vtail_LxBxlxKxDv",
    "kcmp": "kcmp_LxBxTcxKxDk",
    "vcmp": "vcmp_LxBxTcxKxDv",
}


def embed_tokens(cfg: ModelConfig, params: dict, tokens_B: jax.Array) -> jax.Array:
    """[B] ids -> [B, 1, D] in the compute dtype (the model's embedding)."""
    embed = nn.Embed(cfg.vocab_size, cfg.d_model)
    return embed.apply({"params": params["embed"]}, tokens_B[:, None]).astype(jnp.dtype(cfg.dtype))


def lm_head(cfg: ModelConfig, params: dict, x_Bx1xD: jax.Array) -> jax.Array:
    """Final norm and LM head: [B, 1, D] -> fp32 logits [B, V]."""
    dt = jnp.dtype(cfg.dtype)
    x = RMSNorm(cfg.norm_eps, dtype=dt).apply({"params": params["final_norm"]}, x_Bx1xD)
    if cfg.tie_embeddings:
        embed = nn.Embed(cfg.vocab_size, cfg.d_model)
        logits = embed.apply({"params": params["embed"]}, x.astype(jnp.float32), method="attend")
    else:
        logits = nn.Dense(cfg.vocab_size, use_bias=False, dtype=dt).apply({"params": params["lm_head"]}, x)
    return logits[:, 0].astype(jnp.float32)


def mlp_step(cfg: ModelConfig, p: dict, x_Bx1xD: jax.Array) -> jax.Array:
    """x + SwiGLU(RMSNorm(x)): the second half of a block."""
    dt = jnp.dtype(cfg.dtype)
    h = RMSNorm(cfg.norm_eps, dtype=dt).apply({"params": p["mlp_norm"]}, x_Bx1xD)
    return x_Bx1xD + SwiGLU(cfg.d_ff, dtype=dt).apply({"params": p["mlp"]}, h)


def _decode_step(cfg: ModelConfig, params: dict, cache: NSACache, tokens_B: jax.Array):
    cfg = inference_config(cfg)
    dt = jnp.dtype(cfg.dtype)
    t_B = cache.pos_B
    x = embed_tokens(cfg, params, tokens_B)
    arrays = {k: getattr(cache, f) for k, f in _ARRAYS.items()}

    def layer(carry, xs):
        x, arrays = carry
        p, i = xs
        h = RMSNorm(cfg.norm_eps, dtype=dt).apply({"params": p["attn_norm"]}, x)
        attn, arrays = _attention_step(cfg, p["attn"], h, t_B, i, arrays)
        x = mlp_step(cfg, p, x + attn)
        return (x, arrays), None

    L = cfg.n_layers
    (x, arrays), _ = jax.lax.scan(layer, (x, arrays), (params["layers"], jnp.arange(L, dtype=jnp.int32)))
    logits_BxV = lm_head(cfg, params, x)
    cache = NSACache(**{f: arrays[k] for k, f in _ARRAYS.items()}, pos_B=t_B + 1)
    return logits_BxV, cache


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
