"""Pre-tokenized shards: the on-disk format, its writer, the manifest and the tokenizer identity.

A prepared folder (written by `python -m launch.prepare_data`):

  manifest.json            written last: every shard it lists is complete
  train_00000.tokens.npy   1-D token ids (uint16 when the vocabulary fits, else uint32):
                           whole documents, each followed by EOS
  train_00000.docs.npy     1-D int64 end offset of each document in the tokens (exclusive,
                           its EOS included); document k = tokens[ends[k-1]:ends[k]]
  val_00000.tokens.npy ... the validation split: the documents `sources.in_split` puts in
                           val, the same document-hash rule the file pipeline uses

Both arrays are plain .npy files, memory-mapped when read. manifest.json holds the
format name and version, the tokenizer (identity, vocab size, EOS id), the token dtype,
the split rule (val_fraction), the shard list with token and document counts, the
source files with their sizes and what was skipped.

This module needs only numpy (prepare_data does not load grain); the batch stream
that trains from a prepared folder is nsa_jax/data/tokenized.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import struct
import threading
from typing import Any, Sequence

import numpy as np

from nsa_jax.data.tokenizers import padded_vocab_size
from nsa_jax.words import count

FORMAT = "nsa_jax.tokens"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "val")
TMP_SUFFIX = ".tmp"
# A .npy header of fixed size, room for any 1-D shape: written before the token count is
# known and rewritten in place at the end, so a shard streams to disk in constant memory.
NPY_HEADER_BYTES = 128


# ---------------------------------------------------------------------------
# format helpers


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab <= 65536), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def encode_docs(tokenizer: Any, docs: Sequence[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, doc_lengths): the documents' token ids, each followed by EOS, as one 1-D `dtype` array.

    The file pipeline builds its token stream with the same function, so a prepared
    folder holds exactly the tokens the pipeline would train on.
    """
    if not docs:
        return np.zeros((0,), dtype=dtype), np.zeros((0,), dtype=np.int64)
    if hasattr(tokenizer, "encode_batch_np"):
        pieces = tokenizer.encode_batch_np(list(docs))
    else:
        pieces = [tokenizer.encode_np(d) for d in docs]
    eos = np.array([tokenizer.eos_id], dtype=dtype)
    out = []
    for p in pieces:
        out.append(p.astype(dtype, copy=False))
        out.append(eos)
    lengths = np.fromiter((len(p) + 1 for p in pieces), dtype=np.int64, count=len(pieces))
    return np.concatenate(out), lengths


def shard_names(split: str, index: int) -> tuple[str, str]:
    """(tokens file, docs file) of shard `index` of `split`."""
    return f"{split}_{index:05d}.tokens.npy", f"{split}_{index:05d}.docs.npy"


def is_own_file(name: str) -> bool:
    """A file name prepare_data writes (manifest, shard or temp), i.e. one --overwrite may delete."""
    if name.endswith(TMP_SUFFIX):
        name = name[: -len(TMP_SUFFIX)]
    if name == MANIFEST:
        return True
    return any(name.startswith(f"{s}_") and name.endswith((".tokens.npy", ".docs.npy")) for s in SPLITS)


def tokenizer_identity(spec: str) -> dict[str, Any]:
    """What names a tokenizer independently of where it was loaded from: kind, name and, for files, a hash."""
    spec = spec.strip()
    if spec == "byte":
        return {"kind": "byte", "name": "byte"}
    if spec == "gpt2" or spec.startswith("tiktoken:"):
        return {"kind": "tiktoken", "name": spec.split(":", 1)[1] if ":" in spec else spec}
    path = pathlib.Path(spec).expanduser()
    if path.is_dir() and (path / "tokenizer.json").is_file():
        path = path / "tokenizer.json"
    sha = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
    return {"kind": "json", "name": path.name, "sha256": sha}


