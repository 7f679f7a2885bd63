"""How much neighbouring queries share their selected blocks: the question behind the selection kernel's tiling.

The gather selection kernel runs one query position per program and loads the K/V
tiles of its n selected blocks; a program of P consecutive positions
(`SelectionBlockSizes(positions=P)`) loads the union of their blocks once. Which wins
on a GPU depends on how much that union saves, which depends on the selections a
trained model makes. For a checkpoint, on held-out rows of length L, per layer:

  loads P=2/4/8   K/V block loads of programs of P consecutive positions (aligned at
                  multiples of P, as the kernel's) relative to one program per
                  position: 1.00 shares nothing, 1/P is P positions with one selection
  same set        the share of positions whose selected blocks (per KV head) equal
                  the previous position's

and the same for random selections of the same geometry (the benchmarks' inputs). On
an H200 (docs/PERFORMANCE.md "Which tiling"), four positions per program lost to one
under random selections and won with runs of 8 positions sharing a selection
(loads 0.25 at P=4); where a trained model lies between is what this prints.

    python -m experiments.selection_locality --ckpt RUN/checkpoints/STEP|MODEL_FOLDER [--length L] \\
        [--rows 4] [--text FILE ...] [--json OUT] [--save-idx FILE.npz --save-layers 0,14,29]

`--save-idx` keeps the selections themselves (one checkpoint): int16 block indices
[rows, L, K, n] of each of `--save-layers` as `idx_<layer>` (each slot set in ascending order,
unused slots last), with `lp`, `n` and the
checkpoint, for `benchmarks.bench_kernels --idx-file` to time the kernels on.
"""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np

from nsa_jax.evaluation.suites import TextRows
from nsa_jax.inference.decode import inference_config
from nsa_jax.kernels.reference import random_block_indices
from nsa_jax.model import NSALM, per_layer
from nsa_jax.rundir.model_dir import load_model
from nsa_jax.rundir.resume import CheckpointError

POSITIONS = (2, 4, 8)


def _distinct_valid(ids_GxM: np.ndarray) -> np.ndarray:
    """[G]: the number of distinct non-negative ids in each row."""
    s = np.sort(ids_GxM, axis=-1)
    new = np.ones_like(s, bool)
    new[:, 1:] = s[:, 1:] != s[:, :-1]
    return np.sum(new & (s >= 0), axis=-1)


