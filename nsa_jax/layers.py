"""Building blocks shared by the model: RMSNorm, rotary embeddings, fused input projections, the gated MLP."""

from __future__ import annotations

from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


class RMSNorm(nn.Module):
    """x / rms(x) * scale, computed in fp32; `plus_one` (Gemma's norms): * (1 + scale), scale starting at 0."""

    eps: float = 1e-6
    dtype: jnp.dtype = jnp.float32
    plus_one: bool = False

    @nn.compact
    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        init = nn.initializers.zeros if self.plus_one else nn.initializers.ones
        scale = self.param("scale", init, (x_BxTxD.shape[-1],), jnp.float32)
        x = x_BxTxD.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return (x * (1.0 + scale if self.plus_one else scale)).astype(self.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling=None) -> np.ndarray:
    """RoPE's inverse frequencies [head_dim / 2] (fp32): theta ** (-2i / head_dim), rescaled by band
    when `scaling` (a config.RopeScaling) is llama3's: wavelengths longer than original_max_len /
    low_freq_factor divided by `factor`, shorter than original_max_len / high_freq_factor kept,
    and the band between interpolated (the rule Llama 3.x models were trained with)."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None or scaling.kind == "none":
        return inv.astype(np.float32)
    if scaling.kind == "linear":  # positions divided by `factor` (Gemma 3's global layers)
        return (inv / scaling.factor).astype(np.float32)
    old, low, high, factor = scaling.original_max_len, scaling.low_freq_factor, scaling.high_freq_factor, scaling.factor
    wavelen = 2 * np.pi / inv
    scaled = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    middle = (wavelen >= old / high) & (wavelen <= old / low)
    scaled = np.where(middle, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    return scaled.astype(np.float32)


def rope(
    x_BxTxHxD: jax.Array, positions_T: jax.Array, theta: float = 10000.0, inv_freq: np.ndarray | None = None
) -> jax.Array:
    """Rotary position embedding (rotate-half form) at absolute positions; `inv_freq` (rope_inv_freq)
    replaces theta's plain frequencies."""
    D = x_BxTxHxD.shape[-1]
    inv_freq = rope_inv_freq(D, theta) if inv_freq is None else inv_freq
    ang_TxD2 = positions_T.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]
    cos = jnp.cos(ang_TxD2)[None, :, None, :]
    sin = jnp.sin(ang_TxD2)[None, :, None, :]
    x = x_BxTxHxD.astype(jnp.float32)
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxTxHxD.dtype)


def rope_rows(y_BxTxHxD: jax.Array, pos_B: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """RoPE with row b's tokens at positions pos_B[b] + 0..T-1."""
    T = y_BxTxHxD.shape[1]
    positions = lambda tb: tb + jnp.arange(T, dtype=jnp.int32)
    return jax.vmap(lambda yb, tb: rope(yb[None], positions(tb), inv_freq=inv_freq)[0])(y_BxTxHxD, pos_B)


class DenseParams(nn.Module):
    """The `kernel` [in, features] (and `bias`) of an nn.Dense, same names, dtype and init, unapplied.

    fused_dense multiplies by several of them at once; the parameters stay one
    Dense each, so checkpoints and initial values are those of separate Denses.
    """

    features: int
    use_bias: bool = False
    kernel_init: Callable = nn.initializers.lecun_normal()
    bias_init: Callable = nn.initializers.zeros

    @nn.compact
    def __call__(self, in_features: int) -> tuple[jax.Array, jax.Array | None]:
        kernel = self.param("kernel", self.kernel_init, (in_features, self.features), jnp.float32)
        bias = self.param("bias", self.bias_init, (self.features,), jnp.float32) if self.use_bias else None
        return kernel, bias


@jax.custom_vjp
def matmul_parts(x_BxTxD: jax.Array, kernels: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """(x @ W_1, x @ W_2, ...), with one matmul for x's gradient by [W_1 | W_2 | ...].

    Forward, the products stay separate (XLA merges matmuls that share x while x is
    small, and keeps each output its own buffer while it is large). Backward, autodiff
    would give sum_i dY_i W_i^T, a matmul and an add per part; here it is one matmul
    [dY_1 | dY_2 | ...] [W_1 | W_2 | ...]^T, and one for every kernel's gradient.
    """
    return tuple(jnp.dot(x_BxTxD, k) for k in kernels)


def _matmul_parts_fwd(x_BxTxD, kernels):
    return matmul_parts(x_BxTxD, kernels), (x_BxTxD, kernels)


def _matmul_parts_bwd(residuals, dys):
    x_BxTxD, kernels = residuals
    dy_BxTxN = jnp.concatenate(dys, axis=-1)
    dx = jnp.dot(dy_BxTxN, jnp.concatenate(kernels, axis=1).T)
    D, N = x_BxTxD.shape[-1], dy_BxTxN.shape[-1]
    dkernel_DxN = jnp.dot(x_BxTxD.reshape(-1, D).T, dy_BxTxN.reshape(-1, N))
    splits = np.cumsum([k.shape[1] for k in kernels])[:-1]
    return dx, tuple(jnp.split(dkernel_DxN, splits, axis=1))


matmul_parts.defvjp(_matmul_parts_fwd, _matmul_parts_bwd)


def fused_dense(x_BxTxD: jax.Array, parts: Sequence[DenseParams], dtype) -> list[jax.Array]:
    """[x @ W_i (+ b_i) for each part] in `dtype`, as nn.Dense computes each (matmul_parts).

    Each output column is the same dot product as its own Dense's; x's gradient is
    one matmul instead of one per part and their sum (kernel launches).
    """
    D = x_BxTxD.shape[-1]
    pairs = [p(D) for p in parts]
    ys = matmul_parts(x_BxTxD.astype(dtype), tuple(k.astype(dtype) for k, _ in pairs))
    return [y if b is None else y + b.astype(dtype) for y, (_, b) in zip(ys, pairs)]


# The gated MLP's activations: SwiGLU's, and GeGLU's gelu in its tanh form (HF's gelu_pytorch_tanh, Gemma).
MLP_ACTIVATIONS = {"silu": nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


class GatedMLP(nn.Module):
    """act(x W1) * (x W3) W2: SwiGLU (act silu) or GeGLU (gelu_tanh)."""

    d_ff: int
    dtype: jnp.dtype = jnp.float32
    init_std: float = 0.02
    out_std: float = 0.02
    act: str = "silu"

    @nn.compact
    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        D = x_BxTxD.shape[-1]
        init = nn.initializers.normal(self.init_std)
        w1, w3 = (DenseParams(self.d_ff, kernel_init=init, name=n) for n in ("w1", "w3"))
        gate, up = fused_dense(x_BxTxD, [w1, w3], self.dtype)
        h = MLP_ACTIVATIONS[self.act](gate) * up
        return nn.Dense(
            D, use_bias=False, dtype=self.dtype, kernel_init=nn.initializers.normal(self.out_std), name="w2"
        )(h)
