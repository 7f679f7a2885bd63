"""How much of the full attention the selected blocks catch: where a model's block scorer loses.

The selection branch attends to n blocks of lp keys, chosen by the compressed block
scores. For a checkpoint or model folder, on rows of length L of a text, per layer and
per bucket of query positions (from n*lp on, where the choice is real):

  recall   the share of the selection branch's full attention (its queries against every
           earlier selection key, softmax per head, mean over the KV group's heads) that
           falls on the blocks the layer selected
  best     the same for the best n blocks: the three forced ones and the n - 3 free blocks
           of most mass, the ceiling of any scorer at this n

A layer whose recall lies well under its best loses attention to its scorer; one whose
best is low spreads its attention wider than n blocks, which no scorer can mend.

    python -m experiments.selection_recall --ckpt MODEL_FOLDER|RUN[/checkpoints/STEP] \\
        --length 8192 [--rows 1] [--text FILE ...] [--json OUT]
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from nsa_jax.evaluation.suites import TextRows
from nsa_jax.inference.decode import inference_config
from nsa_jax.model import NSALM, per_layer
from nsa_jax.nsa.distill import free_blocks, full_block_mass
from nsa_jax.rundir.model_dir import load_model
from nsa_jax.rundir.resume import CheckpointError

FORCED = 3  # block 0, the previous and the current block (t >= 2 lp)


def recall_and_best(q_BxTxHxD, k_BxTxKxD, idx_BxTxKxN, *, lp: int, chunk: int = 512) -> np.ndarray:
    """[B, T, K, 2] float32: (recall, best) of every query (the module docstring). Queries before
    n*lp, where every block is selected, get (1, 1)."""
    return np.asarray(_recall_and_best(q_BxTxHxD, k_BxTxKxD, idx_BxTxKxN, lp=lp, chunk=chunk))


@functools.partial(jax.jit, static_argnames=("lp", "chunk"))
def _recall_and_best(q_BxTxHxD, k_BxTxKxD, idx_BxTxKxN, *, lp: int, chunk: int) -> jax.Array:
    B, T, H, D = q_BxTxHxD.shape
    N = idx_BxTxKxN.shape[-1]
    n_blocks = -(-T // lp)
    chunk = min(chunk, T)
    pad = -T % chunk
    q = jnp.pad(jnp.asarray(q_BxTxHxD), [(0, 0), (0, pad), (0, 0), (0, 0)])
    idx = jnp.pad(jnp.asarray(idx_BxTxKxN), [(0, 0), (0, pad), (0, 0), (0, 0)], constant_values=-1)
    k = jnp.asarray(k_BxTxKxD)
    j_Nb = jnp.arange(n_blocks, dtype=jnp.int32)

    def body(c):
        t_C = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
        q_c = jax.lax.dynamic_slice_in_dim(q, c * chunk, chunk, 1)
        idx_c = jax.lax.dynamic_slice_in_dim(idx, c * chunk, chunk, 1)
        mass = full_block_mass(q_c, k, t_C, lp=lp, scale=D**-0.5)  # [B, C, K, Nb]
        selected = jnp.any(idx_c[..., None] == j_Nb, axis=-2)
        recall = jnp.sum(jnp.where(selected, mass, 0.0), -1)
        free = free_blocks(t_C, n_blocks, lp)[None, :, None, :]
        best_free = jax.lax.top_k(jnp.where(free, mass, 0.0), max(N - FORCED, 1))[0].sum(-1)
        best = jnp.sum(jnp.where(free, 0.0, mass), -1) + best_free
        real = (t_C >= N * lp)[None, :, None]
        return jnp.stack([jnp.where(real, recall, 1.0), jnp.where(real, best, 1.0)], -1)

    out = jax.lax.map(body, jnp.arange((T + pad) // chunk))  # [chunks, B, C, K, 2]
    return jnp.moveaxis(out, 0, 1).reshape(B, T + pad, -1, 2)[:, :T]


def buckets(start: int, length: int) -> list[tuple[int, int]]:
    """Query positions [start, 2 start), [2 start, 4 start), ... up to length."""
    out, lo = [], start
    while lo < length:
        out.append((lo, min(2 * lo, length)))
        lo *= 2
    return out


def measure(path: str, length: int | None, rows: int, text: list[str]) -> dict:
    cfg, params = load_model(path)
    a = cfg.model.nsa
    if "slc" not in a.branches or cfg.model.attention != "nsa":
        raise SystemExit(f"error: {path}: the model has no selection branch")
    L = length or cfg.train.seq_len
    if L <= a.n * a.lp:
        raise SystemExit(f"error: --length {L}: every block is selected up to n*lp = {a.n * a.lp}; ask for more")
    tokens_BxT1 = TextRows(cfg, text)(L, rows)
    model = NSALM(inference_config(cfg.model))
    _, state = jax.jit(lambda p, t: model.apply({"params": p}, t, mutable=["intermediates", "scorer_inputs"]))(
        params, tokens_BxT1[:, :-1]
    )
    idx = per_layer(state, "intermediates", "block_idx", cfg.model)
    q, k = (per_layer(state, "scorer_inputs", n, cfg.model) for n in ("queries", "selection_keys"))
    spans = buckets(a.n * a.lp, L)
    layers = []
    for i in range(cfg.model.n_layers):
        rb = recall_and_best(q[i], k[i], idx[i], lp=a.lp)
        layers.append(
            {f"{lo}-{hi}": [float(rb[:, lo:hi, :, 0].mean()), float(rb[:, lo:hi, :, 1].mean())] for lo, hi in spans}
        )
    mean = {key: np.mean([r[key] for r in layers], axis=0).tolist() for key in layers[0]}
    return dict(checkpoint=path, length=L, rows=rows, lp=a.lp, n=a.n, layers=layers, mean=mean)


def print_report(res: dict) -> None:
    keys = list(res["mean"])
    print(
        f"{res['checkpoint']}: L={res['length']}, lp={res['lp']}, n={res['n']}, {res['rows']} rows. Share of the "
        "full attention on the selected blocks / on the best n blocks, by query position"
    )
    print("  " + f"{'layer':>6}" + "".join(f"{k:>16}" for k in keys))
    named = [(str(i), r) for i, r in enumerate(res["layers"])] + [("mean", res["mean"])]
    for name, r in named:
        print("  " + f"{name:>6}" + "".join(f"{f'{r[k][0]:.3f} / {r[k][1]:.3f}':>16}" for k in keys))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", action="append", required=True, help="a model folder, run or checkpoint; repeatable")
    p.add_argument("--length", type=int, default=None, help="row length (default: the run's train.seq_len)")
    p.add_argument("--rows", type=int, default=1, help="rows of the text (default 1)")
    p.add_argument("--text", nargs="*", default=[], help="text files (default: the run's val split)")
    p.add_argument("--json", default=None, help="write the figures of every checkpoint to this JSON file")
    args = p.parse_args(argv)
    if args.rows < 1:
        raise SystemExit("error: --rows must be >= 1")
    results = []
    for path in args.ckpt:
        try:
            res = measure(path, args.length, args.rows, args.text)
        except (CheckpointError, ValueError, OSError) as e:
            raise SystemExit(f"error: {path}: {e}") from None
        results.append(res)
        print_report(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
