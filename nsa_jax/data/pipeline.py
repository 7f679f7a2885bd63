"""grain pipeline for file datasets (fineweb_edu parquet, jsonl, text): `FileDataset`, one process's batches.

  chunks (sources.index_chunks, same list on every process)
    -> this process's chunks: chunks[process_index::process_count]      (disjoint shards)
    -> MapDataset.shuffle(seed).repeat()          (new chunk order every epoch)
    -> random_map(read + val/train filter + shuffle docs + tokenize + EOS) -> 1-D token stream
    -> to_iter_dataset(ReadOptions(num_threads=data.workers))   (0: read in the prefetch thread)
    -> PackRowsIterDataset: concatenate, cut [batch, seq_len + 1] rows  (exact state)
    -> ThreadPrefetchIterDataset(data.prefetch)   (batches built ahead; 0: on the caller's thread)

Every stage has an exact iterator state: `get_state()` after k batches and `set_state()` on a fresh
stream give the same following batches. The state is a small JSON dict (the index of the next chunk to
read, the offset into the token stream of the oldest chunk still buffered), one per process, so a
checkpoint resumes only with the process count that wrote it; the elastic dataset is the prepared-shard
one (nsa_jax/data/tokenized.py), which reuses the stages after the chunk list (`packed_batches`,
`GrainBatchStream`) only to resume its per-process checkpoints from before global positions.
Bad records (sources.py "Bad data") are dropped, counted in `FileDataset.skips` and logged to the
`nsa_jax.data` logger; whole-file problems raise when the stream is built.
"""

from __future__ import annotations

import collections
import copy
import weakref
from typing import Any

import grain
import numpy as np

from nsa_jax.data import sources
from nsa_jax.data.check import no_chunks_error
from nsa_jax.data.shards import encode_docs
from nsa_jax.data.stream import BatchStream, check_state, split_id
from nsa_jax.data.tokenizers import make_tokenizer, padded_vocab_size
from nsa_jax.words import count


class ChunkTokenizer:
    """chunk -> 1-D token stream of its documents of one split, each followed by EOS."""

    def __init__(self, tokenizer: Any, split: str, val_fraction: float, on_skip: sources.OnSkip | None = None):
        self.tokenizer = tokenizer
        self.split = split
        self.val_fraction = val_fraction
        self.on_skip = on_skip
        # Token ids fit uint16 for vocabularies up to 65536: halves the buffered memory.
        self.dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.int32

    def __call__(self, chunk: sources.Chunk, rng: np.random.Generator) -> np.ndarray:
        docs = sources.read_chunk(chunk, self.on_skip)
        docs = [d for d in docs if sources.in_split(d, self.split, self.val_fraction)]
        if not docs:
            return np.zeros((0,), dtype=self.dtype)
        # Documents of a chunk are adjacent in the file (often related); shuffle them so
        # that rows mix, with a generator grain derives from (seed, element index).
        docs = [docs[i] for i in rng.permutation(len(docs))]
        tokens, _ = encode_docs(self.tokenizer, docs, self.dtype)
        return tokens


class PackRowsIterDataset(grain.IterDataset):
    """Concatenates 1-D token streams and cuts them into [batch, row_len] int32 arrays."""

    def __init__(self, parent: grain.IterDataset, batch: int, row_len: int, max_empty: int, what: str):
        super().__init__(parent)
        self.batch, self.row_len, self.max_empty, self.what = batch, row_len, max_empty, what

    def __iter__(self) -> PackRowsIterator:
        return PackRowsIterator(self._parent.__iter__(), self.batch, self.row_len, self.max_empty, self.what)


