"""`python -m launch.prepare_data --input DIR_OR_FILES... --output DIR [--tokenizer byte|PATH.json|gpt2]`

Tokenizes a corpus once into memory-mappable shards that `data.dataset: tokenized`
trains from (format: nsa_jax/data/shards.py). Reads every .txt (one document per file),
.jsonl/.json (one {"text": ...} object per line) and .parquet (a `text` column) file
under the inputs with the readers of the file pipeline (nsa_jax/data/sources.py),
appends EOS to each document and routes it to the train or val shards by the
pipeline's document-hash rule (`--val-fraction`), so val documents never appear in
train shards.

Options:
  --shard-tokens N    tokens per shard (documents are never split; a shard closes at
                      the first document end at or past N)
  --val-fraction F    share of documents (by hash of their text) in the val split; when none
                      falls in it (a corpus of few documents: a .txt file is one) the last
                      max(F of the tokens, 4096 where the text has 10x that) tokens of the
                      train text become the val split, cut inside a document (a `note:` says
                      so; manifest.json: val_holdout)
  --seed S            order in which the input chunks (files, row groups, jsonl
                      ranges) are written, so every shard mixes sources
  --overwrite         replace a prepared folder (only its manifest, shard and temp files)
  --strict            stop at the first bad file or record instead of skipping it
  --text-suffixes .py,.rst  files ending so are plain text too (one document each): source
                      code and docs, such as the Python standard library's

Bad data: an empty file, a corrupt or text-less parquet file, a jsonl file without a
`text` field is skipped whole; a jsonl line that is not JSON or has no `text` string
and a document that is not UTF-8 are skipped one by one. Every skip is counted and
listed (reason, file, place) in the summary and in manifest.json.

Shards are written under temporary names and renamed when complete; manifest.json is
written last, so an interrupted run never leaves a manifest pointing at partial
shards; a run that fails removes the output folder it created while that is still
empty. Progress goes to stderr (a bar on a terminal, a line every 10 s otherwise), the
summary to stdout. Bad input prints one `error: ...` line and exits with status 2.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import pathlib
import sys
import time
from typing import Any, TextIO

import numpy as np
import pyarrow.parquet as pq
import tqdm

from launch.cli import Parser
from nsa_jax.data import shards, sources
from nsa_jax.data.tokenizers import make_tokenizer
from nsa_jax.words import count

DEFAULT_SHARD_TOKENS = 1 << 27  # 128 Mi tokens: 256 MiB of uint16 per shard
PROGRESS_EVERY_S = 10.0  # progress line interval when stderr is not a terminal
BAR_EVERY_S = 0.2  # progress bar redraw interval on a terminal
EXAMPLES_PER_REASON = 5  # skipped places listed per reason in the summary
EXAMPLES_IN_MANIFEST = 100  # skipped records listed in manifest.json (all skipped files are)
MIN_HOLDOUT_TOKENS = 4096  # tokens held out as val when no document fell in it (corpus permitting)
TOO_FEW_TO_HOLD_OUT = 16  # a held-out tail shorter than this is no measurement: no val split then


class PrepareError(ValueError):
    """Bad input or output for prepare_data: printed as one `error:` line."""


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m launch.prepare_data", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--input", nargs="+", required=True, metavar="DIR_OR_FILE", help="folders, files or globs")
    p.add_argument("--output", required=True, metavar="DIR", help="folder for the shards and manifest.json")
    p.add_argument("--tokenizer", default="byte", help="byte, gpt2, or a tokenizer.json path (default: byte)")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard")
    p.add_argument("--val-fraction", type=float, default=0.01, help="share of documents in val (default 0.01)")
    p.add_argument("--seed", type=int, default=0, help="order in which input chunks are written (default 0)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier prepared folder at --output")
    p.add_argument("--strict", action="store_true", help="stop at the first bad file or record")
    p.add_argument(
        "--text-suffixes",
        type=lambda v: tuple(x if x.startswith(".") else f".{x}" for x in v.split(",") if x),
        default=(),
        metavar=".py,.rst",
        help="files ending so are plain text too, one document each (source code, docs)",
    )
    return p


# ---------------------------------------------------------------------------
# skips


class SkipRecorder:
    """Collects skipped files (found while indexing) and records (found while reading)."""

    def __init__(self, strict: bool):
        self.strict = strict
        self.files: list[sources.Skip] = []
        self.records: list[sources.Skip] = []
        self.record_counts: dict[str, int] = {}
        self.phase = "index"

    def __call__(self, skip: sources.Skip) -> None:
        if self.strict:
            raise sources.BadDataError(skip.path, skip.reason, skip.detail, skip.where, "--strict stops at bad data")
        if self.phase == "index":
            self.files.append(skip)
        else:
            self.record_counts[skip.reason] = self.record_counts.get(skip.reason, 0) + 1
            if len(self.records) < EXAMPLES_IN_MANIFEST:
                self.records.append(skip)

    def add_error(self, e: sources.BadDataError) -> None:
        self(sources.Skip(e.path, e.reason, e.detail, e.where))

    @property
    def n_records(self) -> int:
        return sum(self.record_counts.values())

    def lines(self) -> list[str]:
        """The summary's skip section: one line per reason with a few places."""

        def place(s: sources.Skip) -> str:
            at = f" at {s.where}" if s.where else ""
            return f"{s.path}{at}" + (f" ({s.detail})" if s.detail else "")

        out = []
        for title, skips, counts in (
            ("files", self.files, None),
            ("records", self.records, self.record_counts),
        ):
            by_reason: dict[str, list[sources.Skip]] = {}
            for s in skips:
                by_reason.setdefault(s.reason, []).append(s)
            for reason, group in sorted(by_reason.items()):
                n = counts[reason] if counts else len(group)
                shown = "; ".join(place(s) for s in group[:EXAMPLES_PER_REASON])
                more = f"; ... {n - EXAMPLES_PER_REASON} more" if n > EXAMPLES_PER_REASON else ""
                out.append(f"    {reason}: {count(n, title[:-1])} ({shown}{more})")
        return out

    def manifest(self) -> dict[str, Any]:
        return {
            "files": [_skip_dict(s) for s in self.files],
            "records": dict(sorted(self.record_counts.items())),
            "record_examples": [_skip_dict(s) for s in self.records],
        }


