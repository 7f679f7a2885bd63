"""`dataset: reviews`: a review-rating fine-tune framed as prompt -> answer (the strategy study's task).

Reads examples with a `label` (0-4: the stars minus one) and a `text` column, Yelp Review Full's
published layout: its parquet files (`train-*.parquet`), or CSV files with a header naming both
(`data.path`: a file, a folder or a glob). Each example is one row of T + 1 tokens:

    [PROMPT with the review, its end cut to fit] [ANSWER " {stars}"] [eos] [eos ... padding]

Only the answer's tokens and the eos after it are in the loss: the dataset yields its rows as
data/targets.LabeledRows with weight 1 there and 0 elsewhere (so the train step never learns the
prompts), and the held-out accuracy (evaluation/heldout.py `retrieval_acc`) is the greedy hit on
the answer's last token, the digit: the rating's accuracy. Every piece is encoded on its own with
the run's tokenizer, as the needle's are.

Splits: a fixed permutation of the examples (the same for every run seed) holds the first
ceil(data.val_fraction * N) out as `val`; `train` is the rest, read as GlobalRowStream rows (a new
seeded permutation each epoch), so a step's rows do not depend on the process or device count and
a resume is exact.

`stdlib_reviews` makes a small labelled set in the same layout from text every machine with Python
has: the docstrings of five standard-library packages, each package a label (the task is then the
docstring's package, with the same prompt and answer format), for tests and CPU runs.
"""

from __future__ import annotations

import ast
import csv
import math
import pathlib
import sysconfig
from typing import Any

import numpy as np

from nsa_jax.data.sources import list_files
from nsa_jax.data.stream import GlobalRowStream, split_id
from nsa_jax.data.targets import LabeledRows, labeled
from nsa_jax.data.tokenizers import make_tokenizer, padded_vocab_size

PROMPT = "Review: {text}\nHow many stars (1-5) does this review give?\nStars:"
ANSWER = " {stars}"
LABELS = 5
COLUMNS = ("label", "text")
EXTENSIONS = (".parquet", ".csv")
SPLIT_SEED = 0x52455657  # the held-out examples are the same whatever train.seed says


def read_examples(path: str) -> tuple[np.ndarray, list[str]]:
    """(labels int [N], texts) of every file at `path` in a fixed order; ValueError naming the file and
    what is wrong (no such files, a missing column with the columns found, a label outside 0-4)."""
    labels, texts = [], []
    for f in list_files(path, "reviews", EXTENSIONS):
        got_labels, got_texts = _read_parquet(f) if f.endswith(".parquet") else _read_csv(f)
        bad = [i for i, x in enumerate(got_labels) if not 0 <= x < LABELS]
        if bad:
            raise ValueError(f"{f}: row {bad[0]} has label {got_labels[bad[0]]}; labels are 0-{LABELS - 1} (stars - 1)")
        labels += got_labels
        texts += got_texts
    if not labels:
        raise ValueError(f"data.path {path} holds no examples for data.dataset=reviews")
    return np.asarray(labels, np.int64), texts


def _missing(f: str, found) -> ValueError:
    return ValueError(
        f"{f} has columns {', '.join(map(str, found)) or '(none)'}; data.dataset=reviews needs "
        f"{' and '.join(COLUMNS)} (Yelp Review Full's layout: label 0-4, text)"
    )


def _read_parquet(f: str) -> tuple[list[int], list[str]]:
    import pyarrow.parquet as pq  # noqa: PLC0415 - only for parquet files

    try:
        table = pq.read_table(f)
    except Exception as e:  # noqa: BLE001 - any reader error is the file's
        raise ValueError(f"{f} is not a readable parquet file ({str(e).splitlines()[0]}); re-download it") from None
    if not set(COLUMNS) <= set(table.column_names):
        raise _missing(f, table.column_names)
    return [int(x) for x in table.column("label").to_pylist()], [str(x) for x in table.column("text").to_pylist()]


def _read_csv(f: str) -> tuple[list[int], list[str]]:
    with open(f, encoding="utf-8", newline="") as fh:
        reader = csv.DictReader(fh)
        if not set(COLUMNS) <= set(reader.fieldnames or ()):
            raise _missing(f, reader.fieldnames or ())
        labels, texts = [], []
        for i, row in enumerate(reader):
            try:
                labels.append(int(row["label"]))
            except ValueError:
                raise ValueError(
                    f"{f}: row {i} has label {row['label']!r}; labels are integers 0-{LABELS - 1}"
                ) from None
            texts.append(row["text"])
    return labels, texts


def split_examples(n: int, val_fraction: float, split: str) -> np.ndarray:
    """Indices of the examples of `split` (a fixed permutation's first ceil(val_fraction * n) are val)."""
    order = np.random.default_rng(SPLIT_SEED).permutation(n)
    n_val = min(max(math.ceil(val_fraction * n), 1), n - 1) if n > 1 else 0
    out = order[:n_val] if split == "val" else order[n_val:]
    return np.sort(out)


