"""One NSA attention layer (NSA_SPEC.md "One NSA attention layer").

Owns the projections (shared Q, per-branch K/V), RoPE, the three branches, the
sigmoid gates and the output projection. Branch math lives in compression.py,
selection.py and kernels/; this module wires them and reports statistics:
`intermediates` (block indices, gates; for tests) and `aux` (gate means, gate
entropy, share of selected blocks beyond the window; for training logs).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from nsa_jax.config import ModelConfig
from nsa_jax.kernels import selection_attention, window_attention
from nsa_jax.layers import rope
from nsa_jax.nsa.compression import Compressor, compressed_attention
from nsa_jax.nsa.selection import select_blocks, straight_through_delta

BRANCHES = ("cmp", "slc", "win")


def gate_stats(g_BxTxHx3: jax.Array, idx_BxTxKxN: jax.Array, lp: int, w: int) -> dict[str, jax.Array]:
    """Gate means per branch, mean gate entropy, share of selected blocks beyond the window."""
    g = g_BxTxHx3.astype(jnp.float32)
    probs = g / jnp.maximum(jnp.sum(g, axis=-1, keepdims=True), 1e-9)
    entropy = -jnp.sum(probs * jnp.log(jnp.maximum(probs, 1e-9)), axis=-1)
    T = idx_BxTxKxN.shape[1]
    t = jnp.arange(T)[None, :, None, None]
    used = idx_BxTxKxN >= 0
    # A block lies beyond the window when its last token is before t - w + 1.
    far = used & ((idx_BxTxKxN + 1) * lp <= t - w + 1)
    return {
        "gate_mean": jnp.mean(g, axis=(0, 1, 2)),
        "gate_entropy": jnp.mean(entropy),
        "sel_far_frac": jnp.sum(far) / jnp.maximum(jnp.sum(used), 1),
    }


def gate_bias_init(biases: tuple[float, ...], n_heads: int):
    """Bias initialiser of the last gate Dense: `biases` = [cmp, slc, win] for every head; () gives zeros.

    The Dense's 3H outputs are read as [H, 3] (head-major), so branch i of head h is output 3h + i.
    """
    if not biases:
        return nn.initializers.zeros

    def init(key, shape, dtype=jnp.float32):
        return jnp.tile(jnp.asarray(biases, dtype), n_heads).reshape(shape)

    return init


def selection_warmup_scale(step: jax.Array, warmup_steps: int) -> jax.Array:
    """min(1, step / warmup_steps): 0 at step 0, 1 from step warmup_steps on (1 when warmup_steps is 0)."""
    if warmup_steps <= 0:
        return jnp.float32(1.0)
    return jnp.minimum(jnp.asarray(step, jnp.float32) / warmup_steps, 1.0)


def scale_selection_values(tree, scale: jax.Array):
    """`tree` (params or their gradients) with every `v_slc` leaf multiplied by `scale`.

    The selection branch's output is linear in its values and v_slc has no bias, so
    params with v_slc scaled by r give exactly the model whose selection output is
    multiplied by r (the warm-up, model.nsa.slc_warmup_steps); the gradient of the
    unscaled v_slc is the scaled one's times r (chain rule). The train step applies it;
    this way the step is a traced argument of the compiled step, not a model input.
    """

    def f(path, leaf):
        names = {getattr(p, "key", None) for p in path}
        return leaf * scale.astype(leaf.dtype) if "v_slc" in names else leaf

    return jax.tree_util.tree_map_with_path(f, tree)


class NSAAttention(nn.Module):
    """x[B, T, D] -> NSA attention output [B, T, D]."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BxTxD: jax.Array, positions_T: jax.Array | None = None) -> jax.Array:
        cfg, a = self.cfg, self.cfg.nsa
        B, T, D = x_BxTxD.shape
        H, K, Dk, Dv = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.v_head_dim
        dtype = jnp.dtype(cfg.dtype)
        init = nn.initializers.normal(cfg.init_std)
        out_init = nn.initializers.normal(cfg.init_std / (2 * cfg.n_layers) ** 0.5)
        positions_T = jnp.arange(T, dtype=jnp.int32) if positions_T is None else positions_T

        def proj(name, heads, dim):
            y = nn.Dense(heads * dim, use_bias=False, dtype=dtype, kernel_init=init, name=name)(x_BxTxD)
            return y.reshape(B, T, heads, dim)

        q = rope(proj("q", H, Dk), positions_T, cfg.rope_theta)
        k_cmp = rope(proj("k_cmp", K, Dk), positions_T, cfg.rope_theta)
        v_cmp = proj("v_cmp", K, Dv)
        k_slc = rope(proj("k_slc", K, Dk), positions_T, cfg.rope_theta)
        v_slc = proj("v_slc", K, Dv)
        k_win = rope(proj("k_win", K, Dk), positions_T, cfg.rope_theta)
        v_win = proj("v_win", K, Dv)

        gh = nn.Dense(a.gate_hidden, dtype=dtype, kernel_init=init, name="gate_fc1")(x_BxTxD)
        g = nn.Dense(
            3 * H,
            dtype=dtype,
            kernel_init=nn.initializers.zeros if a.gate_zero_kernel else init,
            bias_init=gate_bias_init(a.gate_bias_init, H),
            name="gate_fc2",
        )(nn.silu(gh))
        g_BxTxHx3 = jax.nn.sigmoid(g.astype(jnp.float32)).reshape(B, T, H, 3)

        def compressor(name):
            return Compressor(a.l, a.d, a.cmp_phi, a.cmp_mlp_hidden, dtype=dtype, init_std=cfg.init_std, name=name)

        with jax.named_scope("nsa_cmp"):
            kc = compressor("cmp_k")(k_cmp)
            vc = compressor("cmp_v")(v_cmp)
            o_cmp, scores = compressed_attention(
                q, kc, vc, l=a.l, d=a.d, lp=a.lp, query_chunk=a.query_chunk, impl=a.attention_impl
            )
        outputs = {"cmp": o_cmp}
        idx = None
        if "slc" in a.branches:
            with jax.named_scope("nsa_slc"):
                idx = select_blocks(scores, a.lp, a.n, positions_T - positions_T[0])
                outputs["slc"] = selection_attention(
                    q, k_slc, v_slc, idx, a.lp, impl=a.attention_impl, query_chunk=a.query_chunk
                )
                if a.slc_straight_through:
                    delta = straight_through_delta(
                        q, kc, k_slc, v_slc, idx, l=a.l, d=a.d, lp=a.lp, query_chunk=a.query_chunk
                    )
                    outputs["slc"] = outputs["slc"] + delta.astype(outputs["slc"].dtype)
        if "win" in a.branches:
            with jax.named_scope("nsa_win"):
                outputs["win"] = window_attention(
                    q, k_win, v_win, a.w, impl=a.attention_impl, query_chunk=a.query_chunk
                )

        o = jnp.zeros((B, T, H, Dv), jnp.float32)
        for i, name in enumerate(BRANCHES):
            if name in a.branches:
                o = o + g_BxTxHx3[..., i : i + 1] * outputs[name].astype(jnp.float32)
        if idx is not None:
            self.sow("intermediates", "block_idx", idx)
            self.sow("aux", "stats", gate_stats(g_BxTxHx3, idx, a.lp, a.w))
        self.sow("intermediates", "gates", g_BxTxHx3)
        o = o.astype(dtype).reshape(B, T, H * Dv)
        return nn.Dense(D, use_bias=False, dtype=dtype, kernel_init=out_init, name="o")(o)
