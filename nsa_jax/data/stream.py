"""The batch-stream interface every dataset implements, and its shared checks.

A stream is an iterator of int32 [batch, seq_len + 1] arrays with a JSON-serialisable
`get_state()` and an exact `set_state()`. The state records the dataset kind and split
(and, for streams that read a shard per process, the process index), so restoring a
state from a different stream fails loudly instead of silently reading other data.
`GlobalRowStream` (synthetic, kv_recall, tokenized) numbers rows over the whole run, so
its state is the same on every process and carries over to another process count.
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


def check_state(
    stream: BatchStream, state: dict[str, Any], keys: tuple[str, ...] = ("kind", "split", "process_index")
) -> None:
    """Raises ValueError when `state` was saved by a different kind/split/process stream."""
    if not isinstance(state, dict):
        raise ValueError(f"data state must be a dict from get_state(), got {type(state).__name__}")
    for key in keys:
        want = getattr(stream, key)
        got = state.get(key)
        if got != want:
            raise ValueError(
                f"data state has {key}={got!r} but this dataset has {key}={want!r}; "
                "restore with the same data.dataset, split and process layout it was saved with"
            )


class GlobalRowStream(BatchStream):
    """A stream whose rows are numbered over the whole run, not per process (synthetic, kv_recall, tokenized).

    The stream is a sequence of rows 0, 1, 2, ...; block k (rows [k * R, (k + 1) * R),
    R = `block_rows` = train.global_batch x train.accumulate, the rows of one optimizer
    step) is a pure function of (seed, split, k), drawn by `_make_block` (a stream that
    reaches any row directly, such as tokenized, overrides `rows` instead). A micro-batch
    is the next train.global_batch rows G of the stream, and process p of P reads rows
    [p * G / P, (p + 1) * G / P) of it; devices then split those in order. So optimizer
    step s consumes rows [s * R, (s + 1) * R) whatever the process count, device count
    or the split of R into micro-batches, and the state is one global row count: a
    checkpoint resumes on any layout with the same R (nsa_jax/rundir/checkpoint.py).

    States written before this layout count micro-batches of one process
    ({"process_index", "position"}); `set_state` reads them as position x G rows
    ("micro_rows": the G they were saved with, when it differs).
    """

    global_batch = 1
    block_rows = 1
    process_count = 1

    def _init_rows(self, global_batch: int, process_index: int, process_count: int, block_rows: int) -> None:
        if global_batch % process_count:
            raise ValueError(
                f"train.global_batch ({global_batch}) is not divisible by the process count ({process_count})"
            )
        self.global_batch, self.block_rows = int(global_batch), int(block_rows)
        self.process_index, self.process_count = int(process_index), int(process_count)
        self.batch = self.global_batch // self.process_count
        self.row = 0  # the next global row of the stream
        self._cached: tuple[int, Any] | None = None

    def _make_block(self, k: int) -> Any:  # pragma: no cover - abstract
        """Rows [k * block_rows, (k + 1) * block_rows): an array or a tuple of arrays, rows first."""
        raise NotImplementedError

    def _block(self, k: int) -> Any:
        if self._cached is None or self._cached[0] != k:
            self._cached = (k, self._make_block(k))
        return self._cached[1]

    def rows(self, start: int, stop: int) -> Any:
        """Global rows [start, stop) of the stream."""
        R, parts = self.block_rows, []
        while start < stop:
            k, lo = divmod(start, R)
            hi = min(R, lo + stop - start)
            parts.append(_take_rows(self._block(k), lo, hi))
            start += hi - lo
        return parts[0] if len(parts) == 1 else _concat_rows(parts)

    def local_rows_at(self, position: int) -> Any:
        """This process's rows of micro-batch `position` (random access)."""
        start = int(position) * self.global_batch + self.process_index * self.batch
        return self.rows(start, start + self.batch)

    def _next_local(self) -> Any:
        start = self.row + self.process_index * self.batch
        out = self.rows(start, start + self.batch)
        self.row += self.global_batch
        return out

    def get_state(self) -> dict[str, Any]:
        return {"kind": self.kind, "split": self.split, "rows": self.row, "block_rows": self.block_rows}

    def set_state(self, state: dict[str, Any]) -> None:
        check_state(self, state, keys=("kind", "split"))
        if "rows" not in state:
            check_state(self, state)  # a per-process state: its own process only
            self.row = int(state["position"]) * int(state.get("micro_rows", self.global_batch))
            return
        if int(state.get("block_rows", self.block_rows)) != self.block_rows:
            raise ValueError(
                f"data state was saved with {state['block_rows']} rows per optimizer step and this run has "
                f"{self.block_rows} (train.global_batch x train.accumulate); resume with the same product"
            )
        self.row = int(state["rows"])


def _take_rows(block: Any, lo: int, hi: int) -> Any:
    if isinstance(block, tuple):
        return type(block)(*(f[lo:hi] for f in block))
    return block[lo:hi]


def _concat_rows(parts: list) -> Any:
    if isinstance(parts[0], tuple):
        return type(parts[0])(*(np.concatenate(fs) for fs in zip(*parts)))
    return np.concatenate(parts)
