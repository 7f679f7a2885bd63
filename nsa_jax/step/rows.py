"""The batch record the train step and held-out evaluation both read (`Rows`), laid out once.

`lay_out_rows` turns a batch's rows [..., b, T+1] (tokens, or data/targets.LabeledRows with
their own weights) into inputs, targets, loss weights and the answer mask (data/targets.py
row_targets) and the RoPE positions (train.rope_positions) of
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
from nsa_jax.data.targets import batch_tokens, row_targets
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
    batch_Gxbx1T, cfg: Config, layout: SeqLayout | None, *, rope_positions: int = 0, answers: bool = False
) -> Rows:
    """Rows of a batch [..., b, T+1] (tokens or LabeledRows; any leading group axes; a group shares
    its RoPE positions, drawn by train.rope_positions = `rope_positions`; 0: none). `answers`: make
    the answer mask too."""
    tokens = batch_tokens(batch_Gxbx1T)
    lead, b = tokens.shape[:-2], tokens.shape[-2]

    def group(batch_bxT1):
        tokens_bxT1, weights, answer = row_targets(batch_bxT1, cfg)
        inputs_bxT, targets_bxT = tokens_bxT1[:, :-1], tokens_bxT1[:, 1:]
        if not answers:
            answer = None
        elif answer is None:
            answer = jnp.zeros(targets_bxT.shape, bool)
        rope = random_rope_positions(inputs_bxT, rope_positions)
        return Rows(inputs_bxT, targets_bxT, weights, answer, rope)

    rows = jax.vmap(group)(jax.tree.map(lambda x: x.reshape(-1, b, x.shape[-1]), batch_Gxbx1T))
    if layout is not None:  # positions are the last axis of every field
        rows = jax.tree.map(lambda x: layout.lay_out(x, x.ndim - 1), rows)
    return jax.tree.map(lambda x: x.reshape(*lead, *x.shape[1:]), rows)


def split_rows(batch_AxBx, n_devices: int):
    """A batch [A, B, ...] (tokens or LabeledRows) viewed as [A, D, B / D, ...]: each device's rows."""
    return jax.tree.map(lambda x: x.reshape(x.shape[0], n_devices, x.shape[1] // n_devices, *x.shape[2:]), batch_AxBx)


def rows_spec(rows: Rows, lead: int) -> Rows:
    """The PartitionSpec of each field of `rows` with `lead` unsplit leading axes: the row axis over
    `data` (RoPE positions: their group axis), positions over `seq`."""
    spec = P(*([None] * lead), DATA, SEQ)
    return jax.tree.map(lambda _: spec, rows)


def denominators(rows: Rows) -> jax.Array:
    """[...] each group's loss denominator: max(sum of its weights, 1), as model.cross_entropy's."""
    return jnp.maximum(jnp.sum(rows.weights, axis=(-2, -1)), 1.0)