def _skip_dict(s: sources.Skip) -> dict[str, str]:
    return {"path": s.path, "reason": s.reason, "detail": s.detail, "where": s.where}


# ---------------------------------------------------------------------------
# progress


class Progress:
    """Documents, tokens and MB/s of text: a tqdm bar on a terminal, a line every PROGRESS_EVERY_S otherwise.

    The bar counts input bytes (what the fraction is of); the postfix has the MB/s of
    decoded text, the same figure as the summary line.
    """

    def __init__(self, total_bytes: int, stream: TextIO, t0: float | None = None):
        self.total_bytes, self.stream = max(total_bytes, 1), stream
        self.tty = hasattr(stream, "isatty") and stream.isatty()
        self.last = time.perf_counter()
        self.t0 = self.last if t0 is None else t0  # the run's start: the same MB/s as the summary
        self.bar = None
        if self.tty:
            self.bar = tqdm.tqdm(
                total=self.total_bytes,
                file=stream,
                desc="prepare_data",
                unit="B",
                unit_scale=True,
                mininterval=BAR_EVERY_S,
            )

    def update(self, done_bytes: int, docs: int, tokens: int, text_bytes: int, force: bool = False) -> None:
        now = time.perf_counter()
        mb_s = text_bytes / 1e6 / max(now - self.t0, 1e-9)
        if self.bar is not None:
            self.bar.set_postfix_str(f"{docs:,} docs {tokens:,} tokens, text {mb_s:.1f} MB/s", refresh=False)
            self.bar.update(min(done_bytes, self.total_bytes) - self.bar.n)  # redraws at most every BAR_EVERY_S
            if force:
                self.bar.refresh()
            return
        if not force and now - self.last < PROGRESS_EVERY_S:
            return
        self.last = now
        frac = min(done_bytes / self.total_bytes, 1.0)
        self.stream.write(f"prepare_data: {100 * frac:5.1f}% {docs:,} docs {tokens:,} tokens {mb_s:.1f} MB/s\n")
        self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---------------------------------------------------------------------------
# output folder


