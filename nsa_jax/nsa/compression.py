"""The compressed branch (docs/NSA.md "Compressed branch").

Owns phi (block of l keys/values -> one token: `avg` or `mlp`). Causal attention
over the compressed tokens, which also yields the selection blocks, is
kernels.compressed_attention.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from nsa_jax.kernels.xla import num_compressed


def gather_blocks(x_BxTxKxD: jax.Array, l: int, d: int) -> jax.Array:
    """[B, Tc, l, K, D]: compressed token i covers raw tokens [i*d, i*d + l)."""
    Tc = num_compressed(x_BxTxKxD.shape[1], l, d)
    pos_TcxL = jnp.arange(Tc)[:, None] * d + jnp.arange(l)[None, :]
    return x_BxTxKxD[:, pos_TcxL]


class Compressor(nn.Module):
    """phi: l consecutive keys (or values) -> one, per KV head, weights shared across heads.

    `mlp` (the paper's choice): add a learned intra-block position embedding,
    flatten the block, two-layer MLP. `avg` (the default): mean pooling, no parameters.
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
        return nn.Dense(D, use_bias=False, dtype=self.dtype, kernel_init=init, name="fc2")(h)
