"""The compressed branch (docs/NSA.md "Compressed branch").

Owns phi (block of l keys/values -> one token: `mlp`, `mlp_norm`, `avg_mlp` or `avg`), and causal
attention over the compressed tokens, which also yields the selection-block
scores of every KV group from the same probabilities.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from nsa_jax import kernels
from nsa_jax.nsa.selection import num_compressed


def gather_blocks(x_BxTxKxD: jax.Array, l: int, d: int) -> jax.Array:
    """[B, Tc, l, K, D]: compressed token i covers raw tokens [i*d, i*d + l)."""
    Tc = num_compressed(x_BxTxKxD.shape[1], l, d)
    pos_TcxL = jnp.arange(Tc)[:, None] * d + jnp.arange(l)[None, :]
    return x_BxTxKxD[:, pos_TcxL]


class Compressor(nn.Module):
    """phi: l consecutive keys (or values) -> one, per KV head, weights shared across heads.

    `mlp` (the paper's choice): add a learned intra-block position embedding,
    flatten the block, two-layer MLP. `mlp_norm`: the same MLP, its output rescaled
    per compressed token to the RMS of the l raw tokens it summarises. `avg_mlp`: mean
    pooling plus that MLP (its output layer starts at zero, so phi starts as the mean),
    the sum rescaled as in `mlp_norm`. `avg`: mean pooling, no parameters.
    """

    l: int
    d: int
    phi: str
    hidden: int
    dtype: jnp.dtype = jnp.float32
    init_std: float = 0.02

    @nn.compact
    def __call__(self, x_BxTxKxD: jax.Array) -> jax.Array:
        D = x_BxTxKxD.shape[-1]
        blocks_BxTcxLxKxD = gather_blocks(x_BxTxKxD, self.l, self.d)
        if self.phi == "avg":
            return jnp.mean(blocks_BxTcxLxKxD.astype(jnp.float32), axis=2).astype(x_BxTxKxD.dtype)
        init = nn.initializers.normal(self.init_std)
        pos_LxD = self.param("pos", init, (self.l, D), jnp.float32)
        x = blocks_BxTcxLxKxD + pos_LxD[None, None, :, None, :].astype(x_BxTxKxD.dtype)
        B, Tc, L, K, _ = x.shape
        x_BxTcxKxLD = jnp.moveaxis(x, 2, 3).reshape(B, Tc, K, L * D)
        h = nn.Dense(self.hidden, dtype=self.dtype, kernel_init=init, name="fc1")(x_BxTcxKxLD)
        h = nn.gelu(h)
        # No output bias: a bias on compressed keys shifts every score of a query
        # equally, which softmax ignores, so it could never learn.
        # avg_mlp: the MLP is a correction to the mean, absent at init, so block scores
        # mean something from step 0 (a random MLP's do not).
        fc2_init = nn.initializers.zeros if self.phi == "avg_mlp" else init
        out_BxTcxKxD = nn.Dense(D, use_bias=False, dtype=self.dtype, kernel_init=fc2_init, name="fc2")(h)
        if self.phi == "avg_mlp":
            out_BxTcxKxD = out_BxTcxKxD + jnp.mean(blocks_BxTcxLxKxD, axis=2).astype(out_BxTcxKxD.dtype)
        if self.phi in ("mlp_norm", "avg_mlp"):
            # The MLP picks the direction, the projections set the size: unbounded, its
            # output starts 20x below the keys it summarises and on kv_recall grows to
            # 30-180x above them (docs/EXPERIMENTS.md, fourth round).
            out = out_BxTcxKxD.astype(jnp.float32)
            blk_rms = jnp.sqrt(jnp.mean(jnp.square(blocks_BxTcxLxKxD.astype(jnp.float32)), axis=(2, 4)))
            out_rms = jnp.sqrt(jnp.mean(jnp.square(out), axis=-1) + 1e-12)
            out_BxTcxKxD = (out * (blk_rms / out_rms)[..., None]).astype(out_BxTcxKxD.dtype)
        return out_BxTcxKxD


def compressed_attention(
    q_BxTxHxDk: jax.Array,
    kc_BxTcxKxDk: jax.Array,
    vc_BxTcxKxDv: jax.Array,
    *,
    l: int,
    d: int,
    lp: int,
    scale: float | None = None,
    query_chunk: int = 512,
    impl: str = "xla",
    select_n: int | None = None,
    t_T: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Causal attention over compressed tokens, and the selection-block scores (or blocks).

    Query t sees compressed token i iff i*d + l - 1 <= t; a query that sees none
    gets 0. Returns o_cmp [B, T, H, Dv] and group block scores [B, T, K, Nb]
    (probabilities summed over the G heads of each group, then over the
    compressed tokens overlapping each selection block; no gradient).
    With `select_n`, the second output is the selected blocks [B, T, K, select_n]
    (select_blocks' contract at positions `t_T`) instead of the scores.
    `impl` (kernels.resolve_impl) picks the implementation: kernels.compressed_attention.
    """
    return kernels.compressed_attention(
        q_BxTxHxDk,
        kc_BxTcxKxDk,
        vc_BxTcxKxDv,
        l=l,
        d=d,
        lp=lp,
        scale=scale,
        impl=impl,
        query_chunk=query_chunk,
        select_n=select_n,
        t_T=t_T,
    )
