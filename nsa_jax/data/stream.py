"""The batch-stream interface every dataset implements, and its shared checks.

A stream is an iterator of int32 [batch, seq_len + 1] arrays with a JSON-serialisable
`get_state()` and an exact `set_state()`. The state records the dataset kind, split and
process index, so restoring a state from a different stream fails loudly instead of
silently reading other data.
"""

from __future__ import annotations

from typing import Any

import numpy as np

SPLITS = ("train", "val")


def split_id(split: str) -> int:
    """A small integer per split, mixed into seeds so train and val never share a stream."""
    if split not in SPLITS:
        raise ValueError(f"data split must be one of {', '.join(SPLITS)}; got {split!r}")
    return SPLITS.index(split)


class BatchStream:
    """Base of all datasets returned by `make_dataset`."""

    kind = "base"
    split = "train"
    process_index = 0

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def get_state(self) -> dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError

    def set_state(self, state: dict[str, Any]) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def close(self) -> None:
        """Stops background work, if any."""


def check_state(stream: BatchStream, state: dict[str, Any]) -> None:
    """Raises ValueError when `state` was saved by a different kind/split/process stream."""
    if not isinstance(state, dict):
        raise ValueError(f"data state must be a dict from get_state(), got {type(state).__name__}")
    for key in ("kind", "split", "process_index"):
        want = getattr(stream, key)
        got = state.get(key)
        if got != want:
            raise ValueError(
                f"data state has {key}={got!r} but this dataset has {key}={want!r}; "
                "restore with the same data.dataset, split and process layout it was saved with"
            )
