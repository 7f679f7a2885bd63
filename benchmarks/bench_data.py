"""Cost of the `tokenized` dataset's global row stream per optimizer step.

Writes a prepared folder of random token ids (ShardWriter, documents of random length,
uint16 ids as for a GPT-2-sized vocabulary) unless --path names one, then reads the
rows of `--steps` optimizer steps at a config's shape (R = train.global_batch x
train.accumulate rows of train.seq_len + 1 tokens per step) as each of P processes would
(its share of every micro-batch), and prints per process: the time to open the stream
(shard index, chunk list), the first step (first epoch layout and chunk reads from a
cold start), and the mean and worst time per step after it. For comparison it times
the per-process grain stream that checkpoints from before global positions resume
(tokenized.PerProcessTokenized, data.prefetch=0, so its packing runs on the caller).

Usage:
  python -m benchmarks.bench_data [--config a100_pcie] [--tokens 20000000] [--steps 500]
      [--processes 1,2] [--path PREPARED_DIR]
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile
import time

import numpy as np

from nsa_jax.config import load_config
from nsa_jax.data import shards as fmt
from nsa_jax.data import tokenized


def write_folder(root: pathlib.Path, n_tokens: int, vocab: int, seed: int = 0) -> dict:
    """A prepared folder's train shards of `n_tokens` random ids in documents of 50-4000 tokens; its manifest."""
    rng = np.random.default_rng(seed)
    w = fmt.ShardWriter(root, "train", np.uint16, 1 << 24)
    done = 0
    while done < n_tokens:
        lengths = rng.integers(50, 4000, size=1000)
        tokens = rng.integers(0, vocab, size=int(lengths.sum()), dtype=np.uint16)
        w.add(tokens, lengths)
        done += tokens.size
    return {"dtype": "uint16", "shards": w.finish()}


def time_steps(ds, steps: int, accumulate: int) -> tuple[float, list[float]]:
    """(seconds of the first optimizer step, seconds of each following one)."""
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        for _ in range(accumulate):
            next(ds)
        times.append(time.perf_counter() - t0)
    return times[0], times[1:]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="a100_pcie")
    p.add_argument("--tokens", type=int, default=20_000_000)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--processes", default="1,2")
    p.add_argument("--path", default=None, help="a prepared folder to read instead of a random one")
    a = p.parse_args(argv)
    cfg = load_config(a.config, [])
    t = cfg.train
    G, A, L = t.global_batch, t.accumulate, t.seq_len + 1
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(a.path or tmp)
        manifest = fmt.read_manifest(root) if a.path else write_folder(root, a.tokens, 50257)
        n = sum(s["tokens"] for s in manifest["shards"] if s["split"] == "train")
        print(f"{a.config}: {G} rows x accumulate {A} of {L} tokens per step; {n:,} train tokens in {root}")
        for P in map(int, a.processes.split(",")):
            if G % P:
                print(f"  {P} processes: train.global_batch {G} does not divide; skipped")
                continue
            for q in range(P):
                t0 = time.perf_counter()
                ds = tokenized.TokenizedDataset(
                    str(root), t.seed, G, t.seq_len, "train", q, P, prefetch=0, manifest=manifest, block_rows=G * A
                )
                open_s = time.perf_counter() - t0
                first, rest = time_steps(ds, a.steps, A)
                old = tokenized.PerProcessTokenized(ds)
                _, old_rest = time_steps(old, a.steps, A)
                old.close()
                print(
                    f"  {P} process(es), process {q}: open {open_s * 1e3:.1f} ms, first step {first * 1e3:.2f} ms, "
                    f"then {np.mean(rest) * 1e6:.0f} us/step mean, {np.max(rest) * 1e3:.2f} ms worst "
                    f"({G // P * A * L / np.mean(rest) / 1e6:.0f} M tokens/s); per-process grain stream: "
                    f"{np.mean(old_rest) * 1e6:.0f} us/step mean"
                )


if __name__ == "__main__":
    main()
