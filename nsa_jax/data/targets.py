"""Which targets of a dataset's rows count, and how much: the loss weights and the answer positions.

A dataset yields a micro-batch's rows as plain tokens [B, T + 1] int32 (every target weighs 1) or,
when it knows its rows' targets as it makes them, as `LabeledRows` (tokens, each target's loss
weight, the answer targets): the needle's pass key, a fine-tune's answer after its prompt
(data/reviews.py). The weights then travel on the input path beside the tokens, through the
mesh placement and the step's reshapes (one pytree), and nothing inside the jitted step needs a
tokenizer. `row_targets` is what the train step (nsa_jax/step/rows.py) and the held-out
evaluation (nsa_jax/evaluation/heldout.py) read; neither names a dataset. kv_recall's answers
are a function of its tokens alone (the QUERY marker), made here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from nsa_jax.data.kv_recall import kv_answer_mask

if TYPE_CHECKING:  # the launcher imports the data package before it sets jax's flags
    import jax


class LabeledRows(NamedTuple):
    """Rows with their own targets' weights ([..., B, T + 1] tokens; [..., B, T] per target)."""

    tokens: Any  # int32 [..., B, T + 1]
    weights: Any  # float32 [..., B, T]: each target's weight in the loss (0: not in it)
    answers: Any  # bool [..., B, T]: the targets whose greedy hits are the retrieval accuracy


def batch_tokens(batch: Any) -> Any:
    """The tokens [..., B, T + 1] of a batch a dataset yielded (plain tokens or LabeledRows)."""
    return batch.tokens if isinstance(batch, LabeledRows) else batch


def labeled(tokens_BxT1: np.ndarray, weights_BxT: np.ndarray, answers_BxT: np.ndarray) -> LabeledRows:
    """LabeledRows in the dtypes every consumer expects, shapes checked."""
    B, T1 = tokens_BxT1.shape
    for name, x in (("weights", weights_BxT), ("answers", answers_BxT)):
        if x.shape != (B, T1 - 1):
            raise ValueError(f"{name} of shape {x.shape} for tokens {tokens_BxT1.shape}: want {(B, T1 - 1)}")
    return LabeledRows(
        np.asarray(tokens_BxT1, np.int32), np.asarray(weights_BxT, np.float32), np.asarray(answers_BxT, bool)
    )


def row_targets(batch_BxT1: Any, cfg: Any) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """(tokens [B, T + 1], loss weights fp32 [B, T], answers bool [B, T] or None) of one group of rows.

    LabeledRows: their own weights and answers. kv_recall: its answers (target t where input t - 1
    is the QUERY marker, id vocab_size - 1; nsa_jax/data/kv_recall.py), with data.kv_loss_mask the
    only targets in the loss: the rest of such a row is uniform noise that no model can predict,
    whose gradient only drowns the few positions that teach retrieval. Anything else: every target
    weighs 1, no answers.
    """
    import jax.numpy as jnp  # noqa: PLC0415 - launch.train imports this module before XLA_FLAGS is final

    if isinstance(batch_BxT1, LabeledRows):
        return batch_BxT1.tokens, batch_BxT1.weights.astype(jnp.float32), batch_BxT1.answers
    tokens = batch_BxT1
    ones = jnp.ones((*tokens.shape[:-1], tokens.shape[-1] - 1), jnp.float32)
    if cfg.data.dataset != "kv_recall":
        return tokens, ones, None
    answers = kv_answer_mask(tokens, cfg.model.vocab_size)
    return tokens, answers.astype(jnp.float32) if cfg.data.kv_loss_mask else ones, answers
