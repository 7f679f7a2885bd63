"""The arithmetic of a sequence split over devices (parallel.context; nsa/context.py runs it in jax).

A sequence of T tokens over C devices is padded at its end to T' = 2 C S and cut into
2C chunks of S tokens, S a multiple of lcm(l, lp) (`chunk_len`), so every chunk starts on
a compression stride and a selection block; device i holds chunks i and 2C-1-i
(`device_order`). Config validation asks `split_problem` whether T can be split at all.
No jax: the shell checks a config before jax starts.
"""

from __future__ import annotations

import math

import numpy as np


def chunk_len(T: int, C: int, l: int, lp: int) -> int:
    """S: tokens per chunk when T tokens are cut into 2C chunks (the last padded), a multiple of lcm(l, lp)."""
    m = math.lcm(l, lp)
    return -(-T // (2 * C * m)) * m


def split_problem(T: int, C: int, l: int, lp: int) -> str | None:
    """Why T tokens cannot be split over C devices (one config error line), or None.

    Chunk C-1 must hold a real token: it is the first chunk of the last device, which
    would otherwise hold padding only.
    """
    if (C - 1) * chunk_len(T, C, l, lp) < T:
        return None
    m = math.lcm(l, lp)
    return (
        f"train.seq_len ({T}) is too short to split over parallel.context={C} devices: the sequence is cut into "
        f"{2 * C} chunks of whole blocks (multiples of lcm(l, lp) = {m} tokens) and a device would hold padding "
        f"only; set train.seq_len to at least {(C - 1) * m + 1} (best a multiple of {2 * C * m}) or a smaller "
        "parallel.context"
    )


def device_order(C: int) -> np.ndarray:
    """[2C] chunk ids in the order the devices hold them: 0, 2C-1, 1, 2C-2, ... (device i: i, 2C-1-i)."""
    return np.asarray([c for i in range(C) for c in (i, 2 * C - 1 - i)], np.int32)


def natural_slots(C: int) -> np.ndarray:
    """[2C]: where chunk c sits in device order (the inverse permutation of device_order)."""
    return np.argsort(device_order(C)).astype(np.int32)
