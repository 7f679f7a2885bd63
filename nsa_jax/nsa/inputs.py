"""The attention's input and output stage, one for both cores (NSA, nsa/layer.py; dense, nsa/dense.py).

x[B, T, D] -> the query and each named key and value projection (biases with model.qkv_bias),
Qwen3's per-head RMSNorm of the query and of every key (model.qk_norm: one q_norm, one k_norm
shared by the keys), RoPE with its scaling (model.rope_scaling) at the given positions or, in
decode, at each row's own (a local layer's base: model.local_rope_theta), the query's scale
(model.query_scale); and the output projection `o`. A family's feature of this stage is
written here once; the cores only say which keys and values they project (dense: k, v; NSA:
one per branch) and what else shares the input's matmul (NSA's gate MLP).

Functions, not a module: called inside a core's compact method, the submodules they make
(q, k.., v.., q_norm, k_norm, o) are the core's own, so parameter names are the checkpoint's.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from nsa_jax.config import ModelConfig
from nsa_jax.layers import DenseParams, RMSNorm, fused_dense, rope, rope_inv_freq, rope_rows


@dataclasses.dataclass
class Projected:
    """What the input stage gives a core: q [B, T, H, Dk] and keys [B, T, K, Dk] normed and RoPE'd,
    values [B, T, K, Dv], the extra parts' outputs; and what re-projects a key the same way
    (`key_parts`, `k_norm`, `roped`: the scorer's distillation makes its keys again from a detached x)."""

    q: jax.Array
    k: dict[str, jax.Array]
    v: dict[str, jax.Array]
    extra: list[jax.Array]
    key_parts: dict[str, DenseParams]
    k_norm: RMSNorm | None
    roped: Callable[[jax.Array], jax.Array]


def project(
    cfg: ModelConfig,
    x_BxTxD: jax.Array,
    keys: Sequence[str],
    values: Sequence[str],
    positions_T: jax.Array | None,
    pos_B: jax.Array | None = None,
    extra: Sequence[DenseParams] = (),
    local=None,
) -> Projected:
    """The projections of x, one matmul for x's gradient (layers.fused_dense; each stays its own Dense):
    q, then `keys`, `values` and `extra`, in that order. RoPE at `positions_T` [T], or with
    positions_T None (decode) at pos_B[b] for row b; a local layer's (`local`, attention.local_layer)
    at model.local_rope_theta. The query comes out scaled so the cores' head_dim ** -0.5 scales
    the scores by model.query_scale ** -0.5."""
    B, T, _ = x_BxTxD.shape
    H, K, Dk, Dv = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.v_head_dim
    dtype = jnp.dtype(cfg.dtype)
    init = nn.initializers.normal(cfg.init_std)
    bias = cfg.qkv_bias
    q_part = DenseParams(H * Dk, use_bias=bias, kernel_init=init, name="q")
    key_parts = {n: DenseParams(K * Dk, use_bias=bias, kernel_init=init, name=n) for n in keys}
    value_parts = [DenseParams(K * Dv, use_bias=bias, kernel_init=init, name=n) for n in values]
    q_norm, k_norm = (None, None)
    if cfg.qk_norm:  # Qwen3's per-head norms: one for the query, one shared by every key
        q_norm, k_norm = (RMSNorm(cfg.norm_eps, dtype, cfg.norm_plus_one, name=n) for n in ("q_norm", "k_norm"))
    inv_freq = rope_inv_freq(Dk, cfg.rope_theta, cfg.rope_scaling)
    if local is not None and cfg.local_rope_theta:
        inv_local = rope_inv_freq(Dk, cfg.local_rope_theta)
        static = isinstance(local, bool)
        inv_freq = (inv_local if local else inv_freq) if static else jnp.where(local, inv_local, inv_freq)

    def roped(y):
        return rope_rows(y, pos_B, inv_freq) if positions_T is None else rope(y, positions_T, inv_freq=inv_freq)

    out = fused_dense(x_BxTxD, [q_part, *key_parts.values(), *value_parts, *extra], dtype)
    q, ks, vs = out[0], out[1 : 1 + len(keys)], out[1 + len(keys) : 1 + len(keys) + len(values)]
    q = q.reshape(B, T, H, Dk)
    ks = [y.reshape(B, T, K, Dk) for y in ks]
    if cfg.qk_norm:
        q, ks = q_norm(q), [k_norm(y) for y in ks]
    q = roped(q)
    if cfg.query_scale and cfg.query_scale != Dk:  # Gemma's query_pre_attn_scalar
        q = q * jnp.asarray((Dk / cfg.query_scale) ** 0.5, q.dtype)
    return Projected(
        q=q,
        k={n: roped(y) for n, y in zip(keys, ks)},
        v={n: y.reshape(B, T, K, Dv) for n, y in zip(values, vs)},
        extra=out[1 + len(keys) + len(values) :],
        key_parts=key_parts,
        k_norm=k_norm,
        roped=roped,
    )


def output_projection(cfg: ModelConfig) -> nn.Dense:
    """`o`: the heads' outputs [.., H * Dv] -> [.., D]; initialised at init_std / sqrt(2 L) (GPT-2's
    scaling of a residual branch's last projection)."""
    out_init = nn.initializers.normal(cfg.init_std / (2 * cfg.n_layers) ** 0.5)
    return nn.Dense(cfg.d_model, use_bias=False, dtype=jnp.dtype(cfg.dtype), kernel_init=out_init, name="o")


def reprojected_key(p: Projected, name: str, x_BxTxD: jax.Array, dtype) -> jax.Array:
    """Key `name` made again from `x` by the same projection, norm and RoPE: [B, T, K, Dk]."""
    (k,) = fused_dense(x_BxTxD, [p.key_parts[name]], dtype)
    k = k.reshape(*x_BxTxD.shape[:2], -1, p.q.shape[-1])
    return p.roped(p.k_norm(k) if p.k_norm is not None else k)