def same_tokenizer(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.get("kind") != b.get("kind"):
        return False
    if a.get("kind") == "json":
        return a.get("sha256") is not None and a.get("sha256") == b.get("sha256")
    return a.get("name") == b.get("name")


def _npy_header(dtype: np.dtype, n: int) -> bytes:
    body = "{'descr': %r, 'fortran_order': False, 'shape': (%d,), }" % (np.lib.format.dtype_to_descr(dtype), n)
    body_len = NPY_HEADER_BYTES - 10
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", body_len) + (body.ljust(body_len - 1) + "\n").encode("latin1")


def _write_json_atomic(path: pathlib.Path, obj: Any) -> None:
    tmp = path.with_name(path.name + TMP_SUFFIX)
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def is_prepared(path: str | os.PathLike) -> bool:
    """True when `path` is a folder with a manifest.json of this format."""
    try:
        return json.loads((pathlib.Path(path) / MANIFEST).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


# ---------------------------------------------------------------------------
# writing


class ShardWriter:
    """Streams one split's documents into shards of about `shard_tokens` tokens.

    A shard is written under a temporary name and renamed once complete; documents
    never straddle shards (a shard closes at the first document end at or past
    `shard_tokens`). `shards` lists the completed ones as manifest entries.
    """

    def __init__(self, out_dir: str | os.PathLike, split: str, dtype: np.dtype, shard_tokens: int):
        if shard_tokens <= 0:
            raise ValueError(f"--shard-tokens must be positive, got {shard_tokens}")
        self.out, self.split, self.dtype, self.shard_tokens = (
            pathlib.Path(out_dir),
            split,
            np.dtype(dtype),
            shard_tokens,
        )
        self.shards: list[dict[str, Any]] = []
        self._f = None
        self._tokens = 0  # in the open shard
        self._ends: list[np.ndarray] = []  # document ends of the open shard

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards) + self._tokens

    @property
    def documents(self) -> int:
        return sum(s["documents"] for s in self.shards) + sum(len(e) for e in self._ends)

    def _paths(self) -> tuple[pathlib.Path, pathlib.Path]:
        tok, docs = shard_names(self.split, len(self.shards))
        return self.out / tok, self.out / docs

    def add(self, tokens: np.ndarray, doc_lengths: np.ndarray) -> None:
        """Appends documents: `tokens` is their concatenation (EOS included), `doc_lengths` their sizes."""
        tokens = np.asarray(tokens)
        if tokens.size and int(tokens.max()) > np.iinfo(self.dtype).max:
            raise ValueError(f"token id {int(tokens.max())} does not fit the shard dtype {self.dtype}")
        ends = np.cumsum(np.asarray(doc_lengths, dtype=np.int64))
        if len(ends) and ends[-1] != tokens.size:
            raise ValueError(f"doc_lengths sum to {ends[-1]} but there are {tokens.size} tokens")
        done_docs, done_tokens = 0, 0
        while done_docs < len(ends):
            room = self.shard_tokens - self._tokens
            # The first document whose end reaches the room closes the shard.
            k = int(np.searchsorted(ends, done_tokens + room, side="left")) + 1
            k = min(k, len(ends))
            stop = int(ends[k - 1])
            self._write(tokens[done_tokens:stop], ends[done_docs:k] - done_tokens)
            done_docs, done_tokens = k, stop
            if self._tokens >= self.shard_tokens:
                self._close_shard()

    def _write(self, tokens: np.ndarray, local_ends: np.ndarray) -> None:
        if self._f is None:
            tok_path, _ = self._paths()
            self._f = open(tok_path.with_name(tok_path.name + TMP_SUFFIX), "wb")
            self._f.write(_npy_header(self.dtype, 0))
        self._f.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        self._ends.append(local_ends + self._tokens)
        self._tokens += int(tokens.size)

    def _close_shard(self) -> None:
        if self._f is None:
            return
        tok_path, docs_path = self._paths()
        self._f.seek(0)
        self._f.write(_npy_header(self.dtype, self._tokens))
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        self._f = None
        ends = np.concatenate(self._ends) if self._ends else np.zeros((0,), np.int64)
        docs_tmp = docs_path.with_name(docs_path.name + TMP_SUFFIX)
        with open(docs_tmp, "wb") as f:
            np.save(f, ends.astype(np.int64))
            f.flush()
            os.fsync(f.fileno())
        os.replace(docs_tmp, docs_path)
        os.replace(tok_path.with_name(tok_path.name + TMP_SUFFIX), tok_path)
        self.shards.append(
            {
                "split": self.split,
                "tokens_file": tok_path.name,
                "docs_file": docs_path.name,
                "tokens": self._tokens,
                "documents": len(ends),
            }
        )
        self._tokens, self._ends = 0, []

    def finish(self) -> list[dict[str, Any]]:
        """Closes the open shard; returns all shard entries."""
        self._close_shard()
        return self.shards

    def abort(self) -> None:
        """Removes the temporary file of an unfinished shard."""
        if self._f is not None:
            name = self._f.name
            self._f.close()
            self._f = None
            pathlib.Path(name).unlink(missing_ok=True)


def hold_out_tail(
    out_dir: str | os.PathLike, train: list[dict[str, Any]], dtype: np.dtype, n_tokens: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Moves the last `n_tokens` tokens of the last train shard into a new val shard; (train entries, val entry).

    For a corpus whose documents all fell in train (too few for the document-hash split):
    the cut falls inside a document, whose head stays in train (it ends at the cut) and
    whose tail opens the val shard. At most all but one token of the last shard moves. The
    val shard is written first and the train shard is replaced under a temporary name, so
    an interruption leaves complete files (and no manifest: the caller writes it last).
    """
    out = pathlib.Path(out_dir)
    last = train[-1]
    tokens = load_npy(out / last["tokens_file"], None)
    ends = load_npy(out / last["docs_file"], None).astype(np.int64)
    n = int(min(n_tokens, len(tokens) - 1))
    if n < 1:
        raise ValueError(f"{last['tokens_file']} has {count(len(tokens), 'token')}: too few to hold out")
    cut = len(tokens) - n
    head_ends = np.concatenate([ends[ends < cut], [cut]])
    tail_ends = ends[ends > cut] - cut
    val = ShardWriter(out, "val", dtype, max(n, 1))
    val.add(tokens[cut:], np.diff(tail_ends, prepend=0))
    (val_entry,) = val.finish()
    rewrite = ShardWriter(out, "train", dtype, max(cut, 1))
    rewrite.shards = list(train[:-1])  # the same file names as the shard it replaces
    rewrite.add(tokens[:cut], np.diff(head_ends, prepend=0))
    return rewrite.finish(), val_entry


def write_manifest(out_dir: str | os.PathLike, manifest: dict[str, Any]) -> None:
    """Writes manifest.json atomically (temp name, then rename): the last file of a prepared folder."""
    _write_json_atomic(pathlib.Path(out_dir) / MANIFEST, {"format": FORMAT, "version": FORMAT_VERSION, **manifest})


# ---------------------------------------------------------------------------
# reading


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a prepared folder; ValueError naming the folder and the fix otherwise."""
    root = pathlib.Path(path).expanduser()
    redo = f"re-run python -m launch.prepare_data --input RAW_DATA --output {path} --overwrite"
    if not str(path):
        raise ValueError("data.path is empty for data.dataset=tokenized; pass --data-path DIR prepared by prepare_data")
    if not root.is_dir():
        raise ValueError(f"data.path {path} is not a directory; point it at a folder written by launch.prepare_data")
    mpath = root / MANIFEST
    if not mpath.is_file():
        if any(is_own_file(f.name) for f in root.iterdir()):
            raise ValueError(f"data.path {path} has shards but no {MANIFEST} (an interrupted prepare_data run); {redo}")
        raise ValueError(
            f"data.path {path} has no {MANIFEST}, so it is not a prepared folder; for raw .txt/.jsonl/.parquet "
            f"files run python -m launch.prepare_data --input {path} --output PREPARED_DIR and use "
            "--data-path PREPARED_DIR, or pick the raw format with --dataset text|jsonl|fineweb_edu"
        )
    try:
        m = json.loads(mpath.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{mpath} is not readable JSON ({e}); delete it and {redo}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ValueError(
            f"{mpath} is not a {FORMAT} manifest; point data.path at a folder written by launch.prepare_data"
        )
    if m.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{mpath} has format version {m.get('version')} but this code reads version {FORMAT_VERSION}; "
            f"{redo} to rewrite it"
        )
    return m


def check_manifest_fits(cfg: Any, m: dict[str, Any]) -> None:
    """ValueError when the prepared folder's tokenizer is not data.tokenizer or does not fit model.vocab_size.

    No grain or jax: launch.train runs it (nsa_jax/data/check.py) before the out dir is touched."""
    d = cfg.data
    tok = m["tokenizer"]
    if not same_tokenizer(tokenizer_identity(d.tokenizer), tok):
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


# numpy reads a .npy header with ast.literal_eval, and CPython 3.11's AST conversion keeps its
# recursion counter in one global: two threads parsing at once (the loader's workers and the main
# thread) can fail with "SystemError: AST constructor recursion depth mismatch". One header at a time.
_NPY_HEADER_LOCK = threading.Lock()


def load_npy(path: pathlib.Path, mmap_mode: str | None = "r") -> np.ndarray:
    """np.load of a shard file (memory-mapped by default), its header read under the module's lock."""
    with _NPY_HEADER_LOCK:
        return np.load(path, mmap_mode=mmap_mode)


def npy_length(path: pathlib.Path, dtype: np.dtype | None = None) -> int:
    """Length of a 1-D .npy file from its header (ValueError when it is missing, not .npy or another dtype)."""
    try:
        with open(path, "rb") as f, _NPY_HEADER_LOCK:
            version = np.lib.format.read_magic(f)
            read_header = (
                np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            )
            shape, _, file_dtype = read_header(f)
            data_start = f.tell()
    except (OSError, ValueError) as e:
        raise ValueError(f"{path.name}: {e}") from None
    if len(shape) != 1 or (dtype is not None and file_dtype != dtype):
        raise ValueError(f"{path.name}: holds a {file_dtype} array of shape {shape}, expected 1-D {dtype}")
    size = os.path.getsize(path)
    if size < data_start + shape[0] * file_dtype.itemsize:
        raise ValueError(f"{path.name}: file is truncated ({size} bytes for {shape[0]} values)")
    return int(shape[0])