class PackRowsIterator(grain.DatasetIterator):
    """Exact state: the parent state before the oldest buffered chunk + tokens used from it."""

    def __init__(self, parent: grain.DatasetIterator, batch: int, row_len: int, max_empty: int, what: str):
        super().__init__(parent)
        self.batch, self.row_len, self.max_empty, self.what = batch, row_len, max_empty, what
        # (parent state before the chunk was read, tokens of the chunk)
        self._chunks: collections.deque = collections.deque()
        self._offset = 0  # tokens of self._chunks[0] already emitted
        self._pending_skip = 0  # from set_state: tokens to drop from the next chunk read
        self._available = 0  # tokens buffered and not yet emitted

    def _read_chunk(self) -> None:
        empty = 0
        while True:
            state = copy.deepcopy(self._parent.get_state())
            tokens = next(self._parent)
            if len(tokens):
                break
            empty += 1
            if empty > self.max_empty:
                # Over two full passes without a token: this shard holds no document of the split.
                raise ValueError(
                    f"no {self.what} documents in this process's shard of data.path after {count(empty, 'chunk')}; "
                    "add data, use fewer processes, or raise data.val_fraction for the val split"
                )
        if not self._chunks:
            self._offset, self._pending_skip = self._pending_skip, 0
            self._available -= self._offset
        self._chunks.append((state, tokens))
        self._available += len(tokens)

    def __next__(self) -> np.ndarray:
        need = self.batch * self.row_len
        while self._available < need:
            self._read_chunk()
        parts, left = [], need
        while left:
            state, tokens = self._chunks[0]
            take = min(left, len(tokens) - self._offset)
            parts.append(tokens[self._offset : self._offset + take])
            self._offset += take
            left -= take
            if self._offset == len(tokens):
                self._chunks.popleft()
                self._offset = 0
        self._available -= need
        return np.concatenate(parts).astype(np.int32).reshape(self.batch, self.row_len)

    def get_state(self) -> dict[str, Any]:
        if self._chunks:
            return {"parent": copy.deepcopy(self._chunks[0][0]), "offset": self._offset}
        return {"parent": copy.deepcopy(self._parent.get_state()), "offset": self._pending_skip}

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(copy.deepcopy(state["parent"]))
        self._chunks.clear()
        self._offset, self._available = 0, 0
        self._pending_skip = int(state["offset"])


def stream_seed(seed: int, split: str) -> int:
    """The shuffle seed of one split's stream; seeds differ per split so train and val orders are unrelated."""
    return (int(seed) * 1_000_003 + 7919 * split_id(split)) % 2**32


def packed_batches(
    items: list,
    read_fn: Any,
    *,
    seed: int,
    batch: int,
    row_len: int,
    workers: int,
    prefetch: int,
    what: str,
) -> grain.DatasetIterator:
    """This process's items -> endless iterator of int32 [batch, row_len] arrays (module docstring).

    `read_fn(item, rng)` returns the 1-D token stream of one item; items are shuffled
    anew every epoch and `rng` is derived from (seed, element index) by grain.
    """
    if workers < 0 or prefetch < 0:
        raise ValueError(f"data.workers and data.prefetch must be >= 0, got {workers}, {prefetch}")
    ds = grain.MapDataset.source(items).shuffle(seed=seed).repeat()
    ds = ds.random_map(read_fn, seed=(seed + 1) % 2**32)
    read = grain.ReadOptions(num_threads=int(workers), prefetch_buffer_size=max(int(workers), 1))
    it = ds.to_iter_dataset(read)
    it = PackRowsIterDataset(it, int(batch), int(row_len), max_empty=2 * len(items) + 1, what=what)
    if prefetch > 0:
        it = grain.experimental.ThreadPrefetchIterDataset(it, prefetch_buffer_size=int(prefetch))
    return iter(it)


