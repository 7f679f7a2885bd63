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

`--scorers` adds the recall of other block scorers (kernels/scorers.py), each choosing from
the same layer's queries and keys the forward made: `cmp`, `cmp_max`, `minmax` (the bound per
block), `minmax:S` (per sub-block of S keys; `minmax:1` is each block's exact max logit),
`minmax-hmax:S` (the group's heads combined by the largest logit instead of summed softmaxes) and
`rescore:M` (cmp's best M blocks re-ranked by their exact mass; M defaults to 4 n).
The layers below keep the model's own selections, so this screens scorers from one forward;
a model run with the scorer (`--set model.nsa.scorer=...`) measures it with its own inputs.

    python -m experiments.selection_recall --ckpt MODEL_FOLDER|RUN[/checkpoints/STEP] \\
        --length 8192 [--rows 1] [--text FILE ...] [--scorers cmp,minmax,...] [--set KEY=VALUE ...] [--json OUT]
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from nsa_jax.config import replace
from nsa_jax.evaluation.suites import TextRows
from nsa_jax.inference.decode import inference_config
from nsa_jax.kernels.scorers import (
    bound_block_logits,
    default_candidates,
    key_bounds,
    minmax_block_scores,
    select_minmax_xla,
    select_rescore_xla,
)
from nsa_jax.kernels.xla import compressed_attention_xla, map_query_chunks, select_blocks
from nsa_jax.model import NSALM, per_layer
from nsa_jax.nsa.distill import free_blocks, full_block_mass
from nsa_jax.rundir.model_dir import load_model
from nsa_jax.rundir.resume import CheckpointError

FORCED = 3  # block 0, the previous and the current block (t >= 2 lp)


def recall_and_best(q_BxTxHxD, k_BxTxKxD, idx_BxTxKxN, *, lp: int, chunk: int = 512) -> np.ndarray:
    """[B, T, K, 2] float32: (recall, best) of every query (the module docstring). Queries before
    n*lp, where every block is selected, get (1, 1)."""
    return recalls(q_BxTxHxD, k_BxTxKxD, [idx_BxTxKxN], lp=lp, chunk=chunk)


def recalls(q_BxTxHxD, k_BxTxKxD, idx_list, *, lp: int, chunk: int = 512) -> np.ndarray:
    """[B, T, K, S + 1] float32: the recall of each of S selections [B, T, K, N] (one N for all),
    then the best-n ceiling; the full attention's block mass made once for all of them."""
    idx = jnp.stack([jnp.asarray(x) for x in idx_list])
    return np.asarray(_recalls(q_BxTxHxD, k_BxTxKxD, idx, lp=lp, chunk=chunk))


@functools.partial(jax.jit, static_argnames=("lp", "chunk"))
def _recalls(q_BxTxHxD, k_BxTxKxD, idx_SxBxTxKxN, *, lp: int, chunk: int) -> jax.Array:
    B, T, H, D = q_BxTxHxD.shape
    S, N = idx_SxBxTxKxN.shape[0], idx_SxBxTxKxN.shape[-1]
    n_blocks = -(-T // lp)
    chunk = min(chunk, T)
    pad = -T % chunk
    q = jnp.pad(jnp.asarray(q_BxTxHxD), [(0, 0), (0, pad), (0, 0), (0, 0)])
    idx = jnp.pad(idx_SxBxTxKxN, [(0, 0), (0, 0), (0, pad), (0, 0), (0, 0)], constant_values=-1)
    k = jnp.asarray(k_BxTxKxD)
    j_Nb = jnp.arange(n_blocks, dtype=jnp.int32)

    def body(c):
        t_C = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
        q_c = jax.lax.dynamic_slice_in_dim(q, c * chunk, chunk, 1)
        idx_c = jax.lax.dynamic_slice_in_dim(idx, c * chunk, chunk, 2)
        mass = full_block_mass(q_c, k, t_C, lp=lp, scale=D**-0.5)  # [B, C, K, Nb]
        selected = jnp.any(idx_c[..., None] == j_Nb, axis=-2)  # [S, B, C, K, Nb]
        recall = jnp.moveaxis(jnp.sum(jnp.where(selected, mass, 0.0), -1), 0, -1)  # [B, C, K, S]
        free = free_blocks(t_C, n_blocks, lp)[None, :, None, :]
        best_free = jax.lax.top_k(jnp.where(free, mass, 0.0), max(N - FORCED, 1))[0].sum(-1)
        best = jnp.sum(jnp.where(free, 0.0, mass), -1) + best_free
        real = (t_C >= N * lp)[None, :, None, None]
        return jnp.where(real, jnp.concatenate([recall, best[..., None]], -1), 1.0)

    out = jax.lax.map(body, jnp.arange((T + pad) // chunk))  # [chunks, B, C, K, S + 1]
    return jnp.moveaxis(out, 0, 1).reshape(B, T + pad, -1, S + 1)[:, :T]


def parse_scorer(spec: str, lp: int, n: int = 1) -> tuple[str, int]:
    """`NAME[:SUB]` -> (name, sub-block length; rescore: its candidates); ValueError naming the valid forms."""
    name, _, sub = spec.partition(":")
    if name not in SCREEN_SCORERS or (sub and name.startswith("cmp")):
        raise ValueError(
            f"scorer {spec!r}: use one of {', '.join(SCREEN_SCORERS)} (minmax and mix may add :SUB, rescore :M)"
        )
    if name == "rescore":
        m = int(sub) if sub.isdigit() else default_candidates(n) if not sub else 0
        if m < n:
            raise ValueError(f"scorer {spec!r}: M (its candidates) must be at least n = {n}")
        return name, m
    size = int(sub) if sub.isdigit() else lp if not sub else 0
    if size < 1 or lp % size:
        raise ValueError(f"scorer {spec!r}: SUB must be a positive divisor of lp = {lp}")
    return name, size


SCREEN_SCORERS = ("cmp", "cmp_max", "minmax", "minmax-hmax", "mix", "rescore")


@functools.partial(jax.jit, static_argnames=("name", "sub", "l", "d", "lp", "n"))
def rescore(q_BxTxHxD, k_BxTxKxD, kc_BxTcxKxD, *, name: str, sub: int, l: int, d: int, lp: int, n: int):
    """The blocks [B, T, K, n] scorer `name` chooses from one layer's queries, selection keys and
    compressed keys, through the scorers' own functions (kernels/scorers.py, kernels/xla.py)."""
    T, D = q_BxTxHxD.shape[1], q_BxTxHxD.shape[-1]
    if name == "rescore":  # cmp's best `sub` blocks, re-ranked by their exact mass
        _, scores = compressed_attention_xla(q_BxTxHxD, kc_BxTcxKxD, kc_BxTcxKxD, l=l, d=d, lp=lp, scale=D**-0.5)
        return select_rescore_xla(q_BxTxHxD, k_BxTxKxD, select_blocks(scores, lp, sub), lp=lp, n=n)
    if name in ("cmp", "cmp_max", "mix"):
        pool = "max" if name == "cmp_max" else "sum"
        _, scores = compressed_attention_xla(q_BxTxHxD, kc_BxTcxKxD, kc_BxTcxKxD, l=l, d=d, lp=lp,
                                             scale=D**-0.5, pool=pool)  # fmt: skip
        if name == "mix":  # cmp's scores plus minmax's: each sums to G over a query's blocks
            kmin, kmax = key_bounds(k_BxTxKxD, lp, sub)
            t_T = jnp.arange(T, dtype=jnp.int32)
            scores = scores + minmax_block_scores(q_BxTxHxD, kmin, kmax, t_T, lp=lp, sub=sub, scale=D**-0.5)
        return select_blocks(scores, lp, n)
    if name == "minmax":
        return select_minmax_xla(q_BxTxHxD, k_BxTxKxD, lp=lp, n=n, sub=sub)
    B, _, H, _ = q_BxTxHxD.shape
    K = k_BxTxKxD.shape[2]
    kmin, kmax = key_bounds(k_BxTxKxD, lp, sub)

    def body(start, q_c):  # minmax-hmax: the largest bound logit over the group's heads
        logits = bound_block_logits(q_c.reshape(B, -1, K, H // K, D), kmin, kmax, lp, sub, D**-0.5)
        t_C = start + jnp.arange(q_c.shape[1], dtype=jnp.int32)
        return select_blocks(jnp.max(logits, axis=3), lp, n, t_C)

    return map_query_chunks(body, 512, q_BxTxHxD)


def buckets(start: int, length: int) -> list[tuple[int, int]]:
    """Query positions [start, 2 start), [2 start, 4 start), ... up to length."""
    out, lo = [], start
    while lo < length:
        out.append((lo, min(2 * lo, length)))
        lo *= 2
    return out


def measure(path: str, length: int | None, rows: int, text: list[str], scorers=(), overrides=()) -> dict:
    cfg, params = load_model(path)
    cfg = replace(cfg, list(overrides)) if overrides else cfg
    a = cfg.model.nsa
    if "slc" not in a.branches or cfg.model.attention != "nsa":
        raise SystemExit(f"error: {path}: the model has no selection branch")
    parsed = [parse_scorer(x, a.lp, a.n) for x in scorers]
    L = length or cfg.train.seq_len
    if L <= a.n * a.lp:
        raise SystemExit(f"error: --length {L}: every block is selected up to n*lp = {a.n * a.lp}; ask for more")
    tokens_BxT1 = TextRows(cfg, text)(L, rows)
    model = NSALM(inference_config(cfg.model))
    _, state = jax.jit(lambda p, t: model.apply({"params": p}, t, mutable=["intermediates", "scorer_inputs"]))(
        params, tokens_BxT1[:, :-1]
    )
    idx = per_layer(state, "intermediates", "block_idx", cfg.model)
    names = ("queries", "selection_keys", "compressed_keys")
    q, k, kc = (per_layer(state, "scorer_inputs", n, cfg.model) for n in names)
    spans = buckets(a.n * a.lp, L)
    layers = []
    for i in range(cfg.model.n_layers):
        chosen = [idx[i]] + [
            rescore(q[i], k[i], kc[i], name=name, sub=sub, l=a.l, d=a.d, lp=a.lp, n=a.n) for name, sub in parsed
        ]
        rb = recalls(q[i], k[i], chosen, lp=a.lp)
        layers.append({f"{lo}-{hi}": rb[:, lo:hi].mean(axis=(0, 1, 2)).tolist() for lo, hi in spans})
    mean = {key: np.mean([r[key] for r in layers], axis=0).tolist() for key in layers[0]}
    columns = [f"selected ({a.scorer})", *scorers, "best n blocks"]
    return dict(checkpoint=path, length=L, rows=rows, lp=a.lp, n=a.n, columns=columns, layers=layers, mean=mean)


def print_report(res: dict) -> None:
    keys = list(res["mean"])
    cols = res["columns"]
    print(
        f"{res['checkpoint']}: L={res['length']}, lp={res['lp']}, n={res['n']}, {res['rows']} rows. Share of the "
        f"full attention on the blocks chosen, by query position: {' / '.join(cols)}"
    )
    width = 8 * len(cols) + 2
    print("  " + f"{'layer':>6}" + "".join(f"{k:>{width}}" for k in keys))
    named = [(str(i), r) for i, r in enumerate(res["layers"])] + [("mean", res["mean"])]
    for name, r in named:
        print("  " + f"{name:>6}" + "".join(f"{' / '.join(f'{v:.3f}' for v in r[k]):>{width}}" for k in keys))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", action="append", required=True, help="a model folder, run or checkpoint; repeatable")
    p.add_argument("--length", type=int, default=None, help="row length (default: the run's train.seq_len)")
    p.add_argument("--rows", type=int, default=1, help="rows of the text (default 1)")
    p.add_argument("--text", nargs="*", default=[], help="text files (default: the run's val split)")
    p.add_argument("--json", default=None, help="write the figures of every checkpoint to this JSON file")
    p.add_argument("--scorers", default="", help="comma-separated scorers to screen beside the model's own")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    args = p.parse_args(argv)
    if args.rows < 1:
        raise SystemExit("error: --rows must be >= 1")
    results = []
    for path in args.ckpt:
        try:
            scorers = [x for x in args.scorers.split(",") if x]
            res = measure(path, args.length, args.rows, args.text, scorers, args.set)
        except (CheckpointError, ValueError, OSError) as e:
            raise SystemExit(f"error: {path}: {e}") from None
        results.append(res)
        print_report(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
