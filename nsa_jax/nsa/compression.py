"""The compressed branch (NSA_SPEC.md "Compressed branch").

Owns phi (block of l keys/values -> one token, `mlp` or `avg`), and causal
attention over the compressed tokens, which also yields the selection-block
scores of every KV group from the same probabilities.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from nsa_jax.kernels import interpret_pallas, resolve_impl
from nsa_jax.kernels.xla import map_query_chunks, masked_softmax
from nsa_jax.nsa.selection import block_scores_from_cmp, num_compressed, select_blocks


def gather_blocks(x_BxTxKxD: jax.Array, l: int, d: int) -> jax.Array:
    """[B, Tc, l, K, D]: compressed token i covers raw tokens [i*d, i*d + l)."""
    Tc = num_compressed(x_BxTxKxD.shape[1], l, d)
    pos_TcxL = jnp.arange(Tc)[:, None] * d + jnp.arange(l)[None, :]
    return x_BxTxKxD[:, pos_TcxL]


class Compressor(nn.Module):
    """phi: l consecutive keys (or values) -> one, per KV head, weights shared across heads.

    `mlp` (the paper's choice): add a learned intra-block position embedding,
    flatten the block, two-layer MLP. `avg`: mean pooling, no parameters.
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
    `impl` (kernels.resolve_impl): `xla` scores query chunks of `query_chunk`
    here; `pallas` runs the fused kernels of kernels/compressed_pallas.py.
    With `select_n`, the second output is select_blocks(scores, lp, select_n, t_T)
    [B, T, K, select_n] instead; `pallas` then scores and selects in one kernel
    (kernels/block_scores_pallas.py), so no probability or score tensor exists.
    """
    B, T, H, Dk = q_BxTxHxDk.shape
    Tc, K, Dv = kc_BxTcxKxDk.shape[1], kc_BxTcxKxDk.shape[2], vc_BxTcxKxDv.shape[3]
    n_blocks = -(-T // lp)
    scale = Dk**-0.5 if scale is None else scale

    def finish(o, scores):
        return o, (scores if select_n is None else select_blocks(scores, lp, select_n, t_T))

    if Tc == 0:
        return finish(jnp.zeros((B, T, H, Dv), q_BxTxHxDk.dtype), jnp.zeros((B, T, K, n_blocks), jnp.float32))
    if resolve_impl(impl) == "pallas":
        from nsa_jax.kernels import block_scores_pallas as bsp

        args, kw = (
            (q_BxTxHxDk, kc_BxTcxKxDk, vc_BxTcxKxDv),
            dict(l=l, d=d, lp=lp, scale=scale, interpret=interpret_pallas()),
        )
        if select_n is None:
            return bsp.compressed_attention_scores_pallas(*args, **kw)
        return bsp.compressed_attention_select_pallas(*args, n=select_n, t_T=t_T, **kw)
    end_Tc = jnp.arange(Tc, dtype=jnp.int32) * d + l - 1

    def body(start, q_BxCxHxDk):
        C = q_BxCxHxDk.shape[1]
        t_C = start + jnp.arange(C, dtype=jnp.int32)
        qg = q_BxCxHxDk.reshape(B, C, K, H // K, Dk)
        s = jnp.einsum("bckgd,bikd->bckgi", qg, kc_BxTcxKxDk, preferred_element_type=jnp.float32) * scale
        visible = (end_Tc[None, :] <= t_C[:, None])[None, :, None, None, :]
        p = masked_softmax(s, visible)
        o = jnp.einsum(
            "bckgi,bikd->bckgd", p.astype(vc_BxTcxKxDv.dtype), vc_BxTcxKxDv, preferred_element_type=jnp.float32
        )
        p_group = jax.lax.stop_gradient(jnp.sum(p, axis=3))  # GQA sharing, Eq. 10
        scores = block_scores_from_cmp(p_group, n_blocks, l, d, lp)
        return o.reshape(B, C, H, Dv).astype(q_BxTxHxDk.dtype), scores

    o, scores = map_query_chunks(body, query_chunk, q_BxTxHxDk)
    return finish(o, jax.lax.stop_gradient(scores))
