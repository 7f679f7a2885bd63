"""Checkpoint checksums: one number per array of a train state, one per JSON item.

Every array's checksum is the wrapping uint32 sum of its elements' bit patterns times
odd position weights (i * 2654435761 | 1). Computed on the device by one jitted
function of the whole state, so it costs one pass over memory, works for sharded
arrays and gives the same value on any mesh (a global reduction). An odd weight is
invertible mod 2**32, so any change of one element changes the sum. The data and
config items are JSON: their checksum is the sha256 of their canonical text.

A save (checkpoint.py) records them in the step's `checksums` item
({"format": CHECKSUM_FORMAT, "state": {array path: uint32}, "data", "config"}); a
restore recomputes them and `verify_checksums` raises ChecksumError naming the arrays that differ.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

CHECKSUM_FORMAT = 1

_GOLDEN = 2654435761  # odd weights (i * _GOLDEN) | 1, i the element's flat position
_CHUNK = 1 << 16  # host path: elements per chunk, so the temporaries stay in cache


def _bits_u32(x, xp):
    """The elements of `x` as uint32 bit patterns (8-byte types as two words), flat."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    size = np.dtype(x.dtype).itemsize
    if xp is np:
        x = np.ascontiguousarray(x)
        view = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}[size]
        return x.reshape(-1).view(view)
    if x.dtype == jnp.bool_:
        return x.reshape(-1).astype(jnp.uint32)
    view = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[size]
    return jax.lax.bitcast_convert_type(x, view).reshape(-1).astype(jnp.uint32)


_STEPS = np.arange(_CHUNK, dtype=np.uint32) * np.uint32(_GOLDEN)


def _host_checksum(u: np.ndarray) -> int:
    """sum((u_i * ((i * _GOLDEN) | 1)) mod 2**32, chunk by chunk (the same number as the device path)."""
    total = 0
    w = np.empty(_CHUNK, np.uint32)
    for start in range(0, u.size, _CHUNK):
        part = u[start : start + _CHUNK]
        n = part.size
        np.add(_STEPS[:n], np.uint32((start * _GOLDEN) % 2**32), out=w[:n])
        np.bitwise_or(w[:n], np.uint32(1), out=w[:n])
        np.multiply(w[:n], part, out=w[:n], casting="unsafe")
        total = (total + int(w[:n].sum(dtype=np.uint32))) & 0xFFFFFFFF
    return total


def _array_checksum(x, xp=jnp):
    u = _bits_u32(x, xp)
    if xp is np:
        return _host_checksum(u)
    w = (jax.lax.iota(jnp.uint32, u.size) * jnp.uint32(_GOLDEN)) | jnp.uint32(1)
    return jnp.sum(u * w, dtype=jnp.uint32)


_tree_checksums = jax.jit(lambda tree: jax.tree.map(_array_checksum, tree))


def state_checksums(state) -> dict[str, int]:
    """{array path: checksum} of a train state.

    On the CPU backend with every array whole on each device, numpy reads the arrays in
    place (no copy, no compile); elsewhere one jitted pass over the state runs on the
    devices (compiled once per placement). Both give the same numbers.
    """
    leaves = jax.tree_util.tree_leaves_with_path(state)
    if jax.default_backend() == "cpu" and all(x.is_fully_replicated for _, x in leaves):
        return {jax.tree_util.keystr(k): int(_array_checksum(_host_view(x), np)) for k, x in leaves}
    sums = jax.device_get(_tree_checksums(state))
    return {jax.tree_util.keystr(k): int(v) for k, v in jax.tree_util.tree_leaves_with_path(sums)}


def _host_view(x) -> np.ndarray:
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x.addressable_data(0))


def host_checksums(tree) -> dict[str, int]:
    """The same checksums of host (numpy) arrays."""
    return {
        jax.tree_util.keystr(k): int(_array_checksum(np.asarray(v), np))
        for k, v in jax.tree_util.tree_leaves_with_path(tree)
    }


def json_checksum(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class ChecksumError(ValueError):
    """A restored array or item whose checksum differs from the one recorded at save."""


def verify_checksums(saved: dict[str, int], now: dict[str, int], what: str) -> None:
    """ChecksumError naming up to three arrays whose checksum in `now` differs from `saved`."""
    bad = sorted(k for k in saved.keys() & now.keys() if int(saved[k]) != int(now[k]))
    if bad:
        more = f" (+{len(bad) - 3} more)" if len(bad) > 3 else ""
        raise ChecksumError(f"checksum mismatch in {what} {', '.join(bad[:3])}{more}")


def read_checksums(step_dir: pathlib.Path) -> dict[str, Any] | None:
    """The checksums item of a step directory; None for a checkpoint written before checksums."""
    path = pathlib.Path(step_dir) / "checksums" / "metadata"
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or data.get("format") != CHECKSUM_FORMAT:
        raise ValueError("checksums item has an unknown format")
    return data
