"""Long-range key-value recall (`dataset: kv_recall`): the row layout, the batch stream, `retrieval_accuracy`.

Pure numpy. One row of T1 = seq_len + 1 tokens:

    [filler] [k_1 v_1 k_2 v_2 ... k_P v_P] [filler ...] [Q k_a v_a  Q k_b v_b ...]
              pairs at offset o .. o+2P-1     noise      Q queries at the very end

Keys are distinct within a row; a query repeats one of them after the QUERY marker, and its scored target
is the value that followed that key. Every queried pair lies more than model.nsa.w tokens before its query
key, out of the sliding window's reach. `data.kv_placement`: `random` draws o per row from every position
that keeps the pairs out of the window, `start` puts them at o = 0 (block 0, which NSA always selects);
with Q <= P the queried keys are distinct. `data.kv_format`: `split` writes a pair as two tokens `k v`,
`fused` as one token for (k, v), the query staying `Q k v` (why: docs/DESIGN_NOTES.md).
Vocabulary (V = model.vocab_size): keys [0, n), values [n, 2n), the QUERY marker V - 1, and
  split: filler [2n, V - 1), n = (V - 1) // 4;
  fused: pair tokens [2n, 2n + n*n) (id 2n + k*n + (v - n)), filler up to V - 1, n the largest with
         at least MIN_FILLER filler ids.
The marker occurs nowhere else, so the answer positions are recoverable from the tokens alone
(`kv_answer_mask`), and `next(ds)` can stay a plain int32 array.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from nsa_jax.data.stream import GlobalRowStream, split_id

MIN_VOCAB = 16


class KVBatch(NamedTuple):
    tokens_BxT1: np.ndarray  # int32 [B, T + 1]
    answer_mask_BxT: np.ndarray  # bool [B, T]: targets (= tokens[:, 1:]) that are scored
    pair_key_pos_BxQ: np.ndarray  # int [B, Q]: position of the queried key in the pairs
    query_key_pos_BxQ: np.ndarray  # int [B, Q]: position of the key after the QUERY marker


FORMATS = ("split", "fused")
MIN_FILLER = 8


def vocab_layout(vocab_size: int, fmt: str = "split") -> tuple[int, int, int]:
    """(n_keys, first filler id, QUERY id) for a vocabulary of `vocab_size`."""
    if fmt not in FORMATS:
        raise ValueError(f"data.kv_format is {fmt!r}; use one of {', '.join(FORMATS)}")
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"model.vocab_size must be >= {MIN_VOCAB} for kv_recall, got {vocab_size}")
    if fmt == "split":
        n = (vocab_size - 1) // 4
        return n, 2 * n, vocab_size - 1
    n = 1
    while (n + 1) ** 2 + 2 * (n + 1) + MIN_FILLER + 1 <= vocab_size:
        n += 1
    return n, n * n + 2 * n, vocab_size - 1


def pair_len(fmt: str) -> int:
    """Tokens one key/value pair takes in a row."""
    return 2 if fmt == "split" else 1


def min_seq_len(window: int, n_pairs: int, n_queries: int, fmt: str = "split") -> int:
    """Shortest train.seq_len for which every queried pair lies farther back than `window`."""
    # Query key j sits at T1 - 3Q + 3j + 1; the last pair ends at L*P - 1 (L tokens a
    # pair). Require (T1 - 3Q + 1) - (L*P - 1) > window, with T1 = seq_len + 1.
    return window + pair_len(fmt) * n_pairs + 3 * n_queries - 2


PLACEMENTS = ("random", "start")


def make_kv_batch(
    rng: np.random.Generator,
    batch: int,
    seq_len: int,
    vocab_size: int,
    window: int,
    n_pairs: int,
    n_queries: int,
    placement: str = "random",
    fmt: str = "split",
) -> KVBatch:
    """One KVBatch; see the module docstring for the layout."""
    if placement not in PLACEMENTS:
        raise ValueError(f"data.kv_placement is {placement!r}; use one of {', '.join(PLACEMENTS)}")
    n_keys, filler_lo, query_id = vocab_layout(vocab_size, fmt)
    if n_pairs < 1 or n_queries < 1:
        raise ValueError(f"data.kv_pairs and data.kv_queries must be >= 1, got {n_pairs}, {n_queries}")
    if n_pairs > n_keys:
        raise ValueError(
            f"data.kv_pairs ({n_pairs}) exceeds the {n_keys} distinct keys of vocab {vocab_size}; lower data.kv_pairs"
        )
    need = min_seq_len(window, n_pairs, n_queries, fmt)
    if seq_len < need:
        raise ValueError(
            f"train.seq_len ({seq_len}) is too short for kv_recall with model.nsa.w={window}, "
            f"data.kv_pairs={n_pairs}, data.kv_queries={n_queries}; set train.seq_len >= {need}"
        )
    P, Q, T1, L = n_pairs, n_queries, seq_len + 1, pair_len(fmt)
    tokens_BxT1 = rng.integers(filler_lo, query_id, size=(batch, T1), dtype=np.int32)

    # Distinct keys per row: the first P of a random permutation of the key range.
    keys_BxP = np.argsort(rng.random((batch, n_keys)), axis=1)[:, :P].astype(np.int32)
    values_BxP = rng.integers(n_keys, 2 * n_keys, size=(batch, P), dtype=np.int32)
    q0 = T1 - 3 * Q
    # Largest offset that keeps the end of the pairs more than `window` before the
    # first query key: (q0 + 1) - (o + L*P - 1) > window.
    max_offset = q0 + 1 - L * P - window
    offset_B = rng.integers(0, max_offset + 1, size=batch) if placement == "random" else np.zeros(batch, np.int64)
    rows_Bx1 = np.arange(batch)[:, None]
    key_pos_BxP = offset_B[:, None] + L * np.arange(P)[None, :]
    if fmt == "split":
        tokens_BxT1[rows_Bx1, key_pos_BxP] = keys_BxP
        tokens_BxT1[rows_Bx1, key_pos_BxP + 1] = values_BxP
    else:  # one token per pair: 2n + k*n + (v - n)
        tokens_BxT1[rows_Bx1, key_pos_BxP] = 2 * n_keys + keys_BxP * n_keys + (values_BxP - n_keys)

    if Q <= P:  # distinct pairs per row: no query repeats (and leaks) an earlier answer
        which_BxQ = np.argsort(rng.random((batch, P)), axis=1)[:, :Q]
    else:
        which_BxQ = rng.integers(0, P, size=(batch, Q))
    marker_pos_Q = q0 + 3 * np.arange(Q)
    tokens_BxT1[:, marker_pos_Q] = query_id
    tokens_BxT1[:, marker_pos_Q + 1] = keys_BxP[rows_Bx1, which_BxQ]
    tokens_BxT1[:, marker_pos_Q + 2] = values_BxP[rows_Bx1, which_BxQ]

    answer_mask_BxT = np.zeros((batch, T1 - 1), dtype=bool)
    # The value at position p + 2 is target index p + 1, predicted at the query key.
    answer_mask_BxT[:, marker_pos_Q + 1] = True
    query_key_pos_BxQ = np.broadcast_to(marker_pos_Q + 1, (batch, Q)).copy()
    return KVBatch(tokens_BxT1, answer_mask_BxT, key_pos_BxP[rows_Bx1, which_BxQ], query_key_pos_BxQ)


def kv_answer_mask(tokens_BxT1, vocab_size: int):
    """bool [B, T]: answer targets, those whose input t - 1 is the QUERY marker (vocab_size - 1).

    Written with indexing and comparisons only, so it takes a numpy array (numpy out)
    or a jax array, traced too (jax out): the train step's loss mask and the scoring
    here are this one function.
    """
    t_T = np.arange(tokens_BxT1.shape[1] - 1)
    prev_T = np.maximum(t_T - 1, 0)  # input t - 1 of target t; target 0 has none (masked below)
    return (tokens_BxT1[:, prev_T] == vocab_size - 1) & (t_T > 0)


def answer_mask_from_tokens(tokens_BxT1: np.ndarray, vocab_size: int) -> np.ndarray:
    """bool [B, T] numpy: target t is scored iff the token before input t is the QUERY marker."""
    vocab_layout(vocab_size)  # validates the vocabulary
    return kv_answer_mask(np.asarray(tokens_BxT1), vocab_size)


def retrieval_counts(
    logits_or_preds: np.ndarray, tokens_BxT1: np.ndarray, vocab_size: int, answer_mask_BxT: np.ndarray | None = None
) -> tuple[int, int]:
    """(correct, scored) over the answer positions; logits [B, T, V'] or predictions [B, T]."""
    x = np.asarray(logits_or_preds)
    preds_BxT = x.argmax(-1) if x.ndim == 3 else x
    targets_BxT = np.asarray(tokens_BxT1)[:, 1:]
    if preds_BxT.shape != targets_BxT.shape:
        raise ValueError(f"predictions have shape {preds_BxT.shape}, targets {targets_BxT.shape}")
    mask_BxT = answer_mask_from_tokens(tokens_BxT1, vocab_size) if answer_mask_BxT is None else answer_mask_BxT
    return int(((preds_BxT == targets_BxT) & mask_BxT).sum()), int(mask_BxT.sum())


def retrieval_accuracy(
    logits_or_preds: np.ndarray, tokens_BxT1: np.ndarray, vocab_size: int, answer_mask_BxT: np.ndarray | None = None
) -> float:
    """Fraction of answer positions predicted exactly (argmax over logits); NaN if none scored."""
    correct, scored = retrieval_counts(logits_or_preds, tokens_BxT1, vocab_size, answer_mask_BxT)
    return correct / scored if scored else float("nan")


class KVRecallDataset(GlobalRowStream):
    """`dataset: kv_recall`: random access by position, like the synthetic stream."""

    kind = "kv_recall"

    def __init__(
        self,
        vocab_size: int,
        window: int,
        n_pairs: int,
        n_queries: int,
        seed: int,
        batch: int,
        seq_len: int,
        split: str,
        process_index: int,
        placement: str = "random",
        fmt: str = "split",
        process_count: int = 1,
        block_rows: int | None = None,
    ):
        """`batch`: rows of one micro-batch over all processes (train.global_batch); `block_rows`:
        rows per optimizer step (train.global_batch x train.accumulate; default `batch`)."""
        self.placement, self.fmt = placement, fmt
        self.vocab_size, self.window = int(vocab_size), int(window)
        self.n_pairs, self.n_queries = int(n_pairs), int(n_queries)
        self.seed, self.seq_len = int(seed), int(seq_len)
        self.split = split
        self._init_rows(batch, process_index, process_count, block_rows or batch)
        self.kv_batch_at(0)  # validates the layout now rather than at the first step

    @classmethod
    def from_config(
        cls, cfg: Any, batch: int, split: str, process_index: int, process_count: int = 1
    ) -> KVRecallDataset:
        """`batch`: train.global_batch, the rows of one micro-batch over all processes."""
        return cls(
            cfg.model.vocab_size,
            cfg.model.nsa.w,
            cfg.data.kv_pairs,
            cfg.data.kv_queries,
            cfg.train.seed,
            batch,
            cfg.train.seq_len,
            split,
            process_index,
            cfg.data.kv_placement,
            cfg.data.kv_format,
            process_count=process_count,
            block_rows=cfg.train.global_batch * cfg.train.accumulate,
        )

    def _make_block(self, k: int) -> KVBatch:
        # The third seed word was the process index when every process drew its own rows.
        rng = np.random.default_rng([self.seed % 2**32, split_id(self.split), 0, int(k), 0x4B56])
        return make_kv_batch(
            rng,
            self.block_rows,
            self.seq_len,
            self.vocab_size,
            self.window,
            self.n_pairs,
            self.n_queries,
            self.placement,
            self.fmt,
        )

    def kv_batch_at(self, position: int) -> KVBatch:
        """This process's rows of micro-batch `position` with their answer mask (for evaluation)."""
        return self.local_rows_at(position)

    def next_kv_batch(self) -> KVBatch:
        return self._next_local()

    def __next__(self) -> np.ndarray:
        return self.next_kv_batch().tokens_BxT1
