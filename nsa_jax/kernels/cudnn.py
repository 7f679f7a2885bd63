"""NSA branches as cuDNN's fused attention (`jax.nn.dot_product_attention`).

A branch that can be written as one call of cuDNN's flash attention is a candidate wherever it is timed
(docs/PERFORMANCE.md). Two can:
* the window branch: causal attention with a left window of w - 1 keys (`local_window_size`); timed on
  the GPU against the Pallas kernel, not run by the layer;
* the compressed branch, regrouped (`compressed_attention_grouped`): query t sees compressed token i iff
  i*d + l - 1 <= t, so the d consecutive queries t = l - 1 + g*d + r (r < d) all see tokens 0..g. Group g
  is then one causal query position over the Tc tokens, and its d positions times the G heads of a KV head
  are d*G query heads of that KV head: causal GQA attention of length Tc with H*d query heads over K,
  exactly the branch's output (queries t < l - 1 see no token: 0). It gives no log-sum-exp, which block
  scoring needs, so with `compressed_kernel: cudnn` the layer pairs it with a Pallas pass that computes
  only that (block_scores_pallas, `attention="cudnn"`; compressed_pallas.compressed_lse_pallas). Queries
  start at position 0: a chunk of queries under a query offset takes the Pallas kernels.

`implementation` is jax's: "cudnn" on a GPU; None or "xla" elsewhere (the CPU tests check the regrouping
with XLA's attention, which holds the [H*d, Tc, Tc] scores).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nsa_jax.kernels.pallas_common import validate_qkv

# The compressed sequence is padded to a multiple of this for the fused kernel (cuDNN's
# training kernels refuse odd lengths; 64 keeps its tiles whole).
SEQ_MULTIPLE = 64


def window_attention_cudnn(q_BxTxHxDk, k_BxTxKxDk, v_BxTxKxDv, window: int, implementation: str | None = "cudnn"):
    """Sliding-window attention (query t sees keys t - w + 1 .. t) as one fused causal attention."""
    return jax.nn.dot_product_attention(
        q_BxTxHxDk,
        k_BxTxKxDk,
        v_BxTxKxDv,
        is_causal=True,
        local_window_size=(window - 1, 0),
        implementation=implementation,
    )


def compressed_attention_grouped(
    q_BxTxHxDk, kc_BxTcxKxDk, vc_BxTcxKxDv, *, l: int, d: int, scale: float | None = None,
    implementation: str | None = "cudnn",
):  # fmt: skip
    """o_BxTxHxDv of the compressed branch as causal attention over the compressed sequence (module docstring).

    q's rows are the positions 0..T-1: there is no query offset. Under one (a context-parallel chunk, row r at
    position r + q_offset, possibly traced) the chunk's first query group stands at compressed position
    (q_offset - l + 1) // d, where a plain causal mask puts token 0; such chunks take the Pallas kernels
    (block_scores_pallas with ``attention="flash"`` and ``q_offset``).
    """
    validate_qkv(q_BxTxHxDk, kc_BxTcxKxDk, vc_BxTcxKxDv, same_length=False)
    B, T, H, Dk = q_BxTxHxDk.shape
    Tc, K, Dv = kc_BxTcxKxDk.shape[1], kc_BxTcxKxDk.shape[2], vc_BxTcxKxDv.shape[3]
    if Dv != Dk:
        raise ValueError(f"fused attention needs the key and value head dims equal, got {Dk} and {Dv}")
    start = l - 1  # the first query that sees a compressed token
    seen = T - start
    if Tc == 0 or seen <= 0:
        return jnp.zeros((B, T, H, Dv), q_BxTxHxDk.dtype)
    if Tc * d < seen:
        raise ValueError(f"{Tc} compressed tokens of stride {d} cover T={T} only if Tc = (T - l) // d + 1")
    G = H // K
    # cuDNN's training kernels take even lengths; groups past Tc (zero queries over zero keys) only
    # see padding, and no real group sees a padded key (causal: group g sees keys 0..g).
    Tp = -(-Tc // SEQ_MULTIPLE) * SEQ_MULTIPLE
    # Queries start .. start + Tp*d - 1, the tail padded: [B, Tp, d, K, G, Dk] -> [B, Tp, K*G*d, Dk],
    # query head (k*G + g)*d + r, so that head n reads KV head n // (G*d) as jax's GQA does.
    q = jnp.pad(q_BxTxHxDk[:, start:], ((0, 0), (0, Tp * d - seen), (0, 0), (0, 0)))
    q = q.reshape(B, Tp, d, K, G, Dk).transpose(0, 1, 3, 4, 2, 5).reshape(B, Tp, K * G * d, Dk)
    kv_pad = ((0, 0), (0, Tp - Tc), (0, 0), (0, 0))
    kc, vc = jnp.pad(kc_BxTcxKxDk, kv_pad), jnp.pad(vc_BxTcxKxDv, kv_pad)
    o = jax.nn.dot_product_attention(q, kc, vc, scale=scale, is_causal=True, implementation=implementation)
    o = o.reshape(B, Tp, K, G, d, Dv).transpose(0, 1, 4, 2, 3, 5).reshape(B, Tp * d, H, Dv)[:, :seen]
    return jnp.pad(o, ((0, 0), (start, 0), (0, 0), (0, 0)))
