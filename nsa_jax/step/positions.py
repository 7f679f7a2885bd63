"""train.rope_positions: the RoPE positions a training row is given (the train step's loss, step.py).

With train.rope_positions = N > T a micro-batch's rows see positions drawn from [0, N)
instead of 0..T-1, so a short row trains the rotary distances of longer ones
(docs/NSA.md). A pure function of the tokens, traced inside the jitted step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Pieces a row is cut into by train.rope_positions. Few cuts keep almost every token's
# neighbours at distance 1 as evaluation sees them: T distinct positions drawn uniformly
# from [0, N) (gaps of N/T between neighbours) left the loss at contiguous positions at
# 1.65-2.36 where the training loss was 0.56-1.23 (docs/LONG_CONTEXT.md).
ROPE_PIECES = 4


def random_rope_positions(inputs_BxT: jax.Array, n: int) -> jax.Array | None:
    """train.rope_positions: RoPE positions [T] in [0, n) for a micro-batch, or None (0..T-1) when n <= T.

    The row's tokens keep their order and sit as ROPE_PIECES contiguous pieces (cut at
    random indices) with random gaps between them, the n - T spare positions split at
    random among the gaps and the offset of the first piece: the distances between far
    tokens spread over [0, n) while neighbours stay at distance 1. The draw is keyed by
    the micro-batch's tokens, so it needs no random state in the train state and a
    resumed run draws what the uninterrupted one drew.
    """
    T = inputs_BxT.shape[1]
    if n <= T:
        return None
    seed = jnp.sum(inputs_BxT.astype(jnp.uint32) * (jnp.arange(T, dtype=jnp.uint32) * jnp.uint32(2654435761) + 1))
    k_cut, k_gap = jax.random.split(jax.random.key(seed))
    cuts_J = jax.random.randint(k_cut, (ROPE_PIECES - 1,), 1, T)
    # The spare positions split into ROPE_PIECES parts (the first: the first piece's offset).
    marks = jnp.sort(jax.random.randint(k_gap, (ROPE_PIECES - 1,), 0, n - T + 1))
    gaps_P = jnp.diff(jnp.concatenate([jnp.zeros(1, marks.dtype), marks, jnp.full(1, n - T, marks.dtype)]))
    t_T = jnp.arange(T)
    shift_T = gaps_P[0] + jnp.sum(jnp.where(t_T[:, None] >= cuts_J[None, :], gaps_P[None, 1:], 0), axis=1)
    return (t_T + shift_T).astype(jnp.int32)