def prepare_output(out: pathlib.Path, overwrite: bool) -> list[pathlib.Path]:
    """Creates `out`, or refuses a non-empty one unless `overwrite` (then deletes only our own files).

    Returns the folders it created (`out` and missing parents, outermost first), which a failed
    run removes again while they are empty (`remove_empty`)."""
    if out.exists() and not out.is_dir():
        raise PrepareError(f"--output {out} exists and is not a directory; choose another --output")
    if not out.exists():
        created = [d for d in [*reversed(out.parents), out] if not d.exists()]
        out.mkdir(parents=True)
        return created
    present = sorted(p.name for p in out.iterdir())
    if not present:
        return []
    if not overwrite:
        shown = ", ".join(present[:3]) + (f", ... ({len(present)} entries)" if len(present) > 3 else "")
        raise PrepareError(
            f"--output {out} is not empty ({shown}); choose an empty or new folder, or pass --overwrite to "
            "replace an earlier prepare_data output there"
        )
    manifest = out / shards.MANIFEST
    if manifest.exists() and not shards.is_prepared(out):
        raise PrepareError(
            f"--output {out} holds a {shards.MANIFEST} that prepare_data did not write; --overwrite only replaces "
            "prepare_data's own files; choose another --output"
        )
    # The manifest goes first: from here on the folder never claims the old shards.
    manifest.unlink(missing_ok=True)
    for name in present:
        if shards.is_own_file(name) and (out / name).is_file():
            (out / name).unlink()
    return []


def remove_empty(created: list[pathlib.Path]) -> None:
    """Removes the folders of `created` (outermost first) that are still empty, innermost first: a failed
    run leaves no empty output folder behind. A folder that holds anything (complete shards of an
    interrupted run) stays."""
    for d in reversed(created):
        try:
            d.rmdir()
        except OSError:  # not empty, or gone
            return


# ---------------------------------------------------------------------------
# the run


def _chunk_bytes(chunk: sources.Chunk, sizes: dict[str, int], rows: dict[str, tuple[int, list[int]]]) -> int:
    """Input bytes a chunk stands for (for the progress fraction only)."""
    kind, path, a, b = chunk
    if kind == "jsonl":
        return b - a
    if kind == "parquet":
        total, per_group = rows[path]
        return sizes[path] * per_group[a] // max(total, 1)
    return sizes[path]


def _parquet_rows(path: str) -> tuple[int, list[int]]:
    meta = pq.ParquetFile(path).metadata
    per_group = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
    return sum(per_group), per_group


def run(args: argparse.Namespace, out_stream: TextIO | None = None, err_stream: TextIO | None = None) -> int:
    """The whole job; raises PrepareError / ValueError for bad input, BadDataError under --strict."""
    out_stream = sys.stdout if out_stream is None else out_stream
    err_stream = sys.stderr if err_stream is None else err_stream
    if not 0.0 <= args.val_fraction < 1.0:
        raise PrepareError(f"--val-fraction must lie in [0, 1), got {args.val_fraction}")
    if args.shard_tokens <= 0:
        raise PrepareError(f"--shard-tokens must be positive, got {args.shard_tokens}")
    try:
        tokenizer = make_tokenizer(args.tokenizer)
    except ValueError as e:  # phrased for the config key; here it is the flag
        raise PrepareError(str(e).replace("data.tokenizer", "--tokenizer")) from None
    out = pathlib.Path(args.output).expanduser()
    files = sources.find_input_files(args.input, exclude=str(out), text_suffixes=args.text_suffixes)
    created = prepare_output(out, args.overwrite)
    try:
        return _prepare(args, tokenizer, out, files, out_stream, err_stream)
    except BaseException:
        remove_empty(created)
        raise


