"""The long-context suites: which rows are built, how they are batched through a scorer, what is reported.

A *scorer* is anything with `batch` (rows per call), `prepare(L)` (get ready for
rows of L + 1 tokens; may refuse) and `__call__(tokens_BxT1) -> (nll_BxT, hit_BxT)`:
the model (scorer.ModelScorer) or a stub whose answers are known (tests). Rows are
padded to whole batches with copies of the last row, whose scores are dropped.

Suites (SUITES), each returning a JSON-ready dict:
  - `loss-by-position`: `text(L, n)` rows of held-out text; scoring.loss_by_position per L;
  - `needle`: for every L x depth cell, `samples` rows built by data/needle.py, sample s
    using held-out row s as its haystack and its own pass key (the same at every depth,
    so depths compare like with like); accuracy = mean exact match, and mean answer
    log-probability;
  - `kv_recall`: rows of data/kv_recall.py at length L (the model's vocabulary, window
    and the config's kv_* settings), accuracy by query - pair distance.

A suite is scored one length at a time: `cell(scorer, suite, L, settings)` is the result
of one (suite, L) pair, the unit launch.evaluate keeps as soon as it is done;
`assemble` joins cells into the per-suite dicts above (the shape of evaluation.json);
`run_suites` does both for a list of suites and lengths (training's eval.suites).
`Settings` holds what a cell depends on besides the scorer and L.

`text(L, n)` is a `TextRows` (held-out rows from the run's validation split through
the data pipelines, or from text files) or any callable returning int32 [n, L + 1].
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
from nsa_jax.evaluation import scoring
from nsa_jax.rundir.files import long_eval_column

SUITES = EVAL_SUITES
DEFAULT_DEPTHS = tuple(i / 10 for i in range(11))

Rows = Callable[[int, int], np.ndarray]
Advance = Callable[[int], None]


def _noop(n: int) -> None:
    pass


class TextRows:
    """Held-out text rows [n, L + 1]: files given (read whole, joined, cut in order) or the run's `val` split."""

    def __init__(self, cfg: Config, files: Sequence[str] = ()):
        self.cfg = cfg
        self.tokens: np.ndarray | None = None
        if files:
            tok = make_tokenizer(cfg.data)
            parts = [np.asarray(tok.encode(pathlib.Path(f).read_text(encoding="utf-8")), np.int32) for f in files]
            sep = np.asarray(tok.encode("\n\n"), np.int32)
            self.tokens = np.concatenate([x for p in parts for x in (p, sep)])
            if len(self.tokens) < 2:
                raise ValueError(f"the text files {', '.join(files)} hold no text")
        self._cache: dict[tuple[int, int], np.ndarray] = {}

    def __call__(self, L: int, n: int) -> np.ndarray:
        if (L, n) not in self._cache:
            self._cache[(L, n)] = self._rows(L, n)
        return self._cache[(L, n)]

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
                rows = np.asarray(next(ds), np.int32)
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

    def rows_of(self, suite: str) -> int:
        """Rows one (suite, L) cell scores."""
        return len(self.depths) * self.samples if suite == "needle" else self.rows


def cell_batches(suite: str, settings: Settings, B: int) -> int:
    """Scorer calls of one (suite, L) cell with `B` rows a call."""
    return batches(settings.rows_of(suite), B)


def needle_rows(text: Rows, tokenizer: Any, L: int, depths: Sequence[float], samples: int, seed: int):
    """The rows of one length, depth-major: [(depth index, sample, NeedleRow)]."""
    hay = text(L, samples)
    keys = [passkey(np.random.default_rng([seed, L, s])) for s in range(samples)]
    return [
        (d, s, make_needle_row(hay[s], L, depth, keys[s], tokenizer))
        for d, depth in enumerate(depths)
        for s in range(samples)
    ]


def _needle_cell(scorer, L: int, st: Settings, advance: Advance) -> dict:
    """{'accuracy' [depth], 'logprob' [depth]}: mean exact match and answer log-probability per depth."""
    built = needle_rows(st.text, st.tokenizer, L, st.depths, st.samples, st.seed)
    tokens = np.stack([r.tokens_T1 for _, _, r in built])
    nll, hit = _run_rows(scorer, tokens, advance)
    lp_N, exact_N = scoring.answer_scores(nll, hit, np.stack([answer_mask(r) for _, _, r in built]))
    d_N = np.array([d for d, _, _ in built])
    acc = [float(exact_N[d_N == d].mean()) for d in range(len(st.depths))]
    logp = [float(lp_N[d_N == d].mean()) for d in range(len(st.depths))]
    return {"accuracy": acc, "logprob": logp}


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


_CELLS = {"needle": _needle_cell, "loss-by-position": _loss_cell, "kv_recall": _kv_cell}


def cell(scorer, suite: str, L: int, settings: Settings, advance: Advance = _noop) -> dict:
    """One suite at one length L, JSON-ready: the unit an evaluation keeps as soon as it is done.

    `advance(1)` after every scorer call (a progress bar).
    """
    if suite not in _CELLS:
        raise ValueError(f"unknown suite {suite!r}; choose from {', '.join(SUITES)}")
    return _CELLS[suite](scorer, L, settings, advance)


def assemble(cells: dict[tuple[str, int], dict], settings: Settings) -> dict:
    """{suite: result} of the (suite, L) cells given, lengths ascending:

    needle: {'lengths', 'depths', 'samples', 'accuracy' [L][depth], 'logprob' [L][depth]};
    loss-by-position and kv_recall: {'rows', 'by_length': {str(L): cell}}.
    """
    out: dict[str, Any] = {}
    for suite in SUITES:
        lengths = sorted(L for s, L in cells if s == suite)
        if not lengths:
            continue
        if suite == "needle":
            out[suite] = {
                "lengths": lengths,
                "depths": list(settings.depths),
                "samples": settings.samples,
                "accuracy": [cells[suite, L]["accuracy"] for L in lengths],
                "logprob": [cells[suite, L]["logprob"] for L in lengths],
            }
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
