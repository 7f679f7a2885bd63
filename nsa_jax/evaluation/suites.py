"""The long-context suites: which rows are built, how they are batched through a scorer, what is reported.

A *scorer* has `batch` (rows per call), `prepare(L)` (get ready for rows of L + 1 tokens; may refuse) and
`__call__(tokens_BxT1) -> (nll_BxT, hit_BxT)`: the model (scorer.ModelScorer) or a stub whose answers are
known (tests). Rows are padded to whole batches with copies of the last row, whose scores are dropped.
Suites (SUITES; docs/LONG_CONTEXT.md, "Evaluating a checkpoint"), each returning a JSON-ready dict:
  - `loss-by-position`: `text(L, n)` rows of held-out text; scoring.loss_by_position per L;
  - `needle`: per L x depth, `samples` rows of data/needle.py, sample s with held-out row s as haystack and
    its own pass key (the same at every depth); accuracy = mean exact match, and mean answer log-probability;
  - `passkey`: the needle grid for a pretrained model, but a row holds exactly L tokens, question and answer
    included, all read by the model; accuracy per L x depth and per L;
  - `kv_recall`: rows of data/kv_recall.py at length L (the config's kv_*); accuracy by query - pair distance;
  - `text`: the text files' tokens (`TextRows.text_tokens`) in non-overlapping windows of L tokens; mean
    next-token loss and perplexity of the first window and of all of them (scoring.text_loss).
`needle` and `passkey` read greedy exact match from one teacher-forced forward; `passkey` and `text` score
rows of exactly L tokens (`_run_exact`: one padding token appended, its prediction dropped). `cell(scorer,
suite, L, settings)` is one (suite, L), the unit launch.evaluate keeps; `assemble` joins cells into the dicts
above (evaluation.json); `run_suites` does both (training's eval.suites). `Settings`: what a cell depends
on besides scorer and L; `text(L, n)`: a `TextRows` or any callable returning int32 [n, L + 1].
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from typing import Any, Callable, Sequence

import numpy as np

from nsa_jax.config import EVAL_SUITES, Config, replace
from nsa_jax.data import make_dataset, make_tokenizer
from nsa_jax.data.kv_recall import make_kv_batch
from nsa_jax.data.needle import answer_mask, make_needle_row, passkey
from nsa_jax.data.targets import batch_tokens
from nsa_jax.evaluation import scoring
from nsa_jax.rundir.files import long_eval_column

# `passkey` and `text` are launch.evaluate's (for a pretrained model); training's eval.suites take EVAL_SUITES.
SUITES = (*EVAL_SUITES, "passkey", "text")
GRID_SUITES = ("needle", "passkey")  # the L x depth grid of pass-key rows
# Tokens of a grid suite's row beyond L: needle's holds L + 1 (the model reads L), passkey's L (it reads them all).
ROW_EXTRA = {"needle": 1, "passkey": 0}
DEFAULT_DEPTHS = tuple(i / 10 for i in range(11))

Rows = Callable[[int, int], np.ndarray]
Advance = Callable[[int], None]


def _noop(n: int) -> None:
    pass


class TextRows:
    """Held-out text rows [n, L + 1]: files given (read whole, joined, cut in order) or the run's `val` split.

    With files, `text_tokens` is their text with the model's tokenizer: each file encoded on
    its own, joined with the tokens of a blank line between two files (the `text` suite);
    the rows are cut from it with a blank line after the last file too.
    """

    def __init__(self, cfg: Config, files: Sequence[str] = ()):
        self.cfg = cfg
        self.tokens: np.ndarray | None = None
        self.text_tokens: np.ndarray | None = None
        if files:
            tok = make_tokenizer(cfg.data)
            parts = [np.asarray(tok.encode(pathlib.Path(f).read_text(encoding="utf-8")), np.int32) for f in files]
            sep = np.asarray(tok.encode("\n\n"), np.int32)
            self.text_tokens = np.concatenate([x for i, p in enumerate(parts) for x in ((sep, p) if i else (p,))])
            self.tokens = np.concatenate([self.text_tokens, sep])
            if len(self.tokens) < 2:
                raise ValueError(f"the text files {', '.join(files)} hold no text")
        self._cache: dict[tuple[int, int], np.ndarray] = {}

    def __call__(self, L: int, n: int) -> np.ndarray:
        if (L, n) not in self._cache:
            self._cache[(L, n)] = self._rows(L, n)
        return self._cache[(L, n)]

    def distinct_rows(self, L: int) -> int | None:
        """How many rows of L + 1 tokens the files hold before a row repeats their text; None: the `val` split."""
        return None if self.tokens is None else len(self.tokens) // (L + 1)

    def _rows(self, L: int, n: int) -> np.ndarray:
        if self.tokens is not None:
            # Consecutive windows of the joined text; a short text repeats (the rows stay real text).
            need = n * (L + 1)
            reps = -(-need // len(self.tokens))
            rows = np.tile(self.tokens, reps)[:need].reshape(n, L + 1)
        else:
            cfg = replace(self.cfg, [f"train.seq_len={L}", f"train.global_batch={n}", "data.prefetch=0"])
            ds = make_dataset(cfg, "val")
            try:
                rows = np.asarray(batch_tokens(next(ds)), np.int32)
            except StopIteration:
                raise ValueError(f"the validation split of data.path holds fewer than {n} rows of {L + 1} tokens")
            finally:
                ds.close()
        V = self.cfg.model.vocab_size
        if rows.max() >= V:
            raise ValueError(f"the held-out text has token id {int(rows.max())}, outside model.vocab_size {V}")
        return rows.astype(np.int32)


def _run_rows(scorer, rows_NxT1: np.ndarray, advance: Advance) -> tuple[np.ndarray, np.ndarray]:
    """(nll_NxT, hit_NxT) of every row, in batches of scorer.batch (the last padded)."""
    B, N = scorer.batch, len(rows_NxT1)
    nll, hit = [], []
    for start in range(0, N, B):
        chunk = rows_NxT1[start : start + B]
        if len(chunk) < B:
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], B - len(chunk), axis=0)])
        n, h = scorer(chunk)
        take = min(B, N - start)
        nll.append(np.asarray(n)[:take])
        hit.append(np.asarray(h)[:take])
        advance(1)
    return np.concatenate(nll), np.concatenate(hit)


def _run_exact(scorer, rows_NxL: np.ndarray, advance: Advance) -> tuple[np.ndarray, np.ndarray]:
    """(nll, hit) [N, L - 1] of rows of exactly L tokens: the predictions of tokens 1..L-1 from a forward over all L.

    The scorer reads a row's first L tokens and predicts the next of each; it gets every row with one
    padding token (0) appended, whose prediction (after the row's last token) is dropped.
    """
    pad_Nx1 = np.zeros((len(rows_NxL), 1), np.int32)
    nll, hit = _run_rows(scorer, np.concatenate([np.asarray(rows_NxL, np.int32), pad_Nx1], axis=1), advance)
    return nll[:, :-1], hit[:, :-1]


def text_windows(tokens_N: np.ndarray, L: int) -> np.ndarray:
    """int32 [N // L, L]: the non-overlapping windows of L tokens, in order (the tail shorter than L left out)."""
    n = len(tokens_N) // L
    return np.asarray(tokens_N[: n * L], np.int32).reshape(n, L)


def batches(n_rows: int, batch: int) -> int:
    return -(-n_rows // batch)


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the suites' rows and figures depend on besides the scorer and the length L."""

    cfg: Config
    text: Rows
    depths: Sequence[float] = DEFAULT_DEPTHS
    samples: int = 2
    rows: int = 4
    seed: int = 0

    @functools.cached_property
    def tokenizer(self) -> Any:
        return make_tokenizer(self.cfg.data)

    def text_tokens(self) -> np.ndarray:
        """The `text` suite's tokens: the text files' (TextRows.text_tokens); ValueError without files."""
        tokens = getattr(self.text, "text_tokens", None)
        if tokens is None:
            raise ValueError("the text suite needs text files (--text FILE ...)")
        return tokens

    def rows_of(self, suite: str, L: int) -> int:
        """Rows one (suite, L) cell scores."""
        if suite in GRID_SUITES:
            return len(self.depths) * self.samples
        if suite == "text":
            return len(self.text_tokens()) // L
        return self.rows


def cell_batches(suite: str, settings: Settings, B: int, L: int) -> int:
    """Scorer calls of one (suite, L) cell with `B` rows a call."""
    return batches(settings.rows_of(suite, L), B)


def needle_rows(
    text: Rows, tokenizer: Any, L: int, depths: Sequence[float], samples: int, seed: int, extra: int = 1
) -> list:
    """The rows of one length, depth-major: [(depth index, sample, NeedleRow)], each of L + `extra` tokens.

    `extra` = ROW_EXTRA[suite]: 1 for `needle` (the model reads L of them), 0 for `passkey`.
    """
    hay = text(L, samples)
    keys = [passkey(np.random.default_rng([seed, L, s])) for s in range(samples)]
    return [
        (d, s, make_needle_row(hay[s], L + extra - 1, depth, keys[s], tokenizer))
        for d, depth in enumerate(depths)
        for s in range(samples)
    ]


def _grid_cell(scorer, L: int, st: Settings, advance: Advance, suite: str = "needle") -> dict:
    """{'accuracy' [depth], 'logprob' [depth], 'rows'}: mean exact match and answer log-probability per depth,
    and each row's own ({'depth', 'sample', 'right', 'logprob'}, depth-major): what two models' answers are
    compared by, prompt by prompt (`results.agreement`)."""
    built = needle_rows(st.text, st.tokenizer, L, st.depths, st.samples, st.seed, ROW_EXTRA[suite])
    tokens = np.stack([r.tokens_T1 for _, _, r in built])
    nll, hit = (_run_exact if suite == "passkey" else _run_rows)(scorer, tokens, advance)
    lp_N, exact_N = scoring.answer_scores(nll, hit, np.stack([answer_mask(r) for _, _, r in built]))
    d_N = np.array([d for d, _, _ in built])
    acc = [float(exact_N[d_N == d].mean()) for d in range(len(st.depths))]
    logp = [float(lp_N[d_N == d].mean()) for d in range(len(st.depths))]
    rows = [
        {"depth": float(st.depths[d]), "sample": int(s), "right": bool(e), "logprob": float(lp)}
        for (d, s, _), e, lp in zip(built, exact_N, lp_N)
    ]
    return {"accuracy": acc, "logprob": logp, "rows": rows}


def _loss_cell(scorer, L: int, st: Settings, advance: Advance) -> dict:
    nll, _ = _run_rows(scorer, st.text(L, st.rows), advance)
    return scoring.loss_by_position(nll)


def _kv_cell(scorer, L: int, st: Settings, advance: Advance) -> dict:
    c = st.cfg
    kv = make_kv_batch(
        np.random.default_rng([st.seed, L]),
        st.rows,
        L,
        c.model.vocab_size,
        c.model.nsa.w,
        c.data.kv_pairs,
        c.data.kv_queries,
        "random",
        c.data.kv_format,
    )
    _, hit = _run_rows(scorer, kv.tokens_BxT1, advance)
    return scoring.kv_by_distance(hit, kv.pair_key_pos_BxQ, kv.query_key_pos_BxQ, L)


def _text_cell(scorer, L: int, st: Settings, advance: Advance) -> dict:
    """{'first': {'loss', 'ppl'}, 'windows': {'loss', 'ppl', 'count'}, 'tokens'} of the text at L.

    scoring.text_loss of the windows' L - 1 predictions each; 'tokens': the text's length in tokens.
    """
    tokens = st.text_tokens()
    if len(tokens) < L:
        raise ValueError(f"the text holds {len(tokens):,} tokens, fewer than L={L:,}")
    nll, _ = _run_exact(scorer, text_windows(tokens, L), advance)
    return {**scoring.text_loss(nll), "tokens": len(tokens)}


_CELLS = {
    "needle": _grid_cell,
    "passkey": functools.partial(_grid_cell, suite="passkey"),
    "loss-by-position": _loss_cell,
    "kv_recall": _kv_cell,
    "text": _text_cell,
}


def cell(scorer, suite: str, L: int, settings: Settings, advance: Advance = _noop) -> dict:
    """One suite at one length L, JSON-ready: the unit an evaluation keeps as soon as it is done.

    `advance(1)` after every scorer call (a progress bar).
    """
    if suite not in _CELLS:
        raise ValueError(f"unknown suite {suite!r}; choose from {', '.join(SUITES)}")
    return _CELLS[suite](scorer, L, settings, advance)


def assemble(cells: dict[tuple[str, int], dict], settings: Settings) -> dict:
    """{suite: result} of the (suite, L) cells given, lengths ascending:

    needle, passkey: {'lengths', 'depths', 'samples', 'accuracy' [L][depth], 'logprob' [L][depth]}, and
    for passkey 'accuracy_by_length' [L] (the mean over its depths: every depth has `samples` rows);
    'rows' {str(L): each row's answer} for the cells that kept them (files written before rows were kept have none);
    text: {'by_length': {str(L): cell}};
    loss-by-position and kv_recall: {'rows', 'by_length': {str(L): cell}}.
    """
    out: dict[str, Any] = {}
    for suite in SUITES:
        lengths = sorted(L for s, L in cells if s == suite)
        if not lengths:
            continue
        if suite in GRID_SUITES:
            out[suite] = {
                "lengths": lengths,
                "depths": list(settings.depths),
                "samples": settings.samples,
                "accuracy": [cells[suite, L]["accuracy"] for L in lengths],
                "logprob": [cells[suite, L]["logprob"] for L in lengths],
            }
            if suite == "passkey":
                out[suite]["accuracy_by_length"] = [float(np.mean(cells[suite, L]["accuracy"])) for L in lengths]
            rows = {str(L): cells[suite, L]["rows"] for L in lengths if "rows" in cells[suite, L]}
            if rows:
                out[suite]["rows"] = rows
        elif suite == "text":
            out[suite] = {"by_length": {str(L): cells[suite, L] for L in lengths}}
        else:
            out[suite] = {"rows": settings.rows, "by_length": {str(L): cells[suite, L] for L in lengths}}
    return out


def run_suites(
    scorer,
    cfg: Config,
    suites: Sequence[str],
    lengths: Sequence[int],
    *,
    text: Rows,
    depths: Sequence[float] = DEFAULT_DEPTHS,
    samples: int = 2,
    rows: int = 4,
    seed: int = 0,
    advance: Advance = _noop,
) -> dict:
    """{suite: result} (`assemble`) for the suites named; every L is prepared (and may be refused) before any runs."""
    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        raise ValueError(f"unknown suite {unknown[0]!r}; choose from {', '.join(SUITES)}")
    for L in lengths:
        scorer.prepare(L)
    settings = Settings(cfg, text, tuple(depths), samples, rows, seed)
    cells = {(s, L): cell(scorer, s, L, settings, advance) for s in suites for L in lengths}
    return assemble(cells, settings)


def scalars(results: dict) -> dict[str, float]:
    """The figures of `run_suites`' results that a run logs (rundir/files.py LONG_EVAL_METRICS), by column name."""
    out: dict[str, float] = {}
    if "needle" in results:
        r = results["needle"]
        for L, acc, lp in zip(r["lengths"], r["accuracy"], r["logprob"]):
            out[long_eval_column("needle_acc", L)] = float(np.mean(acc))
            out[long_eval_column("needle_logp", L)] = float(np.mean(lp))
    for L, r in results.get("loss-by-position", {}).get("by_length", {}).items():
        out[long_eval_column("loss", L)] = r["mean"]
        out[long_eval_column("loss_far", L)] = next(v for v in reversed(r["loss"]) if v is not None)
    for L, r in results.get("kv_recall", {}).get("by_length", {}).items():
        out[long_eval_column("kv_acc", L)] = r["mean"]
    return out
