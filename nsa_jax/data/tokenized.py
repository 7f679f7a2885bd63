"""The `tokenized` dataset: batches packed from a folder written by `python -m launch.prepare_data`.

Owns `TokenizedDataset`, the batch stream of one process over the shards of one split
(format: nsa_jax/data/shards.py). Each shard is cut into chunks of whole documents of
about CHUNK_TOKENS tokens, the unit that is sharded over processes and shuffled, and
the chunks go through the same grain stages as the file pipeline
(pipeline.packed_batches):

  chunks of all shards of the split (same list on every process)
    -> chunks[process_index::process_count]          (disjoint; every token in one process)
    -> shuffled anew every epoch; documents of a chunk shuffled
    -> packed into [batch, seq_len + 1] int32 rows (EOS between documents)
    -> prefetch; exact get_state/set_state

One epoch of a process is the first `epoch_tokens` tokens of its packed stream: each
token of its chunks exactly once. The tail that does not fill a row is not dropped; it
continues into a row with the next epoch's first tokens, as in the file pipeline.
Shards are memory-mapped: only the chunks being read are paged in.

The split comes from the manifest (prepare_data applied the document-hash rule with
its --val-fraction); data.val_fraction is not used. The manifest's tokenizer must be
data.tokenizer and fit model.vocab_size, and its format version must be this code's.
"""

from __future__ import annotations

import functools
import hashlib
import pathlib
from typing import Any

import numpy as np

from nsa_jax.data import shards as fmt
from nsa_jax.data.pipeline import GrainBatchStream
from nsa_jax.data.tokenizers import padded_vocab_size

CHUNK_TOKENS = 1 << 16  # tokens per shuffled/sharded chunk (whole documents; a long document is one chunk)
OPEN_SHARDS = 64  # memory maps kept open per stream (each holds file descriptors)


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
        tokens = np.load(self.root / s["tokens_file"], mmap_mode="r")
        ends = np.load(self.root / s["docs_file"], mmap_mode="r")
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


class TokenizedDataset(GrainBatchStream):
    """Batches packed from a prepared folder's shards of one split; see the module docstring."""

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
    ):
        self.split, self.process_index, self.process_count = split, int(process_index), int(process_count)
        self.batch, self.seq_len = int(batch), int(seq_len)
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
            ends = np.load(self.root / s["docs_file"], mmap_mode="r")
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
        if len(chunks) < process_count:
            raise ValueError(
                f"data.path {path} has {len(chunks)} {split} chunks of about {CHUNK_TOKENS} tokens but there are "
                f"{process_count} processes; prepare more data or run fewer processes"
            )
        self.n_chunks = len(chunks)
        self.tokens = sum(s["tokens"] for s in shards)
        self.digest = h.hexdigest()
        mine = chunks[process_index::process_count]
        # Tokens of this process's chunks: the length of one epoch of its packed stream.
        self.epoch_tokens = int(sum(chunk_sizes[process_index::process_count]))
        self._start_packed(mine, ShardChunkReader(self.root, shards), seed, workers, prefetch)

    @classmethod
    def from_config(cls, cfg: Any, batch: int, split: str, process_index: int, process_count: int) -> TokenizedDataset:
        d = cfg.data
        m = fmt.read_manifest(d.path)
        tok = m["tokenizer"]
        if not fmt.same_tokenizer(fmt.tokenizer_identity(d.tokenizer), tok):
            raise ValueError(
                f"data.path {d.path} was prepared with tokenizer {tok['spec']!r} but data.tokenizer is "
                f"{d.tokenizer!r}; pass --tokenizer {tok['spec']} (evaluation and generation decode with "
                "data.tokenizer)"
            )
        if tok["vocab_size"] > cfg.model.vocab_size:
            raise ValueError(
                f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the vocabulary ({tok['vocab_size']}) of "
                f"the tokenizer {tok['spec']!r} that data.path {d.path} was prepared with; "
                f"set model.vocab_size={padded_vocab_size(tok['vocab_size'])}"
            )
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
        )
