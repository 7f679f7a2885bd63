"""Plain causal attention: a pretrained model's own attention, before NSA (model.attention=dense).

x[B, T, D] -> q, k, v projections (biases with model.qkv_bias, per-head RMSNorm of q and k
with model.qk_norm), RoPE (model.rope_scaling), softmax attention over every earlier key
(or the last model.dense_window keys) -> the output projection. The attention itself is the
window branch's (kernels.BranchCalls.window) with the window as long as the sequence, so it
runs the same kernels as NSA's window branch on every backend.

Parameter names are those launch.convert maps a checkpoint's onto: q, k, v, o (and q_norm,
k_norm); converting to NSA copies k and v into each branch's. Prefill and decode keep the
keys and values in the cache's window ring (kwin/vwin, nsa_jax/inference/cache.py), whose
length is the window, or the cache's length with no window.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from nsa_jax.config import ModelConfig
from nsa_jax.kernels import BranchCalls, plan_kernels
from nsa_jax.layers import DenseParams, RMSNorm, fused_dense, rope, rope_inv_freq, rope_rows
from nsa_jax.nsa.layer import Attention, gather_rows, ring_attend, ring_positions

# A window longer than any sequence: every earlier key is visible.
UNBOUNDED = 1 << 30


def dense_window(cfg: ModelConfig) -> int:
    """Keys a query sees: model.dense_window, or every earlier one."""
    return cfg.dense_window or UNBOUNDED


class DenseAttention(Attention):
    """x[B, T, D] -> causal attention output [B, T, D]; `mode` and its arguments as NSAAttention's
    (config validation keeps dense attention off context parallelism)."""

    @nn.compact
    def attend(self, x_BxTxD, layer, pos_B, rope_positions_T) -> jax.Array:
        cfg = self.cfg
        B, T, D = x_BxTxD.shape
        H, K, Dk, Dv = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.v_head_dim
        dtype = jnp.dtype(cfg.dtype)
        init = nn.initializers.normal(cfg.init_std)
        parts = [
            DenseParams(n * d, use_bias=cfg.qkv_bias, kernel_init=init, name=name)
            for name, n, d in (("q", H, Dk), ("k", K, Dk), ("v", K, Dv))
        ]
        q, k, v = fused_dense(x_BxTxD, parts, dtype)
        q, k, v = q.reshape(B, T, H, Dk), k.reshape(B, T, K, Dk), v.reshape(B, T, K, Dv)
        if cfg.qk_norm:
            q = RMSNorm(cfg.norm_eps, dtype=dtype, name="q_norm")(q)
            k = RMSNorm(cfg.norm_eps, dtype=dtype, name="k_norm")(k)
        inv_freq = rope_inv_freq(Dk, cfg.rope_theta, cfg.rope_scaling)
        if self.mode == "decode":
            q, k = rope_rows(q, pos_B, inv_freq), rope_rows(k, pos_B, inv_freq)
        else:
            positions_T = jnp.arange(T, dtype=jnp.int32) if rope_positions_T is None else rope_positions_T
            q, k = rope(q, positions_T, inv_freq=inv_freq), rope(k, positions_T, inv_freq=inv_freq)
        out_init = nn.initializers.normal(cfg.init_std / (2 * cfg.n_layers) ** 0.5)
        out_proj = nn.Dense(D, use_bias=False, dtype=dtype, kernel_init=out_init, name="o")
        if self.mode == "decode":
            o = self._decode(q[:, 0], k[:, 0], v[:, 0], layer, pos_B)[:, None]
        else:
            plan = self.kernels or plan_kernels(cfg.nsa, T, jax.default_backend())
            o = BranchCalls(cfg.nsa, plan).window(q, k, v, window=dense_window(cfg))
            if self.mode == "prefill":
                self._fill(k, v, layer, pos_B)
        return out_proj(o.astype(dtype).reshape(B, T, H * Dv))

    def _ring(self):
        return {n: self.variable("cache", n, _missing_cache, n) for n in ("kwin", "vwin")}

    def _fill(self, k_BxPxKxD, v_BxPxKxD, layer, lengths_B) -> None:
        """The ring holds each row's last R positions of its prompt (R: the cache's ring length)."""
        ring = self._ring()
        pos_BxR = ring_positions(lengths_B.astype(jnp.int32) - 1, ring["kwin"].value.shape[2])
        for name, x in (("kwin", k_BxPxKxD), ("vwin", v_BxPxKxD)):
            cache = ring[name].value
            ring[name].value = cache.at[layer].set(gather_rows(x, pos_BxR).astype(cache.dtype))

    def _decode(self, q_BxHxDk, k_BxKxDk, v_BxKxDv, layer, t_B) -> jax.Array:
        """Writes position t_B[b] of each row into the ring, then attends over the ring: [B, H, Dv]."""
        ring = self._ring()
        B, H, Dk = q_BxHxDk.shape
        K = k_BxKxDk.shape[1]
        R = ring["kwin"].value.shape[2]
        t_B = t_B.astype(jnp.int32)
        b_B = jnp.arange(B)
        for name, x in (("kwin", k_BxKxDk), ("vwin", v_BxKxDv)):
            cache = ring[name].value
            ring[name].value = cache.at[layer, b_B, t_B % R].set(x.astype(cache.dtype))
        qg = q_BxHxDk.reshape(B, K, H // K, Dk)
        o = ring_attend(qg, ring["kwin"].value[layer], ring["vwin"].value[layer], t_B, dense_window(self.cfg))
        return o.reshape(B, H, -1).astype(q_BxHxDk.dtype)


def _missing_cache(name: str):
    raise ValueError(
        f"dense attention prefill/decode found no cache variable {name!r}: pass variables "
        "{'params': ..., 'cache': nsa_jax.inference.init_cache(...).variables()} with mutable=['cache']"
    )
