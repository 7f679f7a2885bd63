"""Tile math shared by the Pallas selection and window attention kernels.

Both kernel families are flash attention over different key sets: a program
holds a tile of query rows and walks key tiles picked by a block index
(selection) or by a sliding window (window). Which keys a tile covers, and so
its visibility mask, is each family's own business. This module owns what is
the same once a tile is loaded and its mask is known:

* the log2-domain conventions (``LOG2E``, ``MASK_VALUE``) and the tile's
  scores ``scores_log2``;
* the forward online softmax: ``online_softmax_init``, one
  ``online_softmax_step`` per key tile, and ``online_softmax_finish``, which
  gives the output and the log-sum-exp (base 2) the backward reuses;
* the backward of one tile, ``softmax_grad_tile``: the probabilities
  recomputed from that log-sum-exp and the gradient of the scores.

The functions take and return arrays (never refs) and are traced into the
calling kernel, so they add no kernel launch and no memory traffic. Shape
suffixes: R query rows of the tile, C keys of the tile, Dk / Dv head dims.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu_triton

# Scores live in the log2 domain (exp2 is the cheap instruction).
LOG2E = math.log2(math.e)
# Finite "minus infinity": masked logits and the running max start here, so
# an all-masked row never produces inf - inf.
MASK_VALUE = -1e30


def scores_log2(q_RxDk, k_CxDk, scale_log2: float):
    """``q k^T * scale`` in log2 units (``scale_log2 = scale * LOG2E``), fp32 [R, C]."""
    return plgpu_triton.dot(q_RxDk, k_CxDk, trans_b=True) * scale_log2


def online_softmax_init(rows: int, dv: int):
    """(acc [R, Dv], running max m [R], running sum l [R]) before the first key tile."""
    return (
        jnp.zeros((rows, dv), jnp.float32),
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )


def online_softmax_step(carry, q_RxDk, k_CxDk, v_CxDv, vis_RxC, scale_log2: float):
    """Folds one key tile into the running (acc, m, l); ``vis_RxC`` may be [1, C] (one mask for all rows)."""
    acc_RxDv, m_R, l_R = carry
    s_RxC = jnp.where(vis_RxC, scores_log2(q_RxDk, k_CxDk, scale_log2), MASK_VALUE)
    m_new_R = jnp.maximum(m_R, jnp.max(s_RxC, axis=1))
    alpha_R = jnp.exp2(m_R - m_new_R)
    # The explicit where keeps fully masked rows at exactly zero weight.
    p_RxC = jnp.where(vis_RxC, jnp.exp2(s_RxC - m_new_R[:, None]), 0.0)
    l_R = l_R * alpha_R + jnp.sum(p_RxC, axis=1)
    acc_RxDv = acc_RxDv * alpha_R[:, None] + plgpu_triton.dot(p_RxC.astype(v_CxDv.dtype), v_CxDv)
    return acc_RxDv, m_new_R, l_R


def online_softmax_finish(carry):
    """(o [R, Dv] fp32, lse [R] base 2) of the walk; a row that saw no key gets o = 0 and lse = 0."""
    acc_RxDv, m_R, l_R = carry
    seen_R = l_R > 0.0
    l_safe_R = jnp.where(seen_R, l_R, 1.0)
    return acc_RxDv / l_safe_R[:, None], jnp.where(seen_R, m_R + jnp.log2(l_safe_R), 0.0)


def softmax_grad_tile(q_RxDk, k_CxDk, v_CxDv, do_RxDv, lse_R, delta_R, vis_RxC, scale_log2: float):
    """(P, dS) of one tile, fp32 [R, C], for the backward kernels.

    P is recomputed from the forward's log-sum-exp instead of stored (no T x T
    matrix). dS = P * (dO V^T - delta), with delta = rowsum(dO * O), is the
    gradient of the logits ``scale * q k^T``; the callers' dQ / dK sums take
    the remaining factor ``scale`` once, at the end.
    """
    s_RxC = scores_log2(q_RxDk, k_CxDk, scale_log2)
    p_RxC = jnp.where(vis_RxC, jnp.exp2(s_RxC - lse_R[:, None]), 0.0)
    dp_RxC = plgpu_triton.dot(do_RxDv, v_CxDv, trans_b=True)
    return p_RxC, p_RxC * (dp_RxC - delta_R[:, None])
