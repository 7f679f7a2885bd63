"""Data entry points: `make_dataset`, `make_tokenizer`, `first_batch_with_timeout`.

Owns the choice of dataset from `cfg.data.dataset`, the per-process batch size, and the note
naming data settings a generated dataset ignores (`unused_data_settings`).
Every dataset yields int32 arrays tokens_BxT1 of shape
[cfg.train.global_batch // process_count, cfg.train.seq_len + 1], or, when it makes its
rows' loss weights and answers with them, data/targets.LabeledRows (those tokens with
weights and answers [B, T]); the trainer takes inputs = tokens_BxT1[:, :-1] and targets =
tokens_BxT1[:, 1:]. Streams have an exact, JSON-serialisable `get_state()` / `set_state()`.

Modules: synthetic (Markov + copy stream), kv_recall (long-range recall task), needle
(pass-key retrieval in text), reviews (a rating fine-tune, prompt -> answer), targets
(which targets count: LabeledRows),
tokenizers (byte / tokenizers JSON / tiktoken), sources (parquet, jsonl, txt readers),
pipeline (grain: sharding, shuffling, tokenising, packing, prefetch), shards (the
pre-tokenized format `python -m launch.prepare_data` writes) and tokenized (batches
from those shards, numbered over the whole run like synthetic and kv_recall).
grain (which imports jax) is imported only when a file dataset or prepared shards are
requested, so `import nsa_jax.data` stays free of jax for launch.train's config checks
(before XLA_FLAGS is set) and launch.prepare_data.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

from nsa_jax.data.kv_recall import KVRecallDataset
from nsa_jax.data.needle import NeedleDataset
from nsa_jax.data.reviews import ReviewsDataset
from nsa_jax.data.sources import FILE_DATASETS
from nsa_jax.data.stream import BatchStream, split_id
from nsa_jax.data.synthetic import SyntheticDataset
from nsa_jax.data.tokenizers import make_tokenizer, padded_vocab_size

__all__ = [
    "BatchStream",
    "make_dataset",
    "make_tokenizer",
    "padded_vocab_size",
    "first_batch_with_timeout",
    "per_process_batch",
    "unused_data_settings",
]


# Datasets that make their own token ids: a tokenizer or a data path means nothing to them.
GENERATED_DATASETS = ("synthetic", "kv_recall")


def unused_data_settings(data) -> str | None:
    """A note naming data settings the chosen dataset ignores (e.g. --tokenizer with synthetic data), or None."""
    if data.dataset not in GENERATED_DATASETS:
        return None
    ignored = []
    if data.tokenizer != "byte":
        ignored.append(f"data.tokenizer ({data.tokenizer})")
    if data.path:
        ignored.append(f"data.path ({data.path})")
    if not ignored:
        return None
    return (
        f"{' and '.join(ignored)} {'are' if len(ignored) > 1 else 'is'} not used by data.dataset={data.dataset}, "
        "which makes its own token ids; for real text use --dataset fineweb_edu, jsonl, text or tokenized"
    )


def per_process_batch(global_batch: int, process_count: int) -> int:
    """Rows each process produces; raises ValueError when the split is uneven."""
    if process_count < 1:
        raise ValueError(f"process_count must be >= 1, got {process_count}")
    if global_batch % process_count:
        raise ValueError(
            f"train.global_batch ({global_batch}) is not divisible by the process count ({process_count}); "
            f"set train.global_batch to a multiple of {process_count}"
        )
    return global_batch // process_count


def make_dataset(cfg: Any, split: str = "train", process_index: int = 0, process_count: int = 1) -> BatchStream:
    """The batch stream of this process for `cfg.data.dataset`; see the module docstring."""
    split_id(split)  # validates the split name
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index ({process_index}) must lie in [0, process_count={process_count})")
    batch = per_process_batch(cfg.train.global_batch, process_count)
    kind = cfg.data.dataset
    if kind == "synthetic":
        return SyntheticDataset(
            vocab_size=cfg.model.vocab_size,
            seed=cfg.train.seed,
            batch=cfg.train.global_batch,
            seq_len=cfg.train.seq_len,
            split=split,
            process_index=process_index,
            process_count=process_count,
            block_rows=cfg.train.global_batch * cfg.train.accumulate,
        )
    if kind == "kv_recall":
        return KVRecallDataset.from_config(
            cfg, batch=cfg.train.global_batch, split=split, process_index=process_index, process_count=process_count
        )
    if kind == "needle":
        return NeedleDataset(cfg, split=split, process_index=process_index, process_count=process_count)
    if kind == "reviews":
        return ReviewsDataset(cfg, split=split, process_index=process_index, process_count=process_count)
    if kind in FILE_DATASETS:
        from nsa_jax.data.pipeline import FileDataset  # noqa: PLC0415 - grain imports jax: after XLA_FLAGS

        return FileDataset.from_config(
            cfg, batch=batch, split=split, process_index=process_index, process_count=process_count
        )
    if kind == "tokenized":
        from nsa_jax.data.tokenized import TokenizedDataset  # noqa: PLC0415 - grain imports jax: after XLA_FLAGS

        return TokenizedDataset.from_config(
            cfg, batch=cfg.train.global_batch, split=split, process_index=process_index, process_count=process_count
        )
    raise ValueError(
        f"data.dataset is {kind!r}; use one of synthetic, kv_recall, needle, reviews, {', '.join(FILE_DATASETS)}, "
        "tokenized"
    )


def first_batch_with_timeout(ds: BatchStream, seconds: float) -> Any:
    """`next(ds)`, but raises TimeoutError when it takes longer than `seconds` (<= 0: wait forever).

    The read runs in a daemon thread, so a loader stuck on I/O cannot hang the caller;
    on timeout the stream should be discarded (the stuck read may still finish later).
    Exceptions raised by the loader are re-raised here unchanged.
    """
    if seconds is None or seconds <= 0:
        return next(ds)
    box: queue.Queue = queue.Queue(maxsize=1)

    def _read() -> None:
        try:
            box.put((True, next(ds)))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box.put((False, e))

    threading.Thread(target=_read, name="nsa-data-first-batch", daemon=True).start()
    try:
        ok, value = box.get(timeout=seconds)
    except queue.Empty:
        raise TimeoutError(
            f"data loader produced no batch within {seconds:g} s (data.loader_timeout / --loader-timeout); "
            "check data.path and the storage, raise the timeout, or pass --synthetic-on-fail"
        ) from None
    if not ok:
        raise value
    return value
