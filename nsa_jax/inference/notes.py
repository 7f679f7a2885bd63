"""One-line remarks on what a checkpoint can be expected to do, from the config it was trained with.

`launch.generate` and `launch.evaluate` print them on stderr (as `note: ...`) before
they work, so a reader of noise or of a low score knows why:

  - `synthetic_note`: the run trained on generated token rows (`data.dataset`
    synthetic or kv_recall), not on text: its samples are noise and text suites
    are new to it;
  - `times` / `trained_positions`: a length beyond the training length
    (`train.seq_len`) reaches positions that were never trained (docs/LONG_CONTEXT.md
    has what happens there); each command words its own line with them.
"""

from __future__ import annotations

from nsa_jax.config import Config

# Datasets whose rows are generated tokens, not text: what each is.
SYNTHETIC_DATASETS = {
    "synthetic": "Markov-chain token rows",
    "kv_recall": "random key/value token rows",
}
TEXT_DATASETS = "data.dataset=text, jsonl, fineweb_edu or tokenized"


def synthetic_note(cfg: Config, consequence: str) -> str | None:
    """'note: this checkpoint was trained on synthetic data (...): <consequence>', or None for text."""
    what = SYNTHETIC_DATASETS.get(cfg.data.dataset)
    if what is None:
        return None
    return (
        f"note: this checkpoint was trained on synthetic data (data.dataset={cfg.data.dataset}: {what}, not text): "
        f"{consequence}"
    )


def training_length(cfg: Config) -> int:
    """Tokens per training row: the positions the model was trained on are 0 .. this - 1."""
    return cfg.train.seq_len


def times(n: int, cfg: Config) -> str:
    """n as a multiple of the training length: '4.7x', '16x'."""
    r = n / training_length(cfg)
    return f"{r:.0f}x" if r >= 10 else f"{r:.1f}x"


def trained_positions(cfg: Config) -> str:
    """'the training length (train.seq_len=256): positions from 256 on were never trained'."""
    T, N = training_length(cfg), cfg.train.rope_positions
    if N > T:  # randomized RoPE positions: the rotary distances of rows of N were trained, the row length not
        return (
            f"the training length (train.seq_len={T:,}; RoPE positions up to {N - 1:,}, train.rope_positions): "
            f"rows longer than {T:,} tokens were never trained"
        )
    return f"the training length (train.seq_len={T:,}): positions from {T:,} on were never trained"
