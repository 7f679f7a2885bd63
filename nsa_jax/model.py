"""The decoder-only NSA language model.

tokens[B, T] -> embedding -> L x (pre-RMSNorm NSA attention + pre-RMSNorm SwiGLU)
-> final RMSNorm -> LM head -> fp32 logits[B, T, V]. Layers are scanned
(`nn.scan`), so the compiled program does not grow with depth; each block can
be rematerialised (`remat`).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from nsa_jax.config import ModelConfig
from nsa_jax.layers import RMSNorm, SwiGLU
from nsa_jax.nsa.layer import NSAAttention

_REMAT_POLICIES = {
    "full": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Block(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x))."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BxTxD: jax.Array, _=None):
        cfg = self.cfg
        dtype = jnp.dtype(cfg.dtype)
        h = RMSNorm(cfg.norm_eps, dtype=dtype, name="attn_norm")(x_BxTxD)
        x_BxTxD = x_BxTxD + NSAAttention(cfg, name="attn")(h)
        h = RMSNorm(cfg.norm_eps, dtype=dtype, name="mlp_norm")(x_BxTxD)
        out_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5
        x_BxTxD = x_BxTxD + SwiGLU(cfg.d_ff, dtype=dtype, init_std=cfg.init_std, out_std=out_std, name="mlp")(h)
        return x_BxTxD, None


class NSALM(nn.Module):
    """tokens[B, T] int32 -> logits[B, T, V] fp32."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens_BxT: jax.Array) -> jax.Array:
        cfg = self.cfg
        dtype = jnp.dtype(cfg.dtype)
        embed = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=nn.initializers.normal(cfg.init_std), name="embed")
        x = embed(tokens_BxT).astype(dtype)
        block = Block
        if cfg.remat != "none":
            block = nn.remat(Block, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers)
        if cfg.scan_layers:
            stack = nn.scan(
                block,
                variable_axes={"params": 0, "intermediates": 0, "aux": 0},
                split_rngs={"params": True},
                length=cfg.n_layers,
            )
            x, _ = stack(cfg, name="layers")(x, None)
        else:
            for i in range(cfg.n_layers):
                x, _ = block(cfg, name=f"layer_{i}")(x, None)
        x = RMSNorm(cfg.norm_eps, dtype=dtype, name="final_norm")(x)
        if cfg.tie_embeddings:
            return embed.attend(x.astype(jnp.float32))
        head = nn.Dense(
            cfg.vocab_size,
            use_bias=False,
            dtype=dtype,
            kernel_init=nn.initializers.normal(cfg.init_std),
            name="lm_head",
        )
        return head(x).astype(jnp.float32)


def init_params(cfg: ModelConfig, rng: jax.Array, seq_len: int = 0):
    """fp32 parameters of the model (shapes do not depend on seq_len)."""
    T = max(seq_len, cfg.nsa.l)
    return NSALM(cfg).init(rng, jnp.zeros((1, T), jnp.int32))["params"]


def cross_entropy(logits_BxTxV: jax.Array, targets_BxT: jax.Array, mask_BxT: jax.Array | None = None) -> jax.Array:
    """Mean next-token cross-entropy in fp32."""
    logits = logits_BxTxV.astype(jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)
    gold = jnp.take_along_axis(logits, targets_BxT[..., None], axis=-1)[..., 0]
    nll = logz - gold
    if mask_BxT is None:
        return jnp.mean(nll)
    mask = mask_BxT.astype(jnp.float32)
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)