def tile_loads(idx_BxTxKxN: np.ndarray, positions: int) -> float:
    """Block loads of programs of `positions` consecutive queries (aligned; the last may be
    short) over the loads of one program per query: sum of |union of the group's valid
    blocks| over the sum of |valid blocks| per query, over rows and KV heads."""
    B, T, K, N = idx_BxTxKxN.shape
    pad = -T % positions
    idx = np.concatenate([idx_BxTxKxN, np.full((B, pad, K, N), -1, idx_BxTxKxN.dtype)], axis=1)
    groups = idx.reshape(B, (T + pad) // positions, positions, K, N).transpose(0, 1, 3, 2, 4)
    union = _distinct_valid(groups.reshape(-1, positions * N)).sum()
    single = _distinct_valid(idx_BxTxKxN.reshape(-1, N)).sum()
    return float(union / single)


def same_set_share(idx_BxTxKxN: np.ndarray) -> float:
    """The share of (position t > 0, KV head) whose set of selected blocks equals position t - 1's."""
    s = np.sort(idx_BxTxKxN, axis=-1)
    return float(np.mean(np.all(s[:, 1:] == s[:, :-1], axis=-1)))


def union_size(idx_BxTxKxN: np.ndarray, positions: int) -> float:
    """The mean number of distinct blocks selected by `positions` consecutive queries (aligned
    groups, whole ones only) of one KV head: what one program of the packed kernel loads."""
    B, T, K, N = idx_BxTxKxN.shape
    whole = T - T % positions
    groups = idx_BxTxKxN[:, :whole].reshape(B, whole // positions, positions, K, N).transpose(0, 1, 3, 2, 4)
    return float(_distinct_valid(groups.reshape(-1, positions * N)).mean())


def locality(idx_BxTxKxN: np.ndarray) -> dict[str, float]:
    """The module docstring's figures for one layer's selections."""
    out = {f"loads_p{p}": tile_loads(idx_BxTxKxN, p) for p in POSITIONS}
    out |= {f"union_p{p}": union_size(idx_BxTxKxN, p) for p in (1, *POSITIONS)}
    return out | {"same_set": same_set_share(idx_BxTxKxN)}


def sorted_slots(idx_BxTxKxN: np.ndarray) -> np.ndarray:
    """Each (query, group)'s block ids in ascending order, unused slots (-1) last: the kernels read a set,
    and sorted the saved selections compress 2.6 times smaller."""
    idx = np.asarray(idx_BxTxKxN)
    key = np.where(idx < 0, np.iinfo(np.int32).max, idx)
    return np.take_along_axis(idx, np.argsort(key, axis=-1, kind="stable"), axis=-1)


def save_selections(out: str, idx_LxBxTxKxN: np.ndarray, layers: list[int], res: dict) -> None:
    """`layers`' selections as int16 `idx_<layer>` [rows, T, K, n] in `out` (compressed npz; slots sorted)."""
    arrays = {f"idx_{i}": sorted_slots(idx_LxBxTxKxN[i]).astype(np.int16) for i in layers}
    meta = {k: np.asarray(res[k]) for k in ("checkpoint", "length", "lp", "n")}
    np.savez_compressed(out, **arrays, **meta)
    print(f"wrote {out}: layers {layers}, [rows, T, K, n] = {list(idx_LxBxTxKxN.shape[1:])}")


def measure(path: str, length: int | None, rows: int, text: list[str], keep: list[int] = ()) -> tuple[dict, np.ndarray]:
    """(the figures, the block indices [layers, rows, T, K, n]); `keep`: layers to be saved, checked first."""
    cfg, params = load_model(path)
    a = cfg.model.nsa
    if "slc" not in a.branches:
        raise SystemExit(f"error: {path}: the model has no selection branch (model.nsa.branches={a.branches})")
    bad = [i for i in keep if not 0 <= i < cfg.model.n_layers]
    if bad:  # before the forward, which takes minutes at long L
        raise SystemExit(f"error: --save-layers {bad}: the model has layers 0..{cfg.model.n_layers - 1}")
    L = length or cfg.train.seq_len
    tokens_BxT1 = TextRows(cfg, text)(L, rows)
    model = NSALM(inference_config(cfg.model))
    _, state = jax.jit(lambda p, t: model.apply({"params": p}, t, mutable=["intermediates"]))(
        params, tokens_BxT1[:, :-1]
    )
    idx_LxBxTxKxN = np.asarray(per_layer(state, "intermediates", "block_idx", cfg.model))
    layers = [locality(idx) for idx in idx_LxBxTxKxN]
    B, T, K, N = idx_LxBxTxKxN.shape[1:]
    rand = locality(random_block_indices(np.random.default_rng(0), B, T, K, N, a.lp))
    return dict(checkpoint=path, length=L, rows=rows, lp=a.lp, n=a.n, layers=layers, random=rand), idx_LxBxTxKxN


def print_report(res: dict) -> None:
    print(
        f"{res['checkpoint']}: L={res['length']}, lp={res['lp']}, n={res['n']}, {res['rows']} rows. K/V block loads "
        "of a program of P positions relative to one per position (1.00 shares nothing, 1/P all)"
    )
    sizes = (1, *POSITIONS)
    print(
        "  "
        + f"{'layer':>6}"
        + "".join(f"{f'P={p}':>8}" for p in POSITIONS)
        + f"{'same set':>10}"
        + "".join(f"{f'|U{p}|':>8}" for p in sizes)
        + "   (|UP|: distinct blocks of P positions, one KV head)"
    )
    named = [(str(i), r) for i, r in enumerate(res["layers"])] + [("random", res["random"])]
    for name, r in named:
        loads = "".join(f"{r[f'loads_p{p}']:8.2f}" for p in POSITIONS)
        unions = "".join(f"{r[f'union_p{p}']:8.1f}" for p in sizes)
        print("  " + f"{name:>6}" + loads + f"{r['same_set']:10.2f}" + unions)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", action="append", required=True, help="a run folder or one checkpoint in it; repeatable")
    p.add_argument("--length", type=int, default=None, help="row length (default: the run's train.seq_len)")
    p.add_argument("--rows", type=int, default=4, help="held-out rows (default 4)")
    p.add_argument("--text", nargs="*", default=[], help="held-out text files (default: the run's val split)")
    p.add_argument("--json", default=None, help="write the figures of every checkpoint to this JSON file")
    p.add_argument("--save-idx", default=None, help="write the selections of --save-layers to this .npz (one --ckpt)")
    p.add_argument("--save-layers", default="0", help="comma-separated layers for --save-idx (default 0)")
    args = p.parse_args(argv)
    if args.rows < 1 or (args.length is not None and args.length < 2):
        raise SystemExit("error: --rows must be >= 1 and --length >= 2")
    if args.save_idx and len(args.ckpt) != 1:
        raise SystemExit("error: --save-idx takes the selections of one --ckpt")
    try:
        save_layers = [int(x) for x in args.save_layers.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"error: --save-layers {args.save_layers!r}: comma-separated layer numbers") from None
    results = []
    for path in args.ckpt:
        try:
            keep = save_layers if args.save_idx else []
            res, idx = measure(path, args.length, args.rows, args.text, keep)
        except (CheckpointError, ValueError, OSError) as e:
            raise SystemExit(f"error: {path}: {e}") from None
        results.append(res)
        print_report(res)
        if args.save_idx:
            save_selections(args.save_idx, idx, save_layers, res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
