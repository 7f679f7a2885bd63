"""Plain causal attention, the dense core: a pretrained model's own attention, before NSA (model.attention=dense).

The shared input stage (nsa/inputs.py: q, k, v with biases, q/k norms and RoPE) -> softmax
attention over every earlier key (or the last model.dense_window keys) -> the output projection.
The attention itself is the window branch's (kernels.BranchCalls.window) with the window as
long as the sequence, so it runs the same kernels as NSA's window branch on every backend.

Parameter names are those launch.convert maps a checkpoint's onto: q, k, v, o (and q_norm,
k_norm); converting to NSA copies k and v into each branch's. Prefill and decode keep the
keys and values in the cache's window ring (kwin/vwin, nsa/decode.py fill_ring/decode_ring),
whose length is the window, or the cache's length with no window.
"""

from __future__ import annotations

from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp

from nsa_jax.config import ModelConfig
from nsa_jax.kernels import BranchCalls, plan_kernels
from nsa_jax.nsa.attention import Attention, local_layer
from nsa_jax.nsa.decode import decode_ring, fill_ring, missing_cache
from nsa_jax.nsa.inputs import output_projection, project

# A window longer than any sequence: every earlier key is visible.
UNBOUNDED = 1 << 30


def dense_window(cfg: ModelConfig) -> int:
    """Keys a query sees: model.dense_window, or every earlier one."""
    return cfg.dense_window or UNBOUNDED


class DenseAttention(Attention):
    """x[B, T, D] -> causal attention output [B, T, D]; `mode` and its arguments as NSAAttention's
    (config validation keeps dense attention off context parallelism). Under model.global_every
    `layer` is given in every mode: a local layer sees model.dense_window keys, a global one all."""

    @nn.compact
    def attend(self, x_BxTxD, layer, pos_B, rope_positions_T) -> jax.Array:
        cfg = self.cfg
        B, T, _ = x_BxTxD.shape
        decode = self.mode == "decode"
        local = local_layer(cfg, layer)
        positions_T = jnp.arange(T, dtype=jnp.int32) if rope_positions_T is None else rope_positions_T
        p = project(cfg, x_BxTxD, ("k",), ("v",), None if decode else positions_T, pos_B, local=local)
        q, k, v = p.q, p.k["k"], p.v["v"]
        out_proj = output_projection(cfg)
        if self.mode != "train":
            ring = {n: self.variable("cache", n, missing_cache("dense attention"), n) for n in ("kwin", "vwin")}
        if decode:
            window = dense_window(cfg) if local is None else jnp.where(local, cfg.dense_window, UNBOUNDED)
            o = decode_ring(ring, q[:, 0], k[:, 0], v[:, 0], layer, pos_B, window, cfg.attn_softcap)[:, None]
        else:
            plan = self.kernels or plan_kernels(cfg.nsa, T, jax.default_backend())
            calls = BranchCalls(cfg.nsa, plan, cfg.attn_softcap)

            def attend(window, q, k, v):
                return calls.window(q, k, v, window=window)

            if local is None:
                o = attend(dense_window(cfg), q, k, v)
            elif isinstance(local, bool):  # an unrolled layer
                o = attend(cfg.dense_window if local else UNBOUNDED, q, k, v)
            else:  # a scanned layer: both windows compiled, the layer's run
                local_o, global_o = partial(attend, cfg.dense_window), partial(attend, UNBOUNDED)
                o = jax.lax.cond(local, local_o, global_o, q, k, v)
            if self.mode == "prefill":
                fill_ring(ring, k, v, layer, pos_B)
        return out_proj(o.astype(jnp.dtype(cfg.dtype)).reshape(B, T, -1))
