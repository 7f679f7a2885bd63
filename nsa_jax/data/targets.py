"""Which targets of a dataset's rows count, and how much: the loss weights and the answer positions.

The train step (nsa_jax/step/step.py) weights its next-token loss with `loss_weights`
and the held-out evaluation (nsa_jax/evaluation/heldout.py) uses the same weights and
scores its retrieval accuracy on `answer_mask`; neither names a dataset. Both are
functions of the tokens (and the config) alone, traced inside the jitted step.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from nsa_jax.data.kv_recall import kv_answer_mask
from nsa_jax.data.needle import needle_answer_mask


def loss_weights(tokens_BxT1: jax.Array, cfg: Any) -> jax.Array | None:
    """Weight [B, T] of each target in the mean loss, or None for all targets equally.

    kv_recall with data.kv_loss_mask: only the answers (target t where input t - 1 is
    the QUERY marker, id vocab_size - 1; nsa_jax/data/kv_recall.py). The rest of
    such a row is uniform noise that no model can predict, whose gradient only
    drowns the few positions that teach retrieval.
    needle: every target, the pass key's weighted by data.needle_answer_weight. The
    text and the needle's own repeat of the key teach the copy circuit that retrieval
    needs; the key alone (a handful of targets a row) did not (docs/LONG_CONTEXT.md).
    """
    if cfg.data.dataset == "needle":
        answer_BxT = needle_answer_mask(tokens_BxT1, cfg.data)
        return jnp.where(answer_BxT, jnp.float32(cfg.data.needle_answer_weight), jnp.float32(1.0))
    if cfg.data.dataset != "kv_recall" or not cfg.data.kv_loss_mask:
        return None
    return kv_answer_mask(tokens_BxT1, cfg.model.vocab_size)


def answer_mask(tokens_BxT1: jax.Array, cfg: Any) -> jax.Array | None:
    """bool [B, T]: the answer targets whose greedy hits are the retrieval accuracy (kv_recall's
    values, the needle's pass key); None for a dataset without answers."""
    if cfg.data.dataset == "needle":
        return needle_answer_mask(tokens_BxT1, cfg.data)
    if cfg.data.dataset == "kv_recall":
        return kv_answer_mask(tokens_BxT1, cfg.model.vocab_size)
    return None
