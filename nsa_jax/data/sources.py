"""Local document sources: parquet (FineWeb-Edu schema), jsonl and plain-text files.

Owns finding the data files under `data.path`, cutting them into *chunks* (the unit that is sharded over
processes and shuffled), reading one chunk's documents, the train/val assignment of a document by a hash
of its text, and what happens to bad data. A chunk is a plain tuple (kind, path, a, b):
  parquet  one row group of one file, `text` column only
  jsonl    a byte range of one file (lines are assigned to the range they start in)
  text     one .txt file = one document

Bad data. Problems that make a whole file unusable and are cheap to find up front (a corrupt parquet
footer, no `text` column or field, a path with no data files) raise `BadDataError`, naming the file,
while the chunks are indexed, i.e. before the first batch and on every process alike. Empty (0-byte)
files hold no document and are skipped. Problems of one record found while reading (a jsonl line that
is not JSON or has no `text` string, bytes that are not UTF-8) go to the `on_skip` callback when one is
given (the record is dropped and counted: one truncated line should not stop a long run) and raise
`BadDataError` otherwise. Empty documents are dropped silently.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import logging
import os
import pathlib
import threading
from typing import Callable, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from nsa_jax.data import shards

TEXT_KEY = "text"
JSONL_CHUNK_BYTES = 16 << 20  # byte range per jsonl chunk

EXTENSIONS = {
    "fineweb_edu": (".parquet",),
    "jsonl": (".jsonl", ".json"),
    "text": (".txt",),
}
ALL_EXTENSIONS = tuple(e for exts in EXTENSIONS.values() for e in exts)
# The datasets read from these files (data.dataset), each process its own shard of the chunks.
FILE_DATASETS = tuple(EXTENSIONS)

# Skip reasons (also the keys of the counts in logs and in prepare_data's summary).
EMPTY_FILE = "empty file"
CORRUPT = "corrupt file"
NO_TEXT = "no 'text' field"
BAD_JSON = "invalid JSON"
NOT_UTF8 = "not UTF-8"

Chunk = tuple  # (kind, path, a, b)


class BadDataError(ValueError):
    """A data file or record that cannot be used; the message names the file, the place and the fix."""

    def __init__(self, path: str, reason: str, detail: str = "", where: str = "", fix: str = ""):
        self.path, self.reason, self.detail, self.where = str(path), reason, detail, where
        at = f" at {where}" if where else ""
        why = f" ({detail})" if detail else ""
        super().__init__(f"{path}{at}: {reason}{why}; {fix or 'fix or remove it'}")


@dataclasses.dataclass(frozen=True)
class Skip:
    """One dropped file or record: `where` is empty for a whole file."""

    path: str
    reason: str
    detail: str = ""
    where: str = ""


OnSkip = Callable[[Skip], None]

_FIXES = {
    NOT_UTF8: "convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)",
    BAD_JSON: "fix or remove the line",
    NO_TEXT: f"each jsonl line must be an object with a '{TEXT_KEY}' string",
}


def _bad(on_skip: OnSkip | None, path: str, reason: str, detail: str, where: str) -> None:
    """Reports a bad record to `on_skip`, or raises when there is none."""
    if on_skip is None:
        raise BadDataError(path, reason, detail, where, _FIXES.get(reason, ""))
    on_skip(Skip(str(path), reason, detail, where))


class SkipLog:
    """An `on_skip` for training: counts skips per reason and logs them to the `nsa_jax.data` logger.

    The first `log_first` skips are logged one line each (file, place, reason); after
    that one line whenever the total reaches a power of two, so a corpus full of bad
    lines cannot flood the log but never goes unnoticed. Safe to call from reader threads.
    """

    def __init__(self, what: str = "data", log_first: int = 10):
        self.what, self.log_first = what, log_first
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._log = logging.getLogger("nsa_jax.data")

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __call__(self, skip: Skip) -> None:
        with self._lock:
            self.counts[skip.reason] = self.counts.get(skip.reason, 0) + 1
            n = self.total
            counts = dict(self.counts)
        if n <= self.log_first:
            at = f" at {skip.where}" if skip.where else ""
            why = f" ({skip.detail})" if skip.detail else ""
            self._log.warning("%s: skipped %s%s: %s%s", self.what, skip.path, at, skip.reason, why)
        elif n & (n - 1) == 0:
            parts = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
            self._log.warning("%s: %d files/records skipped so far (%s)", self.what, n, parts)


def _describe_dir(p: pathlib.Path) -> str:
    """' (it holds 3 .parquet files)' or '' - helps when data.dataset and the files disagree."""
    counts: dict[str, int] = {}
    for f in p.rglob("*"):
        if f.is_file():
            counts[f.suffix or f.name] = counts.get(f.suffix or f.name, 0) + 1
    if not counts:
        return " (it is empty)"
    top = sorted(counts.items(), key=lambda kv: -kv[1])[:3]
    return " (it holds " + ", ".join(f"{n} {ext} file{'s' * (n > 1)}" for ext, n in top) + ")"


def _is_prepared_dir(p: pathlib.Path) -> bool:
    return shards.is_prepared(p)


def list_files(path: str, dataset: str, exts: tuple[str, ...] | None = None) -> list[str]:
    """Sorted data files for `dataset` at `path` (a directory, searched recursively; a file; or a glob),
    those ending in `exts` (default: the dataset's EXTENSIONS)."""
    exts = EXTENSIONS[dataset] if exts is None else exts
    pattern = "/".join("*" + e for e in exts)
    if not path:
        hub = " (streaming from the hub needs a network and the `datasets` package)" if dataset == "fineweb_edu" else ""
        raise ValueError(
            f"data.path is empty for data.dataset={dataset}; pass --data-path DIR holding {pattern} files{hub}"
        )
    p = pathlib.Path(path).expanduser()
    if p.is_dir() and _is_prepared_dir(p):
        raise ValueError(
            f"data.path {path} holds pre-tokenized shards (manifest.json), not {pattern} files; "
            "use data.dataset=tokenized (--dataset tokenized)"
        )
    if p.is_file():
        files = [str(p)]
    elif p.is_dir():
        files = sorted(str(f) for f in p.rglob("*") if f.is_file() and f.name.endswith(exts))
    elif any(c in path for c in "*?["):
        files = sorted(f for f in glob.glob(os.path.expanduser(path), recursive=True) if os.path.isfile(f))
    else:
        raise ValueError(f"data.path {path} does not exist; pass --data-path DIR holding the {dataset} files")
    if not files:
        held = _describe_dir(p) if p.is_dir() else ""
        raise ValueError(
            f"data.path {path} has no {pattern} files for data.dataset={dataset}{held}; "
            "point --data-path at the directory with the data files"
        )
    return files


def find_input_files(
    paths: Sequence[str], exclude: str | None = None, text_suffixes: Sequence[str] = ()
) -> list[tuple[str, str]]:
    """(dataset, path) of every .parquet/.jsonl/.json/.txt file under `paths`, in a fixed order.

    `paths` are directories (searched recursively), files or globs; files under
    `exclude` (an output directory inside an input one) are left out; files ending in one
    of `text_suffixes` (".py", ".rst": source code, docs) are plain text too, one document
    each. Raises ValueError naming the input when a path does not exist, a named file has
    another extension, or nothing at all is found.
    """
    kind_of = {e: kind for kind, exts in EXTENSIONS.items() for e in exts} | {e: "text" for e in text_suffixes}
    suffixes = (*ALL_EXTENSIONS, *text_suffixes)
    skip_root = pathlib.Path(exclude).expanduser().resolve() if exclude else None

    def kind(f: pathlib.Path) -> str | None:
        return next((kind_of[e] for e in suffixes if f.name.endswith(e)), None)

    found: dict[str, str] = {}
    for path in paths:
        p = pathlib.Path(path).expanduser()
        if p.is_file():
            if kind(p) is None:
                raise ValueError(f"input {path} is not a {'/'.join(suffixes)} file; pass data files or folders")
            cands = [p]
        elif p.is_dir():
            if _is_prepared_dir(p):
                raise ValueError(f"input {path} is a prepared folder (manifest.json), not raw data; pass the raw files")
            cands = [f for f in p.rglob("*") if f.is_file() and kind(f) is not None]
            # Shards prepared earlier inside an input folder are output, not input.
            prepared = {f.parent for f in cands if f.name == "manifest.json" and _is_prepared_dir(f.parent)}
            cands = [f for f in cands if not any(f.is_relative_to(d) for d in prepared)]
        elif any(c in path for c in "*?["):
            cands = [pathlib.Path(f) for f in glob.glob(os.path.expanduser(path), recursive=True)]
            cands = [f for f in cands if f.is_file() and kind(f) is not None]
        else:
            raise ValueError(f"input {path} does not exist; pass a folder or files of .txt/.jsonl/.parquet data")
        if skip_root is not None:
            cands = [f for f in cands if not f.resolve().is_relative_to(skip_root)]
        if not cands:
            held = _describe_dir(p) if p.is_dir() else ""
            raise ValueError(
                f"input {path} has no {'/'.join('*' + e for e in suffixes)} files{held}; "
                "point --input at the data files"
            )
        for f in cands:
            found.setdefault(str(f), kind(f))
    return [(found[f], f) for f in sorted(found)]


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _parquet_chunks(path: str) -> list[Chunk]:
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise BadDataError(
            path, CORRUPT, _first_line(e), fix="not a readable parquet file; re-download or remove it"
        ) from None
    schema = pf.schema_arrow
    if TEXT_KEY not in schema.names:
        raise BadDataError(
            path,
            NO_TEXT,
            f"columns: {', '.join(schema.names)}",
            fix=f"data.dataset=fineweb_edu expects the FineWeb-Edu schema with a '{TEXT_KEY}' column",
        )
    tp = schema.field(TEXT_KEY).type
    if not any(
        is_kind(tp)
        for is_kind in (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary, pa.types.is_large_binary)
    ):
        raise BadDataError(path, NO_TEXT, f"the '{TEXT_KEY}' column has type {tp}", fix="it must hold strings")
    meta = pf.metadata
    return [("parquet", path, i, 0) for i in range(meta.num_row_groups) if meta.row_group(i).num_rows > 0]


def _check_jsonl_head(path: str) -> None:
    """Raises when the first record is an object without a `text` string: the whole file lacks the field."""
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                break
        else:
            return
    _, why = _jsonl_text(line.strip())
    if why is not None and why[0] == NO_TEXT and "is not a string" not in why[1]:
        raise BadDataError(path, NO_TEXT, f"first record has {why[1]}", "line 1", fix=_FIXES[NO_TEXT])


def index_chunks(files: Sequence[str], dataset: str, on_skip: OnSkip | None = None) -> list[Chunk]:
    """All chunks of `files` in a fixed order (the same on every process).

    Empty (0-byte) files are left out and reported to `on_skip` when given; whole-file
    problems raise BadDataError (see the module docstring).
    """
    chunks: list[Chunk] = []
    for f in files:
        size = os.path.getsize(f)
        if size == 0:
            if on_skip is not None:
                on_skip(Skip(str(f), EMPTY_FILE))
            continue
        if dataset == "fineweb_edu":
            chunks.extend(_parquet_chunks(f))
        elif dataset == "jsonl":
            _check_jsonl_head(f)
            chunks.extend(("jsonl", f, s, min(s + JSONL_CHUNK_BYTES, size)) for s in range(0, size, JSONL_CHUNK_BYTES))
        elif dataset == "text":
            chunks.append(("text", f, 0, 0))
        else:  # pragma: no cover - callers pass a known dataset
            raise ValueError(f"unknown file dataset {dataset!r}")
    return chunks


def _jsonl_text(line: bytes) -> tuple[str | None, tuple[str, str] | None]:
    """(text, None) for a good jsonl line, else (None, (reason, detail))."""
    try:
        obj = json.loads(line)
    except UnicodeDecodeError as e:
        return None, (NOT_UTF8, f"byte {e.start} of the line")
    except json.JSONDecodeError as e:
        return None, (BAD_JSON, e.msg)
    if not isinstance(obj, dict):
        return None, (NO_TEXT, f"a JSON {type(obj).__name__}, not an object")
    text = obj.get(TEXT_KEY)
    if not isinstance(text, str):
        keys = ", ".join(list(obj)[:8])
        return None, (NO_TEXT, f"keys: {keys}" if TEXT_KEY not in obj else f"'{TEXT_KEY}' is not a string")
    if b"\\u" in line:
        # Only a \u escape can carry a lone surrogate, which no tokenizer can encode.
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return None, (NOT_UTF8, "a \\u escape of a lone surrogate")
    return text, None


def _read_jsonl_range(path: str, start: int, end: int, on_skip: OnSkip | None) -> list[str]:
    docs = []
    with open(path, "rb") as f:
        if start > 0:
            # A line belongs to the range it starts in: skip the tail of one begun earlier.
            f.seek(start - 1)
            if f.read(1) != b"\n":
                f.readline()
        while f.tell() < end:
            line_start = f.tell()
            line = f.readline()
            if not line:
                break
            line = line.strip()
            if not line:
                continue
            text, why = _jsonl_text(line)
            if why is not None:
                _bad(on_skip, path, why[0], why[1], f"byte {line_start}")
                continue
            docs.append(text)
    return docs


def _read_parquet_row_group(path: str, row_group: int, on_skip: OnSkip | None) -> list[str]:
    try:
        col = pq.ParquetFile(path).read_row_group(row_group, columns=[TEXT_KEY]).column(TEXT_KEY)
    except (pa.ArrowException, OSError) as e:
        raise BadDataError(
            path, CORRUPT, _first_line(e), f"row group {row_group}", fix="re-download or remove the file"
        ) from None
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        try:
            return col.to_pylist()
        except UnicodeDecodeError:
            pass  # arrow did not validate the strings: decode row by row below
    docs = []
    for i, raw in enumerate(col.cast(pa.large_binary()).to_pylist()):
        if raw is None:
            continue
        try:
            docs.append(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            _bad(on_skip, path, NOT_UTF8, f"byte {e.start}", f"row {i} of row group {row_group}")
    return docs


def _read_text_file(path: str, on_skip: OnSkip | None) -> list[str]:
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return [raw.decode("utf-8")]
    except UnicodeDecodeError as e:
        _bad(on_skip, path, NOT_UTF8, f"byte {e.start}: {raw[e.start : e.start + 4]!r}", "")
        return []


def read_chunk(chunk: Chunk, on_skip: OnSkip | None = None) -> list[str]:
    """The documents of one chunk, in file order (empty documents dropped).

    Bad records are dropped and reported to `on_skip`, or raise BadDataError without it.
    """
    kind, path, a, b = chunk
    if kind == "parquet":
        docs = _read_parquet_row_group(path, a, on_skip)
    elif kind == "jsonl":
        docs = _read_jsonl_range(path, a, b, on_skip)
    elif kind == "text":
        docs = _read_text_file(path, on_skip)
    else:  # pragma: no cover
        raise ValueError(f"unknown chunk kind {kind!r}")
    return [d for d in docs if d]


def doc_hash_unit(text: str) -> float:
    """A stable hash of the document text mapped to [0, 1)."""
    digest = hashlib.blake2b(text.encode("utf-8", errors="replace"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


def in_split(text: str, split: str, val_fraction: float) -> bool:
    """Validation holds the documents whose hash falls below `val_fraction`; train the rest.

    Identical documents always land on the same side, so exact duplicates cannot leak
    from train into validation.
    """
    is_val = doc_hash_unit(text) < val_fraction
    return is_val if split == "val" else not is_val


def chunks_digest(chunks: Sequence[Chunk]) -> str:
    """Short fingerprint of the chunk list, stored in iterator states to catch a changed corpus."""
    h = hashlib.blake2b(digest_size=8)
    for c in chunks:
        h.update(repr((c[0], os.path.basename(c[1]), c[2], c[3])).encode())
    return h.hexdigest()
