"""Synthetic language-model data: a learnable, random-access token stream.

Owns `SyntheticDataset` (the `dataset: synthetic` batch stream) and the generator
behind it. Sequences come from a fixed sparse Markov chain over the vocabulary
(each token has a few likely successors), with a little observation noise and one
copied span per row. The chain gives a next-token entropy far below log(V), so a
short run shows the loss falling; the copied span rewards attention that looks back
(an induction-style pattern) rather than only at the previous token.

Rows are numbered over the whole run (`GlobalRowStream`): the rows of optimizer step s
are a pure function of (seed, split, s), whatever the number of processes and devices
that read them, so resuming needs no replay and works on another layout: the state is
the global row count.
"""

from __future__ import annotations

import numpy as np

from nsa_jax.data.stream import GlobalRowStream, split_id

# Successor probabilities of the Markov chain. Each token gets its own random set
# of successors, but the probabilities are shared so the per-step choice can be drawn
# for the whole batch up front (one gather per time step, nothing else in the loop).
SUCCESSOR_PROBS = np.array([0.55, 0.25, 0.12, 0.08])
NOISE_PROB = 0.03  # chance a token is replaced by a uniform one (keeps every id in play)
MIN_LEN_FOR_COPY = 16  # rows shorter than this get no copied span


class MarkovCopyGenerator:
    """Samples [B, T] token arrays from a fixed seeded sparse Markov chain + copy spans."""

    def __init__(self, vocab_size: int, seed: int):
        if vocab_size < 2:
            raise ValueError(f"model.vocab_size must be >= 2 for synthetic data, got {vocab_size}")
        self.vocab_size = int(vocab_size)
        n_succ = min(len(SUCCESSOR_PROBS), self.vocab_size)
        probs = SUCCESSOR_PROBS[:n_succ]
        self.probs = probs / probs.sum()
        # The "language" depends only on the seed: train, val and every process share it.
        lang_rng = np.random.default_rng([int(seed) % 2**32, 0x4C414E47])
        self.succ_VxK = np.stack(
            [lang_rng.choice(self.vocab_size, size=n_succ, replace=False) for _ in range(self.vocab_size)]
        ).astype(np.int32)

    def sample(self, rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
        V, K = self.vocab_size, self.succ_VxK.shape[1]
        choice_BxT = rng.choice(K, p=self.probs, size=(batch, length)).astype(np.int32)
        tokens_TxB = np.empty((length, batch), dtype=np.int32)
        cur_B = rng.integers(0, V, size=batch, dtype=np.int32)
        choice_TxB = np.ascontiguousarray(choice_BxT.T)
        succ = self.succ_VxK
        tokens_TxB[0] = cur_B
        for t in range(1, length):
            cur_B = succ[cur_B, choice_TxB[t]]
            tokens_TxB[t] = cur_B
        tokens_BxT = np.ascontiguousarray(tokens_TxB.T)

        # Observation noise: replaced tokens do not restart the chain, so the chain
        # stays predictable from the clean context while every id occurs.
        noise_BxT = rng.random((batch, length)) < NOISE_PROB
        tokens_BxT = np.where(noise_BxT, rng.integers(0, V, size=(batch, length), dtype=np.int32), tokens_BxT)

        if length >= MIN_LEN_FOR_COPY:
            # One span per row copied from earlier in the same row (source and
            # destination do not overlap), placed at random.
            span = max(4, length // 8)
            src_B = rng.integers(0, length - 2 * span + 1, size=batch)
            dst_B = src_B + span + rng.integers(0, length - 2 * span - src_B + 1)
            offs = np.arange(span)
            rows = np.arange(batch)[:, None]
            tokens_BxT[rows, dst_B[:, None] + offs] = tokens_BxT[rows, src_B[:, None] + offs]
        return tokens_BxT


class SyntheticDataset(GlobalRowStream):
    """`dataset: synthetic`: [batch, seq_len + 1] int32 batches, random access by global row."""

    kind = "synthetic"

    def __init__(
        self,
        vocab_size: int,
        seed: int,
        batch: int,
        seq_len: int,
        split: str,
        process_index: int,
        process_count: int = 1,
        block_rows: int | None = None,
    ):
        """`batch`: rows of one micro-batch over all processes (train.global_batch); `block_rows`:
        rows per optimizer step (train.global_batch x train.accumulate; default `batch`)."""
        self.gen = MarkovCopyGenerator(vocab_size, seed)
        self.seed = int(seed)
        self.seq_len = int(seq_len)
        self.split = split
        self._init_rows(batch, process_index, process_count, block_rows or batch)

    def _make_block(self, k: int) -> np.ndarray:
        # The third seed word was the process index when every process drew its own rows;
        # 0 keeps a one-process run's rows what they were then (for accumulate 1).
        rng = np.random.default_rng([self.seed % 2**32, split_id(self.split), 0, int(k)])
        return self.gen.sample(rng, self.block_rows, self.seq_len + 1)

    def batch_at(self, position: int) -> np.ndarray:
        """This process's rows of micro-batch `position`; a pure function of (seed, split, layout, position)."""
        return self.local_rows_at(position)

    def __next__(self) -> np.ndarray:
        return self._next_local()
