"""The `tokenized` dataset: batches packed from a folder written by `python -m launch.prepare_data`.

Owns `TokenizedDataset`, the batch stream of one split of the shards (format: nsa_jax/data/shards.py),
numbered over the whole run (stream.GlobalRowStream): its state is one global row count, so a checkpoint
resumes on any process or device count. Each shard is cut into chunks of whole documents of about
CHUNK_TOKENS tokens, the unit that is shuffled:

  chunks of all shards of the split (the same list on every process)
    -> epoch e: the chunks in an order drawn from (seed, split, e), each chunk's documents from (seed, split, e, chunk)
    -> one token stream per epoch of `epoch_tokens` tokens (every document once, each followed by its EOS),
       epochs back to back: the tail of an epoch that does not fill a row continues into the next
    -> cut into rows of seq_len + 1 tokens: global row r is tokens [r (T + 1), (r + 1) (T + 1))

A row is found without packing the stream before it (per-epoch prefix sums of the shuffled chunk sizes;
only the chunks it covers are read, from memory-mapped shards); each process reads only its own rows of
each micro-batch; data.workers and data.prefetch do not apply. A checkpoint from before global positions
(one grain state per process, pipeline.packed_batches) resumes on the stream it was saved from
(`PerProcessTokenized`), with the same process count. The split is the manifest's (data.val_fraction is
not used); its tokenizer must be data.tokenizer and fit model.vocab_size, its format version this code's.
"""

from __future__ import annotations

import functools
import hashlib
import pathlib
from typing import Any

import numpy as np

from nsa_jax.data import shards as fmt
from nsa_jax.data.pipeline import GrainBatchStream, stream_seed
from nsa_jax.data.stream import GlobalRowStream, check_state
from nsa_jax.words import count

CHUNK_TOKENS = 1 << 16  # tokens per shuffled/sharded chunk (whole documents; a long document is one chunk)
OPEN_SHARDS = 64  # memory maps kept open per stream (each holds file descriptors)
CACHED_CHUNKS = 4  # chunks kept read (a row may straddle two; neighbouring processes share the edges)


def shard_chunks(doc_ends: np.ndarray, chunk_tokens: int) -> np.ndarray:
    """Document boundaries [0, ..., D] cutting one shard into runs of about `chunk_tokens` tokens."""
    n_docs = len(doc_ends)
    if n_docs == 0:
        return np.zeros((1,), np.int64)
    total = int(doc_ends[-1])
    targets = np.arange(chunk_tokens, total, chunk_tokens, dtype=np.int64)
    # A chunk ends with the first document whose end reaches the next multiple of chunk_tokens.
    cuts = np.searchsorted(doc_ends, targets, side="left") + 1
    return np.unique(np.concatenate([[0], cuts, [n_docs]])).astype(np.int64)


class ShardChunkReader:
    """(shard, first doc, end doc) -> the chunk's tokens, its documents in an order drawn from `rng`."""

    def __init__(self, root: pathlib.Path, shards: list[dict[str, Any]]):
        self.root, self.shards = root, shards
        # Memory maps are opened on first use and a bounded number kept: a corpus of
        # thousands of shards would otherwise exhaust file descriptors.
        self._open = functools.lru_cache(maxsize=OPEN_SHARDS)(self._load)

    def _load(self, shard: int) -> tuple[np.ndarray, np.ndarray]:
        s = self.shards[shard]
        tokens = fmt.load_npy(self.root / s["tokens_file"])
        ends = fmt.load_npy(self.root / s["docs_file"])
        return tokens, ends

    def __call__(self, chunk: tuple[int, int, int], rng: np.random.Generator) -> np.ndarray:
        shard, lo, hi = chunk
        tokens, ends = self._open(shard)
        start = int(ends[lo - 1]) if lo else 0
        local_ends = np.asarray(ends[lo:hi], dtype=np.int64) - start
        block = np.array(tokens[start : start + int(local_ends[-1])])  # one read of the chunk
        local_starts = np.concatenate([[0], local_ends[:-1]])
        # Documents of a chunk were adjacent in the source; shuffle them so rows mix.
        order = rng.permutation(hi - lo)
        return np.concatenate([block[local_starts[i] : local_ends[i]] for i in order])


