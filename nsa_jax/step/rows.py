"""The batch record the train step and held-out evaluation both read (`Rows`), laid out once.

`lay_out_rows` turns token rows [..., b, T+1] into inputs, targets, loss weights
(data/targets.py), the answer mask and the RoPE positions (train.rope_positions) of
each group of b rows, then pads them to T' and puts them in device order for the
sequence layout (nsa/context.py; T' = T and nothing moves without context
parallelism). Weights and positions are functions of whole rows, so they are made
before the layout; padding carries weight 0 and no answer. Every array then splits
over the mesh the same way (`ROWS_SPEC`: rows over `data`, positions over `seq`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from nsa_jax.config import Config
from nsa_jax.data.targets import answer_mask, loss_weights
from nsa_jax.mesh import DATA, SEQ
from nsa_jax.nsa.context import SeqLayout
from nsa_jax.step.positions import random_rope_positions


class Rows(NamedTuple):
    """Laid-out rows [..., b, T'] (rope: [..., T'], one per group of rows; None: positions 0..T-1)."""

    inputs: jax.Array  # int32
    targets: jax.Array  # int32
    weights: jax.Array  # fp32, 0 on padding
    answers: jax.Array | None  # bool: the positions whose greedy hits are the retrieval accuracy
    rope: jax.Array | None  # int32 RoPE positions


def lay_out_rows(
    tokens_Gxbx1T: jax.Array, cfg: Config, layout: SeqLayout | None, *, rope_positions: int = 0, answers: bool = False
) -> Rows:
    """Rows of tokens [..., b, T+1] (any leading group axes; a group shares its RoPE positions, drawn
    by train.rope_positions = `rope_positions`; 0: none). `answers`: make the answer mask too."""
    lead, (b, T1) = tokens_Gxbx1T.shape[:-2], tokens_Gxbx1T.shape[-2:]

    def group(tokens_bxT1):
        inputs_bxT, targets_bxT = tokens_bxT1[:, :-1], tokens_bxT1[:, 1:]
        weights = loss_weights(tokens_bxT1, cfg)
        weights = jnp.ones(targets_bxT.shape, jnp.float32) if weights is None else weights.astype(jnp.float32)
        answer = answer_mask(tokens_bxT1, cfg) if answers else None
        if answers and answer is None:
            answer = jnp.zeros(targets_bxT.shape, bool)
        rope = random_rope_positions(inputs_bxT, rope_positions)
        return Rows(inputs_bxT, targets_bxT, weights, answer, rope)

    rows = jax.vmap(group)(tokens_Gxbx1T.reshape(-1, b, T1))
    if layout is not None:  # positions are the last axis of every field
        rows = jax.tree.map(lambda x: layout.lay_out(x, x.ndim - 1), rows)
    return jax.tree.map(lambda x: x.reshape(*lead, *x.shape[1:]), rows)


def rows_spec(rows: Rows, lead: int) -> Rows:
    """The PartitionSpec of each field of `rows` with `lead` unsplit leading axes: the row axis over
    `data` (RoPE positions: their group axis), positions over `seq`."""
    spec = P(*([None] * lead), DATA, SEQ)
    return jax.tree.map(lambda _: spec, rows)


def denominators(rows: Rows) -> jax.Array:
    """[...] each group's loss denominator: max(sum of its weights, 1), as model.cross_entropy's."""
    return jnp.maximum(jnp.sum(rows.weights, axis=(-2, -1)), 1.0)
