"""The needle-in-a-haystack format: one pass-key sentence hidden at a depth of real text.

Owns the row layout and the answer span, for evaluation (nsa_jax/evaluation) and for
any training source of a needle-style task, so both read and write the same thing.
One row of T1 = L + 1 tokens (the model reads the first L, scores the last L):

    [haystack ...] [needle] [haystack ...] [question] [answer]
                   ^ at depth * (haystack tokens): 0.0 = the very start, 1.0 = just before the question

needle   = "The pass key is {value}. Remember it. {value} is the pass key. "
question = " What is the pass key? The pass key is "
answer   = "{value}" (PASSKEY_DIGITS decimal digits)

Every piece is encoded on its own with the run's tokenizer (byte, gpt2, a tokenizer
JSON), so the answer span is known exactly: the last `len(answer)` tokens of the
row. Digits and ASCII text are in every tokenizer's alphabet. A model retrieves the
needle when its greedy predictions at the answer targets are the answer (exact
match; with teacher forcing this is what greedy decoding after the question emits)
and its log-probability of the answer measures how sure it is.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

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
