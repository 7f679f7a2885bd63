"""The needle-in-a-haystack format: one pass-key sentence hidden at a depth of real text.

Owns the row layout and the answer span, for evaluation (nsa_jax/evaluation) and any training source of
a needle-style task. One row of T1 = L + 1 tokens (the model reads the first L, scores the last L):

    [haystack ...] [needle] [haystack ...] [question] [answer]
                   ^ at depth * (haystack tokens): 0.0 = the very start, 1.0 = just before the question

needle   = "The pass key is {value}. Remember it. {value} is the pass key. "
question = " What is the pass key? The pass key is "
answer   = "{value}" (PASSKEY_DIGITS decimal digits)

Every piece is encoded on its own with the run's tokenizer, so the answer span is exactly the row's last
`len(answer)` tokens. A model retrieves the needle when its greedy predictions at the answer targets are
the answer (exact match), and its log-probability of the answer says how sure it is. `dataset: needle`
(NeedleDataset) trains on such rows: the haystack is the text of `data.path` (text files, a folder of .txt
files or a glob) from a random offset, the depth uniform in [0, 1], a new pass key per row; the loss counts
every target, the answer's (`answer_len`, the last targets of every row) weighted by
data.needle_answer_weight: the dataset yields its rows as data/targets.LabeledRows, the weights and
the answer made here with the rows.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from nsa_jax.data.sources import list_files
from nsa_jax.data.stream import GlobalRowStream, split_id
from nsa_jax.data.targets import LabeledRows, labeled
from nsa_jax.data.tokenizers import make_tokenizer

PASSKEY_DIGITS = 5
NEEDLE = "The pass key is {value}. Remember it. {value} is the pass key. "
QUESTION = " What is the pass key? The pass key is "


class NeedleRow(NamedTuple):
    tokens_T1: np.ndarray  # int32 [L + 1]
    answer_start: int  # index into tokens_T1 of the first answer token
    answer_len: int
    needle_pos: int  # index into tokens_T1 of the first needle token
    value: str  # the pass key


def passkey(rng: np.random.Generator) -> str:
    """A random pass key of PASSKEY_DIGITS digits (no leading zero, so every tokenizer keeps its length)."""
    lo = 10 ** (PASSKEY_DIGITS - 1)
    return str(int(rng.integers(lo, 10 * lo)))


def needle_pieces(tokenizer: Any, value: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(needle, question, answer) token ids of one pass key."""

    def enc(s: str) -> np.ndarray:
        return np.asarray(tokenizer.encode(s), np.int32)

    return enc(NEEDLE.format(value=value)), enc(QUESTION), enc(value)


def min_row_len(tokenizer: Any) -> int:
    """Fewest tokens L + 1 a row needs: needle, question and answer with no haystack."""
    needle, question, answer = needle_pieces(tokenizer, "9" * PASSKEY_DIGITS)
    return len(needle) + len(question) + len(answer)


def make_needle_row(haystack: np.ndarray, L: int, depth: float, value: str, tokenizer: Any) -> NeedleRow:
    """The row of L + 1 tokens with the pass key `value` at `depth` in [0, 1] of `haystack`.

    `haystack` holds at least L + 1 tokens of text; its first tokens fill the row.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"needle depth must lie in [0, 1], got {depth}")
    needle, question, answer = needle_pieces(tokenizer, value)
    n_hay = L + 1 - len(needle) - len(question) - len(answer)
    if n_hay < 0:
        raise ValueError(f"a needle row needs L >= {min_row_len(tokenizer) - 1} tokens, got L={L}")
    if len(haystack) < n_hay:
        raise ValueError(f"the haystack holds {len(haystack)} tokens; a row of L={L} needs {n_hay}")
    hay = np.asarray(haystack[:n_hay], np.int32)
    at = int(round(depth * n_hay))
    tokens = np.concatenate([hay[:at], needle, hay[at:], question, answer]).astype(np.int32)
    return NeedleRow(tokens, L + 1 - len(answer), len(answer), at, value)


def answer_mask(row: NeedleRow) -> np.ndarray:
    """bool [L]: the targets (tokens_T1[1:]) that are answer tokens."""
    mask = np.zeros(len(row.tokens_T1) - 1, bool)
    mask[row.answer_start - 1 : row.answer_start - 1 + row.answer_len] = True
    return mask


def answer_len(tokenizer: Any) -> int:
    """Tokens of a pass key: the answer targets at the end of every row."""
    return len(needle_pieces(tokenizer, "9" * PASSKEY_DIGITS)[2])


class NeedleDataset(GlobalRowStream):
    """`dataset: needle`: rows of make_needle_row over a text haystack, numbered over the whole run."""

    kind = "needle"

    def __init__(self, cfg: Any, split: str, process_index: int = 0, process_count: int = 1):
        self.tok = make_tokenizer(cfg.data)
        self.answer_weight = float(cfg.data.needle_answer_weight)
        files = list_files(cfg.data.path, "text")
        text = "\n\n".join(open(f, encoding="utf-8").read() for f in files)
        self.hay = np.asarray(self.tok.encode(text), np.int32)
        self.seq_len, self.seed, self.split = int(cfg.train.seq_len), int(cfg.train.seed), split
        if len(self.hay) < 2:
            raise ValueError(f"data.path {cfg.data.path} holds no text for the needle haystack")
        if self.hay.max() >= cfg.model.vocab_size:
            raise ValueError(f"the haystack has token id {int(self.hay.max())}, outside model.vocab_size")
        if self.seq_len + 1 < min_row_len(self.tok):
            raise ValueError(f"train.seq_len must be >= {min_row_len(self.tok) - 1} for data.dataset=needle")
        reps = -(-2 * (self.seq_len + 1) // len(self.hay))
        self.hay = np.tile(self.hay, max(reps, 1) + 1)
        t = cfg.train
        self._init_rows(t.global_batch, process_index, process_count, t.global_batch * t.accumulate)

    def _make_block(self, k: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed % 2**32, split_id(self.split), int(k), 0x4E44])
        L, rows = self.seq_len, []
        span = len(self.hay) - (L + 1)
        for _ in range(self.block_rows):
            at = int(rng.integers(0, span))
            rows.append(make_needle_row(self.hay[at : at + L + 1], L, float(rng.random()), passkey(rng), self.tok))
        tokens = np.stack([r.tokens_T1 for r in rows])
        answers = np.stack([answer_mask(r) for r in rows])
        return labeled(tokens, np.where(answers, self.answer_weight, 1.0), answers)

    def __next__(self) -> LabeledRows:
        return self._next_local()
