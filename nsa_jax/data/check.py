"""Data checks run before training touches its out dir: one line per problem, naming the file and the fix.

`check_data(cfg)` looks at `cfg.data` the way the streams will read it, without jax:
  - file datasets (text, jsonl, fineweb_edu): the files are listed and indexed (sources.list_files /
    index_chunks raise for a missing path, no data files, a corrupt parquet file), then chunks are read in
    order until one training and one validation document (the document-hash rule, data.val_fraction) are
    found, within SCAN_BYTES of input or SCAN_SECONDS. No chunk at all (every file empty), or no usable
    training document (every file skipped: not UTF-8, no text), is a ValueError naming the files and why;
  - tokenized: the manifest (shards.read_manifest raises for a folder that is not prepared) must list
    training tokens, and its tokenizer must be data.tokenizer and fit model.vocab_size;
  - synthetic, kv_recall, needle: generated, nothing to check.

`DataCheck.no_val` is None when validation data exists (or was not ruled out within the scan budget),
else one line saying why there is none and how to get some; the trainer then evaluates nothing and says
so at boot. `DataCheck.train_rows`: the training rows of train.seq_len + 1 tokens in one pass over the
data, where it is cheap to know (a prepared folder's manifest; files of at most COUNT_BYTES, tokenized
whole); `repeat_note` turns it into the boot note of a run that reads its data REPEAT_NOTE_AT times or
more, so a tiny corpus is not mistaken for a learning result.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from nsa_jax.data import shards, sources
from nsa_jax.data.tokenizers import make_tokenizer
from nsa_jax.words import count

SCAN_BYTES = 256 << 20  # input bytes read at most while looking for a train and a val document
SCAN_SECONDS = 10.0
# Corpora of at most this many bytes are tokenized whole to count their rows (a second or two).
COUNT_BYTES = 16 << 20
# A run that reads its training data this many times or more gets a note at boot.
REPEAT_NOTE_AT = 2
PREPARE_HINT = (
    "to hold out part of a small corpus, prepare it once with python -m launch.prepare_data --input DATA "
    "--output PREPARED (it splits inside documents when too few fall in the validation split) and train with "
    "--dataset tokenized --data-path PREPARED"
)


@dataclasses.dataclass
class DataCheck:
    """What the check found: `no_val` says why there is no validation data (None: there is)."""

    no_val: str | None = None
    train_rows: int | None = None  # rows of seq_len + 1 tokens in one pass over the training data; None: not counted


def _files(n: int, noun: str = "file") -> str:
    return count(n, noun)


def repeat_note(cfg: Any, check: DataCheck) -> str | None:
    """`note: the training data is 12 rows of 257 tokens: 200 steps x 8 rows read it 133 times` when the
    run reads its data REPEAT_NOTE_AT times or more; None otherwise (or when the rows were not counted)."""
    rows, t = check.train_rows, cfg.train
    if not rows:
        return None
    per_step = t.global_batch * t.accumulate
    reads = t.steps * per_step / rows
    if reads < REPEAT_NOTE_AT:
        return None
    return (
        f"note: the training data is {count(rows, 'row')} of {t.seq_len + 1} tokens: "
        f"{count(t.steps, 'step')} x {count(per_step, 'row')} read it {reads:.0f} times"
    )


def _count_train_rows(cfg: Any, files: list[str], chunks: list[Any]) -> int | None:
    """Rows of seq_len + 1 tokens the training split of `chunks` packs into (the pipeline's documents,
    each closed with EOS); None for data over COUNT_BYTES."""
    if sum(os.path.getsize(f) for f in files) > COUNT_BYTES:
        return None
    d = cfg.data
    tokenizer = make_tokenizer(d)
    tokens = 0
    for chunk in chunks:
        for text in sources.read_chunk(chunk, on_skip=lambda skip: None):  # the training stream reports them
            if sources.in_split(text, "train", d.val_fraction):
                tokens += len(tokenizer.encode(text)) + 1
    return tokens // (cfg.train.seq_len + 1)


def describe_skips(skips: list[Any], limit: int = 3) -> str:
    """'a.txt: empty file; b.txt: not UTF-8 (byte 0: ...)' for the first `limit` skipped files."""
    shown = []
    for s in skips[:limit]:
        at = f" at {s.where}" if s.where else ""
        why = f" ({s.detail})" if s.detail else ""
        shown.append(f"{s.path}{at}: {s.reason}{why}")
    more = f"; ... {len(skips) - limit} more" if len(skips) > limit else ""
    return "; ".join(shown) + more


def no_chunks_error(path: str, dataset: str, n_files: int, skips: list[Any]) -> ValueError:
    """The error for a data.path whose files hold no chunk (every file skipped while indexing)."""
    reasons = {s.reason for s in skips}
    if reasons == {sources.EMPTY_FILE}:
        what = f"its {_files(n_files)} {'is' if n_files == 1 else 'are all'} empty (0 bytes)"
        if n_files == 1:
            what = f"its only file {skips[0].path} is empty (0 bytes)"
        return ValueError(f"data.path {path} holds no text: {what}; add text, or point --data-path at the data")
    return ValueError(
        f"data.path {path} holds no usable {dataset} data ({_files(n_files)}, all skipped: {describe_skips(skips)}); "
        "fix or remove them, or point --data-path at the data"
    )


def _fix_for(skips: list[Any]) -> str:
    reasons = {s.reason for s in skips}
    if reasons <= {sources.NOT_UTF8}:
        return "convert text to UTF-8 (e.g. iconv -f latin1 -t utf-8), or remove files that are not text"
    return "fix or remove them"


def _check_files(cfg: Any) -> DataCheck:
    d = cfg.data
    files = sources.list_files(d.path, d.dataset)
    skips: list[Any] = []
    chunks = sources.index_chunks(files, d.dataset, on_skip=skips.append)
    if not chunks:
        raise no_chunks_error(d.path, d.dataset, len(files), skips)
    need_val = d.val_fraction > 0
    found_train = found_val = False
    docs = read = 0
    t0 = time.monotonic()
    scanned_all = True  # False when the budget ran out first: what was not found is not ruled out
    for chunk in chunks:
        if found_train and (found_val or not need_val):
            break
        if read > SCAN_BYTES or time.monotonic() - t0 > SCAN_SECONDS:
            scanned_all = False
            break
        kind, path, a, b = chunk
        read += (b - a) if kind == "jsonl" else os.path.getsize(path) if kind == "text" else 0
        for text in sources.read_chunk(chunk, on_skip=skips.append):
            docs += 1
            if need_val and sources.in_split(text, "val", d.val_fraction):
                found_val = True
            else:
                found_train = True
    if not found_train and scanned_all:
        if docs == 0:
            raise ValueError(
                f"data.path {d.path} holds no usable text ({_files(len(files))}; skipped: "
                f"{describe_skips(skips) or 'every document is empty'}); {_fix_for(skips)}"
            )
        raise ValueError(
            f"data.path {d.path}: all {_files(docs, 'document')} fall in the validation split (data.val_fraction "
            f"{d.val_fraction}, by hash of their text), none is left to train on; lower data.val_fraction or add "
            "documents"
        )
    out = DataCheck(train_rows=_count_train_rows(cfg, files, chunks) if scanned_all else None)
    if d.val_fraction <= 0:
        out.no_val = "data.val_fraction is 0: there is no validation split, so this run evaluates nothing"
    elif not found_val and scanned_all:
        out.no_val = (
            f"none of the {_files(docs, 'document')} of data.path {d.path} falls in the validation split "
            f"(data.val_fraction {d.val_fraction} of the documents, by hash; a {d.dataset} "
            f"{'file' if d.dataset == 'text' else 'record'} is one document), so this run evaluates nothing "
            f"(no val.csv rows); {PREPARE_HINT}"
        )
    return out


def _check_tokenized(cfg: Any) -> DataCheck:
    d = cfg.data
    m = shards.read_manifest(d.path)
    shards.check_manifest_fits(cfg, m)
    tokens = {s: 0 for s in shards.SPLITS}
    for entry in m.get("shards", []):
        if entry.get("split") in tokens:
            tokens[entry["split"]] += int(entry.get("tokens", 0))
    redo = f"re-run python -m launch.prepare_data with --output {d.path} --overwrite"
    if tokens["train"] == 0:
        raise ValueError(
            f"data.path {d.path} has no training tokens (manifest.json: {tokens['val']:,} val tokens); check the "
            f"inputs prepare_data was given (its summary lists skipped files) and {redo}"
        )
    out = DataCheck(train_rows=tokens["train"] // (cfg.train.seq_len + 1))
    if tokens["val"] == 0:
        frac = m.get("val_fraction")
        out.no_val = (
            f"data.path {d.path} has no validation split (prepared with --val-fraction {frac}), so this run "
            f"evaluates nothing (no val.csv rows); for one, {redo} and --val-fraction > 0"
        )
    return out


def check_data(cfg: Any) -> DataCheck:
    """Checks `cfg.data` before training (module docstring); ValueError (one line) when nothing can be trained."""
    kind = cfg.data.dataset
    if kind in sources.FILE_DATASETS:
        return _check_files(cfg)
    if kind == "tokenized":
        return _check_tokenized(cfg)
    return DataCheck()