def _prepare(args, tokenizer, out: pathlib.Path, files, out_stream: TextIO, err_stream: TextIO) -> int:
    """`run` once the output folder is ready."""
    t0 = time.perf_counter()

    skips = SkipRecorder(args.strict)
    sizes = {path: os.path.getsize(path) for _, path in files}
    chunks, used, rows = _index_inputs(files, skips, args.strict)
    skips.phase = "read"
    # Written in a seeded order of chunks so that each shard mixes the sources.
    order = np.random.default_rng(args.seed).permutation(len(chunks))
    chunks = [chunks[i] for i in order]

    dtype = shards.token_dtype(tokenizer.vocab_size)
    writers = {s: shards.ShardWriter(out, s, dtype, args.shard_tokens) for s in shards.SPLITS}
    progress = Progress(sum(_chunk_bytes(c, sizes, rows) for c in chunks), err_stream, t0)
    entries, text_bytes = _write_shards(args, chunks, tokenizer, dtype, writers, skips, progress, (sizes, rows))
    elapsed = time.perf_counter() - t0

    n_docs = sum(w.documents for w in writers.values())
    if n_docs == 0:
        for line in skips.lines():
            print(line.strip(), file=err_stream)
        raise PrepareError(
            f"no documents found in {' '.join(args.input)} ({count(len(files), 'file')}, {len(skips.files)} skipped, "
            f"{count(skips.n_records, 'bad record')}); no manifest written"
        )
    splits = {s: {"tokens": w.tokens, "documents": w.documents, "shards": len(w.shards)} for s, w in writers.items()}
    holdout = None
    if splits["val"]["documents"] == 0 and args.val_fraction > 0:
        entries, holdout = _hold_out(out, entries, dtype, splits, args.val_fraction, n_docs, err_stream)
    manifest = _manifest(args, tokenizer, dtype, splits, entries, holdout)
    manifest["sources"] = [{"path": str(pathlib.Path(p).resolve()), "kind": k, "bytes": sizes[p]} for k, p in used]
    manifest["skipped"] = skips.manifest()
    shards.write_manifest(out, manifest)

    n_tokens = sum(w.tokens for w in writers.values())
    mb = text_bytes / 1e6
    print(
        f"prepare_data: {count(n_docs, 'document')}, {count(n_tokens, 'token')}, {count(len(entries), 'shard')} from "
        f"{count(len(used), 'file')} "
        f"({mb:.1f} MB of text) in {elapsed:.1f} s, {mb / max(elapsed, 1e-9):.1f} MB/s -> {out}",
        file=out_stream,
    )
    for s, info in splits.items():
        print(
            f"  {s}: {count(info['documents'], 'document')}, {count(info['tokens'], 'token')}, "
            f"{count(info['shards'], 'shard')}",
            file=out_stream,
        )
    print(
        f"  tokenizer {args.tokenizer} (vocab {tokenizer.vocab_size}, eos {tokenizer.eos_id}), {dtype.name}",
        file=out_stream,
    )
    if args.val_fraction == 0:
        print("  val: none (--val-fraction 0): a training run on this folder evaluates nothing", file=out_stream)
    print(f"  skipped: {count(len(skips.files), 'file')}, {count(skips.n_records, 'record')}", file=out_stream)
    for line in skips.lines():
        print(line, file=out_stream)
    return 0


def _index_inputs(files, skips, strict: bool) -> tuple[list, list[tuple[str, str]], dict]:
    """(chunks of every input, the (dataset, path) of the files that gave some, parquet row counts)."""
    chunks: list[sources.Chunk] = []
    used: list[tuple[str, str]] = []
    rows: dict[str, tuple[int, list[int]]] = {}
    for dataset, path in files:
        try:
            found = sources.index_chunks([path], dataset, on_skip=skips)
            if found and dataset == "fineweb_edu":
                rows[path] = _parquet_rows(path)
        except sources.BadDataError as e:
            if strict:
                raise
            skips.add_error(e)
            continue
        if found:
            chunks.extend(found)
            used.append((dataset, path))
    return chunks, used, rows


def _write_shards(args, chunks, tokenizer, dtype, writers, skips, progress, sizes_rows) -> tuple[list[dict], int]:
    """Tokenizes every chunk into the train and val writers; (shard entries, bytes of text read)."""
    sizes, rows = sizes_rows
    done_bytes = text_bytes = 0

    def report(force: bool = False) -> None:
        docs, tokens = sum(w.documents for w in writers.values()), sum(w.tokens for w in writers.values())
        progress.update(done_bytes, docs, tokens, text_bytes, force=force)

    try:
        for chunk in chunks:
            try:
                docs = sources.read_chunk(chunk, on_skip=skips)
            except sources.BadDataError as e:
                if args.strict:
                    raise
                skips.add_error(e)
                docs = []
            by_split: dict[str, list[str]] = {s: [] for s in shards.SPLITS}
            for d in docs:
                by_split["val" if sources.in_split(d, "val", args.val_fraction) else "train"].append(d)
                text_bytes += len(d.encode("utf-8"))
            for split, split_docs in by_split.items():
                if split_docs:
                    writers[split].add(*shards.encode_docs(tokenizer, split_docs, dtype))
            done_bytes += _chunk_bytes(chunk, sizes, rows)
            report()
        entries = [e for s in shards.SPLITS for e in writers[s].finish()]
    except BaseException:
        for w in writers.values():
            w.abort()
        progress.close()
        raise
    report(force=True)
    progress.close()
    return entries, text_bytes


