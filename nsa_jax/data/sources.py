"""Local document sources: parquet (FineWeb-Edu schema), jsonl and plain-text files.

Owns finding the data files under `data.path`, cutting them into *chunks* (the unit
that is sharded over processes and shuffled), reading one chunk's documents, and the
train/val assignment of a document by a hash of its text.

Chunks:
  parquet  one row group of one file (FineWeb-Edu shards have many), `text` column only
  jsonl    a byte range of one file (lines are assigned to the range they start in),
           so one large file still spreads over processes without an index pass
  text     one .txt file = one document

A chunk is a plain tuple (kind, path, a, b), cheap to pass around and to hash.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import pathlib
from typing import Sequence

TEXT_KEY = "text"
JSONL_CHUNK_BYTES = 16 << 20  # byte range per jsonl chunk

EXTENSIONS = {
    "fineweb_edu": (".parquet",),
    "jsonl": (".jsonl", ".json"),
    "text": (".txt",),
}

Chunk = tuple  # (kind, path, a, b)


def list_files(path: str, dataset: str) -> list[str]:
    """Sorted data files for `dataset` at `path` (a directory, searched recursively; a file; or a glob)."""
    exts = EXTENSIONS[dataset]
    if not path:
        hub = " (streaming from the hub needs a network and the `datasets` package)" if dataset == "fineweb_edu" else ""
        raise ValueError(
            f"data.path is empty for data.dataset={dataset}; pass --data-path DIR holding "
            f"{'/'.join('*' + e for e in exts)} files{hub}"
        )
    p = pathlib.Path(path).expanduser()
    if p.is_file():
        files = [str(p)]
    elif p.is_dir():
        files = sorted(str(f) for f in p.rglob("*") if f.is_file() and f.name.endswith(exts))
    elif any(c in path for c in "*?["):
        files = sorted(f for f in glob.glob(os.path.expanduser(path), recursive=True) if os.path.isfile(f))
    else:
        raise ValueError(f"data.path {path} does not exist; pass --data-path DIR holding the {dataset} files")
    if not files:
        raise ValueError(
            f"data.path {path} has no {'/'.join('*' + e for e in exts)} files for data.dataset={dataset}; "
            "point --data-path at the directory with the data files"
        )
    return files


def _parquet_chunks(path: str) -> list[Chunk]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    if TEXT_KEY not in names:
        raise ValueError(
            f"parquet file {path} has no '{TEXT_KEY}' column (columns: {', '.join(names)}); "
            "data.dataset=fineweb_edu expects the FineWeb-Edu schema"
        )
    meta = pf.metadata
    return [("parquet", path, i, 0) for i in range(meta.num_row_groups) if meta.row_group(i).num_rows > 0]


def index_chunks(files: Sequence[str], dataset: str) -> list[Chunk]:
    """All chunks of `files` in a fixed order (the same on every process)."""
    chunks: list[Chunk] = []
    for f in files:
        if dataset == "fineweb_edu":
            chunks.extend(_parquet_chunks(f))
        elif dataset == "jsonl":
            size = os.path.getsize(f)
            chunks.extend(("jsonl", f, s, min(s + JSONL_CHUNK_BYTES, size)) for s in range(0, size, JSONL_CHUNK_BYTES))
        elif dataset == "text":
            chunks.append(("text", f, 0, 0))
        else:  # pragma: no cover - callers pass a known dataset
            raise ValueError(f"unknown file dataset {dataset!r}")
    return chunks


def _read_jsonl_range(path: str, start: int, end: int) -> list[str]:
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
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{path}: invalid JSON at byte {line_start} ({e.msg}); fix or remove the line"
                ) from None
            text = obj.get(TEXT_KEY) if isinstance(obj, dict) else None
            if not isinstance(text, str):
                raise ValueError(f"{path}: line at byte {line_start} has no '{TEXT_KEY}' string field")
            docs.append(text)
    return docs


def read_chunk(chunk: Chunk) -> list[str]:
    """The documents of one chunk, in file order (empty documents dropped)."""
    kind, path, a, b = chunk
    if kind == "parquet":
        import pyarrow.parquet as pq

        col = pq.ParquetFile(path).read_row_group(a, columns=[TEXT_KEY]).column(TEXT_KEY)
        docs = col.to_pylist()
    elif kind == "jsonl":
        docs = _read_jsonl_range(path, a, b)
    elif kind == "text":
        with open(path, encoding="utf-8", errors="replace") as f:
            docs = [f.read()]
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