class GrainBatchStream(BatchStream):
    """A BatchStream over a `packed_batches` iterator, with the state checks shared by grain datasets.

    Subclasses set kind, split, process_index, process_count and `digest` (a fingerprint
    of the item list), then call `_start(iterator)`.
    """

    kind = "grain"
    process_count = 1
    digest = ""
    what_changed = "data.path files / chunks"

    def _start(self, it: grain.DatasetIterator) -> None:
        # The iterator lives in a box so that a finalizer (run at garbage collection or at
        # interpreter exit, whichever comes first) can close it without keeping `self`
        # alive: grain's prefetch thread must be stopped while modules still exist.
        self._box = {"it": it}
        weakref.finalize(self, _close_box, self._box)

    def _start_packed(self, chunks: list, reader: Any, seed: int, workers: int, prefetch: int) -> None:
        """Starts the packed stream of this process's `chunks` (read by `reader`) for self.split."""
        self._start(
            packed_batches(
                chunks,
                reader,
                seed=stream_seed(seed, self.split),
                batch=self.batch,
                row_len=self.seq_len + 1,
                workers=workers,
                prefetch=prefetch,
                what=self.split,
            )
        )

    @property
    def _iter(self) -> grain.DatasetIterator:
        it = self._box.get("it")
        if it is None:
            raise ValueError("data stream is closed")
        return it

    def __next__(self) -> np.ndarray:
        return next(self._iter)

    def get_state(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "split": self.split,
            "process_index": self.process_index,
            "process_count": self.process_count,
            "chunks": self.digest,
            "iterator": copy.deepcopy(self._iter.get_state()),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        check_state(self, state)
        if state.get("process_count") != self.process_count or state.get("chunks") != self.digest:
            raise ValueError(
                f"data state was saved with a different corpus or process count ({self.what_changed} changed); "
                "resume with the same data.path and number of processes"
            )
        self._iter.set_state(copy.deepcopy(state["iterator"]))

    def close(self) -> None:
        """Stops the prefetch threads; the stream cannot be read afterwards."""
        _close_box(self._box)


class FileDataset(GrainBatchStream):
    """Batches of packed documents from local files; see the module docstring."""

    def __init__(
        self,
        dataset: str,
        path: str,
        tokenizer: Any,
        seed: int,
        batch: int,
        seq_len: int,
        split: str,
        process_index: int,
        process_count: int,
        val_fraction: float,
        workers: int = 0,
        prefetch: int = 2,
    ):
        self.kind = dataset
        self.split, self.process_index, self.process_count = split, int(process_index), int(process_count)
        self.batch, self.seq_len = int(batch), int(seq_len)
        self.tokenizer = tokenizer
        if split == "val" and val_fraction <= 0:
            raise ValueError("data.val_fraction is 0, so there is no validation split; set data.val_fraction > 0")
        if workers < 0 or prefetch < 0:
            raise ValueError(f"data.workers and data.prefetch must be >= 0, got {workers}, {prefetch}")

        # Counts (and logs) dropped files and records; see sources.py "Bad data".
        self.skips = sources.SkipLog(f"data ({split}, process {process_index})")
        files = sources.list_files(path, dataset)
        skipped: list[sources.Skip] = []
        chunks = sources.index_chunks(files, dataset, on_skip=skipped.append)
        if not chunks:  # one line for it, not a warning per file first
            raise no_chunks_error(path, dataset, len(files), skipped)
        for skip in skipped:
            self.skips(skip)
        if len(chunks) < process_count:
            raise ValueError(
                f"data.path {path} splits into {count(len(chunks), 'chunk')} "
                f"({dataset}: row groups / file ranges / files) "
                f"but there are {process_count} processes; add files or run fewer processes"
            )
        self.n_chunks = len(chunks)
        self.digest = sources.chunks_digest(chunks)
        mine = chunks[process_index::process_count]
        reader = ChunkTokenizer(tokenizer, split, val_fraction, on_skip=self.skips)
        self._start_packed(mine, reader, seed, workers, prefetch)

    @classmethod
    def from_config(cls, cfg: Any, batch: int, split: str, process_index: int, process_count: int) -> FileDataset:
        tok = make_tokenizer(cfg.data)
        if tok.vocab_size > cfg.model.vocab_size:
            raise ValueError(
                f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the {cfg.data.tokenizer!r} tokenizer's "
                f"vocabulary ({tok.vocab_size}); set model.vocab_size={padded_vocab_size(tok.vocab_size)}"
            )
        d = cfg.data
        return cls(
            d.dataset,
            d.path,
            tok,
            cfg.train.seed,
            batch,
            cfg.train.seq_len,
            split,
            process_index,
            process_count,
            d.val_fraction,
            workers=d.workers,
            prefetch=d.prefetch,
        )


def _close_box(box: dict) -> None:
    it = box.pop("it", None)
    if it is not None:
        it.close()