def _manifest(args, tokenizer, dtype, splits: dict, entries: list[dict], holdout: dict | None) -> dict:
    """manifest.json up to its sources and skips (the caller adds them, in that order)."""
    tok_id = shards.tokenizer_identity(args.tokenizer)
    spec = args.tokenizer
    if tok_id["kind"] == "json":
        spec = str(pathlib.Path(args.tokenizer).expanduser().resolve())
    return {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "tokenizer": {
            **tok_id,
            "spec": spec,
            "vocab_size": int(tokenizer.vocab_size),
            "eos_id": int(tokenizer.eos_id),
            "pad_id": int(tokenizer.pad_id),
        },
        "dtype": dtype.name,
        "eos_id": int(tokenizer.eos_id),
        "val_fraction": args.val_fraction,
        "split_rule": "val when blake2b-64 of the document's UTF-8 text / 2**64 < val_fraction "
        "(nsa_jax.data.sources.in_split)"
        + (
            "; no document fell in val, so the last tokens of the train text were held out as val (val_holdout)"
            if holdout
            else ""
        ),
        **({"val_holdout": holdout} if holdout else {}),
        "seed": args.seed,
        "shard_tokens": args.shard_tokens,
        "splits": splits,
        "shards": entries,
    }


def holdout_tokens(train_tokens: int, val_fraction: float) -> int:
    """Tokens to hold out as val when no document fell in it: the val fraction of the text, at least
    MIN_HOLDOUT_TOKENS where the corpus has ten times that, and never more than half of it; 0 when that
    is under TOO_FEW_TO_HOLD_OUT tokens (no measurement)."""
    want = min(
        max(math.ceil(val_fraction * train_tokens), min(MIN_HOLDOUT_TOKENS, train_tokens // 10)), train_tokens // 2
    )
    return want if want >= TOO_FEW_TO_HOLD_OUT else 0


def _hold_out(
    out: pathlib.Path,
    entries: list[dict[str, Any]],
    dtype: np.dtype,
    splits: dict[str, dict[str, int]],
    val_fraction: float,
    n_docs: int,
    err_stream: TextIO,
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """No document fell in the val split: the end of the train text becomes it (shards.hold_out_tail).

    Returns the new shard entries and the manifest's `val_holdout` record (None, with a
    warning, when the text is too short to spare any)."""
    train = [e for e in entries if e["split"] == "train"]
    want = holdout_tokens(splits["train"]["tokens"], val_fraction)
    why = f"none of the {count(n_docs, 'document')} fell in the --val-fraction {val_fraction} hash split"
    if want < 1 or not train:
        print(
            f"warning: {why}, and {splits['train']['tokens']:,} tokens are too few to hold any out: no val split; "
            "a training run on this folder evaluates nothing",
            file=err_stream,
        )
        return entries, None
    train, val = shards.hold_out_tail(out, train, dtype, want)
    splits["train"].update(tokens=sum(e["tokens"] for e in train), documents=sum(e["documents"] for e in train))
    splits["val"].update(tokens=val["tokens"], documents=val["documents"], shards=1)
    share = val["tokens"] / max(val["tokens"] + splits["train"]["tokens"], 1)
    print(
        f"note: {why} (a .txt file counts as one document); held out the last {val['tokens']:,} tokens "
        f"({100 * share:.1f}%) of the train text as the val split instead, cut inside a document",
        file=err_stream,
    )
    return train + [val], {"tokens": int(val["tokens"]), "from": train[-1]["tokens_file"]}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (PrepareError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            f"error: interrupted; no manifest written in {args.output} (pass --overwrite to start over)",
            file=sys.stderr,
        )
        return 130


if __name__ == "__main__":
    sys.exit(main())
