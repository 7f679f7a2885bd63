"""Benchmark the selection / window attention kernels.

Compares, at the production head configuration (H=12 query heads, K=2 KV
heads, head dim 64, lp=64, n=16, w=512; compressed branch l=32, d=16 with the
n=16 selected blocks, as the layer runs it: on the Pallas path one kernel scores
and selects the blocks):

* ``pallas``: the Triton-backend Pallas kernels (nsa_jax.kernels.*_pallas; for
  the selection branch the gather kernel, selection_pallas),
* ``blocksparse`` (selection branch only): the block-sparse flash kernel
  (blocksparse_pallas), which ``kernels.selection_attention`` runs instead of the
  gather kernel when T <= 2 n lp (2048 here),
* ``xla``: the plain-XLA chunked path (nsa_jax.kernels.xla),
* ``dense``: full causal ``jax.nn.dot_product_attention`` (the cost NSA avoids),

forward and (with ``--backward``) forward+backward, printing milliseconds and
the speedup of the Pallas kernels over the others.

Usage:
  python -m benchmarks.bench_kernels [--seq-lens 2048,4096] [--backward]
                                     [--json out.json]

Without a GPU the Pallas kernels only run in the interpreter, which says
nothing about speed, so they are skipped; the XLA and dense paths run at the
sizes that fit in a short time (T <= 4096 by default).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import fmt, log, on_gpu, print_header, print_table_header, short_error, time_fn, write_json
from nsa_jax.kernels import compressed_attention
from nsa_jax.kernels.blocksparse_pallas import selection_attention_blocksparse_pallas
from nsa_jax.kernels.flash_pallas import FlashBlockSizes, window_attention_pallas
from nsa_jax.kernels.reference import random_block_indices
from nsa_jax.kernels.selection_pallas import SelectionBlockSizes, selection_attention_pallas

try:
    from nsa_jax.kernels import xla as xla_kernels
except ImportError:  # the reference path is optional for this script
    xla_kernels = None

PROD = dict(heads=12, kv_heads=2, head_dim=64, block_size=64, slots=16, window=512, cmp_l=32, cmp_d=16)
GPU_SEQ_LENS = (2048, 4096, 8192, 16384, 32768, 65536)
CPU_SEQ_LENS = (2048, 4096)
# Kernels that only the interpreter runs without a GPU (skipped there).
PALLAS_IMPLS = ("pallas", "blocksparse")


def with_backward(fn):
    """fn(q, k, v, idx) -> (o, aux); forward+backward of sum(o * ct) w.r.t. q, k, v (aux kept)."""

    def run(q, k, v, idx, ct):
        o, vjp, aux = jax.vjp(lambda q, k, v: fn(q, k, v, idx), q, k, v, has_aux=True)
        return o, aux, vjp(ct)

    return run


def candidates(branch, interpret=False, positions=1, blocksparse_sizes=None):
    """name -> fn(q, k, v, idx) -> (o, aux).

    The block indices are an argument, not a closed-over constant: as a constant XLA
    would fold the selection backward's reverse-index sort into the program at compile
    time and the timings would leave that work out. The compressed branch gets the
    compressed keys and values (T/d of them) and returns the selected blocks as aux
    (the layer's call: scoring and top-n), so their cost is timed too.
    """
    p = PROD
    impls = {}
    no_aux = lambda fn: lambda *a: (fn(*a), None)  # noqa: E731
    if branch == "selection":
        impls["pallas"] = no_aux(
            lambda q, k, v, idx: selection_attention_pallas(
                q, k, v, idx, p["block_size"], interpret=interpret, block_sizes=SelectionBlockSizes(positions=positions)
            )
        )
        impls["blocksparse"] = no_aux(
            lambda q, k, v, idx: selection_attention_blocksparse_pallas(
                q, k, v, idx, p["block_size"], interpret=interpret, block_sizes=blocksparse_sizes
            )
        )
        if xla_kernels is not None:
            impls["xla"] = no_aux(
                lambda q, k, v, idx: xla_kernels.selection_attention_xla(q, k, v, idx, p["block_size"])
            )
    elif branch == "compressed":
        for impl in ("pallas", "xla"):
            impls[impl] = functools.partial(compressed_branch, impl=impl)
    else:
        impls["pallas"] = no_aux(
            lambda q, k, v, idx: window_attention_pallas(q, k, v, p["window"], interpret=interpret)
        )
        if xla_kernels is not None:
            impls["xla"] = no_aux(lambda q, k, v, idx: xla_kernels.window_attention_xla(q, k, v, p["window"]))
    impls["dense"] = dense_attention("cudnn" if on_gpu() else "xla")
    return impls


def parse_block_sizes(text):
    """``FlashBlockSizes`` from ``name=int,...`` (empty: None, the kernel's defaults); exits on a bad entry."""
    if not text:
        return None
    names = {f.name for f in dataclasses.fields(FlashBlockSizes)}
    values = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name.strip() not in names or not value.strip().isdigit():
            raise SystemExit(
                f"error: --blocksparse-block-sizes entry {item!r} is not name=integer with name one of {sorted(names)}"
            )
        values[name.strip()] = int(value)
    return FlashBlockSizes(**values)


def compressed_branch(q, kc, vc, idx, *, impl):
    """(o_cmp, selected blocks [B, T, K, n]) of the compressed branch through `impl`, as the layer calls it."""
    del idx
    p = PROD
    return compressed_attention(
        q, kc, vc, l=p["cmp_l"], d=p["cmp_d"], lp=p["block_size"], impl=impl, select_n=p["slots"]
    )


def dense_attention(implementation):
    """Full causal attention: cuDNN's fused (flash) kernel on a GPU, the fastest dense
    baseline there and O(T) in memory; XLA's, which holds H x T x T scores, elsewhere."""
    return lambda q, k, v, idx: (
        jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation),
        None,
    )


def run_one(name, fn, args, ct, mode, opts):
    try:
        if mode == "fwd":
            return time_fn(fn, args, opts.warmup, opts.iters), None
        return time_fn(with_backward(fn), args + (ct,), opts.warmup, opts.iters), None
    except Exception as e:  # out of memory, unsupported size, ...
        msg = short_error(e)
        log(f"  {name} failed: {msg}")
        return None, msg


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seq-lens",
        type=str,
        default=None,
        help="comma-separated T values (default: 2k..64k on GPU, 2048,4096 on CPU)",
    )
    parser.add_argument("--backward", action="store_true", help="also time forward+backward")
    parser.add_argument("--branches", default="selection,window,compressed")
    parser.add_argument(
        "--selection-positions",
        type=int,
        default=1,
        help="query positions per selection forward / dQ program (SelectionBlockSizes.positions)",
    )
    parser.add_argument(
        "--blocksparse-block-sizes",
        default="",
        help="FlashBlockSizes of the block-sparse selection kernel, e.g. block_rows=64,block_keys=64,dkv_splits=6 "
        "(default: the kernel's own choice)",
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument(
        "--dense-max-seq",
        type=int,
        default=None,
        help="largest T for dense attention (default: 65536 with cuDNN on a GPU, 16384 elsewhere: T x T memory)",
    )
    parser.add_argument(
        "--impls",
        default=None,
        help="comma-separated implementations to time, of pallas, blocksparse, xla, dense (default: all); "
        "e.g. pallas,blocksparse,dense leaves out the XLA selection backward, which takes seconds at 64k",
    )
    parser.add_argument("--json", type=str, default=None, help="write the results to this JSON file")
    opts = parser.parse_args(argv)
    known = ("pallas", "blocksparse", "xla", "dense")
    chosen = None if opts.impls is None else [i.strip() for i in opts.impls.split(",") if i.strip()]
    bad = [i for i in chosen or () if i not in known]
    if bad or chosen == []:
        raise SystemExit(f"error: --impls {opts.impls!r}: name one or more of {', '.join(known)}")

    blocksparse_sizes = parse_block_sizes(opts.blocksparse_block_sizes)
    gpu = on_gpu()
    if opts.dense_max_seq is None:
        opts.dense_max_seq = 65536 if gpu else 16384
    env = print_header(__doc__.splitlines()[0])
    if not gpu:
        print(
            "No GPU found: the Pallas kernels would only run in the "
            "interpreter, which is not a benchmark, so they are SKIPPED. "
            "Timing the XLA and dense paths only."
        )
    if xla_kernels is None:
        print("nsa_jax.kernels.xla not importable: XLA path skipped.")
    if opts.seq_lens:
        seq_lens = [int(s) for s in opts.seq_lens.split(",") if s]
    else:
        seq_lens = list(GPU_SEQ_LENS if gpu else CPU_SEQ_LENS)
    dtype = jnp.dtype(opts.dtype)
    modes = ["fwd"] + (["fwd+bwd"] if opts.backward else [])
    branches = [b.strip() for b in opts.branches.split(",") if b.strip()]
    p = PROD

    rows = []
    dense_cache = {}
    key = jax.random.PRNGKey(0)
    for seq in seq_lens:
        kq, kk, kv, kc = jax.random.split(jax.random.fold_in(key, seq), 4)
        shape_q = (opts.batch, seq, p["heads"], p["head_dim"])
        shape_kv = (opts.batch, seq, p["kv_heads"], p["head_dim"])
        q = jax.random.normal(kq, shape_q, dtype)
        k = jax.random.normal(kk, shape_kv, dtype)
        v = jax.random.normal(kv, shape_kv, dtype)
        ct = jax.random.normal(kc, shape_q, dtype)
        rng = np.random.default_rng(seq)
        idx = jnp.asarray(random_block_indices(rng, opts.batch, seq, p["kv_heads"], p["slots"], p["block_size"]))
        tc = (seq - p["cmp_l"]) // p["cmp_d"] + 1
        cmp_args = (q, k[:, :tc], v[:, :tc], idx)
        for branch in branches:
            impls = candidates(branch, positions=opts.selection_positions, blocksparse_sizes=blocksparse_sizes)
            impls = {name: fn for name, fn in impls.items() if chosen is None or name in chosen}
            for mode in modes:
                row = dict(seq=seq, branch=branch, mode=mode)
                for name, fn in impls.items():
                    skip = None
                    if name in PALLAS_IMPLS and not gpu:
                        skip = "no GPU"
                    elif name == "dense" and seq > opts.dense_max_seq:
                        skip = f"T > --dense-max-seq {opts.dense_max_seq}"
                    if skip:
                        row[f"{name}_ms"], row[f"{name}_note"] = None, skip
                        continue
                    if name == "dense" and (seq, mode) in dense_cache:
                        # Same computation for both branches: time it once.
                        row["dense_ms"], err = dense_cache[(seq, mode)]
                    else:
                        log(f"T={seq} {branch} {mode} {name} ...")
                        # Dense attention reads all T keys; the compressed branch its T/d tokens.
                        args = (q, k, v, idx) if name == "dense" or branch != "compressed" else cmp_args
                        row[f"{name}_ms"], err = run_one(name, fn, args, ct, mode, opts)
                        if name == "dense" and err and gpu:
                            log("  cuDNN attention failed; timing XLA's dense attention instead")
                            fn = dense_attention("xla")
                            row["dense_ms"], err = run_one(name, fn, args, ct, mode, opts)
                            err = err or "cuDNN failed, XLA dense timed"
                        if name == "dense":
                            dense_cache[(seq, mode)] = (row["dense_ms"], err)
                    if err:
                        row[f"{name}_note"] = err
                for other in ("xla", "dense"):
                    a, b = row.get("pallas_ms"), row.get(f"{other}_ms")
                    row[f"speedup_vs_{other}"] = (b / a) if a and b else None
                a, b = row.get("blocksparse_ms"), row.get("dense_ms")
                row["blocksparse_speedup_vs_dense"] = (b / a) if a and b else None
                rows.append(row)

    header = (
        f"{'T':>6} {'branch':<10} {'mode':<7} {'pallas ms':>9} {'bsp ms':>9} "
        f"{'xla ms':>9} {'dense ms':>9} {'xla/pal':>9} {'dense/pal':>9} {'dense/bsp':>9}"
    )
    print_table_header(header)
    for r in rows:
        print(
            f"{r['seq']:>6} {r['branch']:<10} {r['mode']:<7} "
            f"{fmt(r.get('pallas_ms'))} {fmt(r.get('blocksparse_ms'))} {fmt(r.get('xla_ms'))} "
            f"{fmt(r.get('dense_ms'))} "
            f"{fmt(r.get('speedup_vs_xla'), '{:8.2f}x')} "
            f"{fmt(r.get('speedup_vs_dense'), '{:8.2f}x')} "
            f"{fmt(r.get('blocksparse_speedup_vs_dense'), '{:8.2f}x')}"
        )
    notes = sorted({(k[:-5], r[k]) for r in rows for k in r if k.endswith("_note")})
    for name, note in notes:
        print(f"  {name}: {note}")
    meta = dict(
        env,
        dtype=opts.dtype,
        batch=opts.batch,
        config=PROD,
        selection_positions=opts.selection_positions,
        blocksparse_block_sizes=opts.blocksparse_block_sizes,
        pallas_skipped=not gpu,
    )
    write_json(opts.json, meta, rows)


if __name__ == "__main__":
    main()