def make_row(tokenizer: Any, text: str, label: int, T1: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens [T1], weights [T1 - 1], answers [T1 - 1]) of one example (the module docstring's layout)."""
    head, tail = PROMPT.split("{text}")
    enc = lambda s: [int(t) for t in tokenizer.encode(s)]  # noqa: E731
    head_ids, body, tail_ids, answer = enc(head), enc(text), enc(tail), enc(ANSWER.format(stars=label + 1))
    room = T1 - len(head_ids) - len(tail_ids) - len(answer) - 1
    if room < 1:
        raise ValueError(f"train.seq_len must be >= {T1 - room} for data.dataset=reviews (its prompt and answer)")
    ids = head_ids + body[:room] + tail_ids
    start = len(ids)  # index of the first answer token
    ids += answer + [tokenizer.eos_id]
    eos = tokenizer.eos_id
    tokens = np.full(T1, eos, np.int32)
    tokens[: len(ids)] = ids
    weights = np.zeros(T1 - 1, np.float32)
    weights[start - 1 : start + len(answer)] = 1.0  # the targets of the answer and of its eos
    answers = np.zeros(T1 - 1, bool)
    answers[start + len(answer) - 2] = True  # the answer's last token: the digit
    return tokens, weights, answers


class ReviewsDataset(GlobalRowStream):
    """`dataset: reviews`: one example a row, its answer alone in the loss; see the module docstring."""

    kind = "reviews"

    def __init__(self, cfg: Any, split: str, process_index: int = 0, process_count: int = 1):
        self.tok = make_tokenizer(cfg.data)
        if self.tok.vocab_size > cfg.model.vocab_size:
            raise ValueError(
                f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the {cfg.data.tokenizer!r} tokenizer's "
                f"vocabulary ({self.tok.vocab_size}); set model.vocab_size={padded_vocab_size(self.tok.vocab_size)}"
            )
        labels, texts = read_examples(cfg.data.path)
        idx = split_examples(len(labels), float(cfg.data.val_fraction), split)
        if len(idx) == 0:
            raise ValueError(f"data.path {cfg.data.path} holds too few examples for a {split} split")
        self.labels, self.texts = labels[idx], [texts[i] for i in idx]
        self.seq_len, self.seed, self.split = int(cfg.train.seq_len), int(cfg.train.seed), split
        self._order: tuple[int, np.ndarray] | None = None
        make_row(self.tok, "", 0, self.seq_len + 1)  # a seq_len too short for the prompt: said now
        t = cfg.train
        self._init_rows(t.global_batch, process_index, process_count, t.global_batch * t.accumulate)

    def example_at(self, row: int) -> int:
        """The example of global row `row`: epoch e reads a permutation seeded by (seed, split, e)."""
        n = len(self.labels)
        epoch, at = divmod(int(row), n)
        if self.split == "val":  # held-out rows in their fixed order, for every evaluation alike
            return at
        if self._order is None or self._order[0] != epoch:
            rng = np.random.default_rng([self.seed % 2**32, split_id(self.split), epoch, 0x5256])
            self._order = (epoch, rng.permutation(n))
        return int(self._order[1][at])

    def _make_block(self, k: int) -> LabeledRows:
        start = k * self.block_rows
        rows = [self._row(self.example_at(start + r)) for r in range(self.block_rows)]
        return labeled(*(np.stack(x) for x in zip(*rows)))

    def _row(self, i: int):
        return make_row(self.tok, self.texts[i], int(self.labels[i]), self.seq_len + 1)

    def __next__(self) -> LabeledRows:
        return self._next_local()


# Five standard-library packages whose docstrings make `stdlib_reviews`' labels 0-4.
STDLIB_PACKAGES = ("asyncio", "email", "importlib", "logging", "unittest")


def stdlib_reviews(min_chars: int = 40) -> tuple[list[int], list[str]]:
    """(labels, texts): every module, class and function docstring of at least `min_chars` characters
    in this Python's STDLIB_PACKAGES, labelled by the package's index, in a fixed order."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    labels, texts = [], []
    for label, package in enumerate(STDLIB_PACKAGES):
        files = (
            [root / f"{package}.py"] if (root / f"{package}.py").exists() else sorted((root / package).rglob("*.py"))
        )
        for f in files:
            try:
                tree = ast.parse(f.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError):
                continue
            nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
            for node in nodes:
                doc = ast.get_docstring(node)
                if doc and len(doc) >= min_chars:
                    labels.append(label)
                    texts.append(" ".join(doc.split()))
    return labels, texts


def write_reviews(path: str | pathlib.Path, labels: list[int], texts: list[str]) -> None:
    """A parquet file with Yelp Review Full's columns (label int64, text string)."""
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    pq.write_table(pa.table({"label": pa.array(labels, pa.int64()), "text": pa.array(texts, pa.string())}), str(path))