class TokenizedDataset(GlobalRowStream):
    """Global rows packed from a prepared folder's shards of one split; see the module docstring."""

    kind = "tokenized"
    what_changed = "the prepared folder at data.path"

    def __init__(
        self,
        path: str,
        seed: int,
        batch: int,
        seq_len: int,
        split: str,
        process_index: int,
        process_count: int,
        workers: int = 0,
        prefetch: int = 2,
        manifest: dict[str, Any] | None = None,
        block_rows: int | None = None,
    ):
        """`batch`: rows of one micro-batch over all processes (train.global_batch); `block_rows`:
        rows per optimizer step (train.global_batch x train.accumulate; default `batch`).
        `workers` and `prefetch` serve only a resumed per-process stream."""
        self.split, self.seq_len, self.seed = split, int(seq_len), int(seed)
        self._init_rows(batch, process_index, process_count, block_rows or batch)
        self.workers, self.prefetch = int(workers), int(prefetch)
        self.root = pathlib.Path(path).expanduser()
        self.manifest = manifest if manifest is not None else fmt.read_manifest(path)
        dtype = np.dtype(self.manifest["dtype"])
        shards = [s for s in self.manifest["shards"] if s["split"] == split]
        if not shards:
            fix = (
                "re-run launch.prepare_data with --val-fraction > 0"
                if split == "val"
                else "check the inputs prepare_data was given (its summary lists skipped files)"
            )
            raise ValueError(f"data.path {path} has no {split} shards (manifest.json); {fix}")

        redo = "re-run launch.prepare_data with --overwrite for this folder"
        chunks: list[tuple[int, int, int]] = []
        chunk_sizes: list[int] = []  # tokens per chunk
        h = hashlib.blake2b(digest_size=8)
        for i, s in enumerate(shards):
            try:
                n_tokens = fmt.npy_length(self.root / s["tokens_file"], dtype)
                n_docs = fmt.npy_length(self.root / s["docs_file"], np.dtype(np.int64))
            except ValueError as e:
                raise ValueError(f"data.path {path}: shard {e}; {redo}") from None
            ends = fmt.load_npy(self.root / s["docs_file"])
            last = int(ends[-1]) if n_docs else 0
            if (n_tokens, n_docs) != (s["tokens"], s["documents"]) or last != n_tokens:
                raise ValueError(
                    f"data.path {path}: shard {s['tokens_file']} has {n_tokens} tokens / {n_docs} documents (last "
                    f"document ends at {last}) but the manifest says {s['tokens']} / {s['documents']}; {redo}"
                )
            bounds = shard_chunks(ends, CHUNK_TOKENS)
            chunks.extend((i, int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]))
            chunk_ends = np.asarray(ends[bounds[1:] - 1], dtype=np.int64)
            chunk_sizes.extend(np.diff(chunk_ends, prepend=0).tolist())
            h.update(repr((s["tokens_file"], n_tokens, n_docs, bounds.tolist())).encode())
            del ends
        if not chunks:
            raise ValueError(f"data.path {path} has no {split} documents; {redo}")
        self.chunks, self.n_chunks = chunks, len(chunks)
        self.chunk_sizes = np.asarray(chunk_sizes, dtype=np.int64)
        self.tokens = sum(s["tokens"] for s in shards)
        # One epoch: every token of the split once (every chunk, every document).
        self.epoch_tokens = int(self.chunk_sizes.sum())
        self.digest = h.hexdigest()
        self.reader = ShardChunkReader(self.root, shards)
        self._shuffle_seed = stream_seed(seed, split)
        self._layout = functools.lru_cache(maxsize=2)(self._epoch_layout)
        self._chunk = functools.lru_cache(maxsize=CACHED_CHUNKS)(self._read_chunk)
        self._per_process: PerProcessTokenized | None = None

    @classmethod
    def from_config(cls, cfg: Any, batch: int, split: str, process_index: int, process_count: int) -> TokenizedDataset:
        """`batch`: train.global_batch, the rows of one micro-batch over all processes."""
        d = cfg.data
        m = fmt.read_manifest(d.path)
        fmt.check_manifest_fits(cfg, m)
        return cls(
            d.path,
            cfg.train.seed,
            batch,
            cfg.train.seq_len,
            split,
            process_index,
            process_count,
            workers=d.workers,
            prefetch=d.prefetch,
            manifest=m,
            block_rows=cfg.train.global_batch * cfg.train.accumulate,
        )

    # -- the global token stream ---------------------------------------------------

    def _epoch_layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(chunk order of `epoch`, the first token of each of them in the epoch, then epoch_tokens)."""
        order = np.random.default_rng([self._shuffle_seed, int(epoch)]).permutation(self.n_chunks)
        starts = np.concatenate([[0], np.cumsum(self.chunk_sizes[order])])
        return order, starts

    def _read_chunk(self, epoch: int, chunk: int) -> np.ndarray:
        rng = np.random.default_rng([self._shuffle_seed, int(epoch), int(chunk), 0x444F43])
        return self.reader(self.chunks[chunk], rng)

    def stream_tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the global token stream (epochs back to back), int32."""
        out = np.empty((stop - start,), dtype=np.int32)
        done, E = 0, self.epoch_tokens
        while start < stop:
            epoch, offset = divmod(start, E)
            order, starts = self._layout(epoch)
            i = int(np.searchsorted(starts, offset, side="right")) - 1
            tokens = self._chunk(epoch, int(order[i]))
            lo = offset - int(starts[i])
            take = min(len(tokens) - lo, stop - start)
            out[done : done + take] = tokens[lo : lo + take]
            done += take
            start += take
        return out

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Global rows [start, stop): random access, no packing of the rows before them."""
        L = self.seq_len + 1
        return self.stream_tokens(start * L, stop * L).reshape(stop - start, L)

    # -- the BatchStream interface ---------------------------------------------------

    def __next__(self) -> np.ndarray:
        if self._per_process is not None:
            return next(self._per_process)
        return self._next_local()

    def get_state(self) -> dict[str, Any]:
        if self._per_process is not None:
            return self._per_process.get_state()
        return {**super().get_state(), "chunks": self.digest}

    def set_state(self, state: dict[str, Any]) -> None:
        check_state(self, state, keys=("kind", "split"))
        if "iterator" in state:  # one grain state per process, saved before global positions
            self.close()
            self._per_process = PerProcessTokenized(self)
            self._per_process.set_state(state)
            return
        if state.get("chunks") != self.digest:
            raise ValueError(
                f"data state was saved with a different corpus ({self.what_changed} changed); "
                "resume with the same data.path"
            )
        super().set_state(state)

    def close(self) -> None:
        if self._per_process is not None:
            self._per_process.close()
            self._per_process = None


class PerProcessTokenized(GrainBatchStream):
    """The stream of one process as it was before global positions: its chunks
    (chunks[process_index::process_count]) shuffled and packed by grain. Kept to resume
    the checkpoints it wrote, with the process count they were written with."""

    kind = "tokenized"
    what_changed = TokenizedDataset.what_changed

    def __init__(self, ds: TokenizedDataset):
        self.split, self.seq_len, self.digest = ds.split, ds.seq_len, ds.digest
        self.process_index, self.process_count, self.batch = ds.process_index, ds.process_count, ds.batch
        mine = ds.chunks[self.process_index :: self.process_count]
        if not mine:
            raise ValueError(
                f"data.path {ds.root} has {count(ds.n_chunks, ds.split + ' chunk')}, fewer than the "
                f"{self.process_count} processes of this per-process data state"
            )
        self._start_packed(mine, ds.reader, ds.seed, ds.workers, ds.prefetch)
