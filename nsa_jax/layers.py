"""Building blocks shared by the model: RMSNorm, rotary embeddings, SwiGLU MLP."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


class RMSNorm(nn.Module):
    """x / rms(x) * scale, computed in fp32."""

    eps: float = 1e-6
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x_BxTxD.shape[-1],), jnp.float32)
        x = x_BxTxD.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return (x * scale).astype(self.dtype)


def rope(x_BxTxHxD: jax.Array, positions_T: jax.Array, theta: float = 10000.0) -> jax.Array:
    """Rotary position embedding (rotate-half form) at absolute positions."""
    D = x_BxTxHxD.shape[-1]
    inv_freq = theta ** (-jnp.arange(0, D, 2, dtype=jnp.float32) / D)
    ang_TxD2 = positions_T.astype(jnp.float32)[:, None] * inv_freq[None, :]
    cos = jnp.cos(ang_TxD2)[None, :, None, :]
    sin = jnp.sin(ang_TxD2)[None, :, None, :]
    x = x_BxTxHxD.astype(jnp.float32)
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxTxHxD.dtype)


class SwiGLU(nn.Module):
    """silu(x W1) * (x W3) W2."""

    d_ff: int
    dtype: jnp.dtype = jnp.float32
    init_std: float = 0.02
    out_std: float = 0.02

    @nn.compact
    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        D = x_BxTxD.shape[-1]
        init = nn.initializers.normal(self.init_std)
        gate = nn.Dense(self.d_ff, use_bias=False, dtype=self.dtype, kernel_init=init, name="w1")(x_BxTxD)
        up = nn.Dense(self.d_ff, use_bias=False, dtype=self.dtype, kernel_init=init, name="w3")(x_BxTxD)
        h = nn.silu(gate) * up
        return nn.Dense(
            D, use_bias=False, dtype=self.dtype, kernel_init=nn.initializers.normal(self.out_std), name="w2"
        )(h)
