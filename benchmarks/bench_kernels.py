"""Time each NSA branch's candidate kernels side by side, against dense attention.

At the production head configuration (H=12 query heads, K=2 KV heads, head dim
64, lp=64, n=16, w=512; compressed branch l=32, d=16 with the n=16 selected
blocks, as the layer runs it), forward and (with ``--backward``)
forward+backward, one row per (T, branch, mode, candidate):

* ``ms``: median wall time; ``TFLOP/s``: the matmul FLOPs of the (query, key)
  pairs the branch attends to (QK and PV forward, 2.5x that backward, the
  flash-attention convention), over that time; ``dense/x``: dense causal
  attention's time over the candidate's (> 1: the candidate is faster);
  ``max|o-ref|``: the candidate's forward output against the branch's ``xla``
  path (a cheap sanity check; tests/ hold the float64 references).

Candidates (``--impls`` picks by name, ``--selection-variants`` adds gather
kernels with other ``SelectionBlockSizes``, ``--flash-variants`` the flash kernels
(window, compressed attention, block-sparse selection) with other ``FlashBlockSizes``,
each named ``NAME[TILES]``):

* selection: ``gather`` (selection_pallas with the tiles the layer runs,
  kernels.SELECTION_KERNELS) and one ``sel[...]`` per variant (any
  ``SelectionBlockSizes``, e.g. ``positions=4,num_warps=1``),
  ``blocksparse`` (blocksparse_pallas; the layer's kernel up to T = 2 n lp) and one
  ``blocksparse[...]`` per flash variant, ``xla`` (its ``auto`` strategy: ``masked`` when
  T <= 2 n lp, else ``gather``), and ``xla-gather`` / ``xla-masked`` (each strategy forced);
* window: ``pallas`` (flash_pallas) and one ``pallas[...]`` per flash variant, ``cudnn``
  (``jax.nn.dot_product_attention`` with ``local_window_size``, GPU only), ``xla``;
* compressed: ``pallas`` (attention, then scores and top-n in one kernel), ``xla``; and the
  attention alone (no block selection): ``pallas-attn`` (the flash kernel the layer runs) and
  one ``pallas-attn[...]`` per flash variant, and ``cudnn-attn`` (kernels/cudnn.py: the branch
  regrouped into causal GQA over the Tc tokens, through cuDNN; GPU only);
* ``dense``: full causal attention, cuDNN's on a GPU, XLA's elsewhere.

Usage:
  python -m benchmarks.bench_kernels [--seq-lens 8k,64k] [--backward] [--json out.json]
      [--selection-variants "positions=1;positions=4,num_warps=2"]
      [--flash-variants "block_rows=128,num_warps=8;num_stages=3"]

Without a GPU the Pallas kernels only run in the interpreter, which says
nothing about speed, so they are skipped; the XLA and dense paths run at the
sizes that fit in a short time (T <= 4096 by default).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import fmt, log, on_gpu, parse_ints, print_header, short_error, time_fn, write_json
from nsa_jax.kernels import SELECTION_KERNELS, compressed_attention
from nsa_jax.kernels import xla as xla_kernels
from nsa_jax.kernels.blocksparse_pallas import selection_attention_blocksparse_pallas
from nsa_jax.kernels.compressed_pallas import CompressedBlockSizes, compressed_attention_pallas
from nsa_jax.kernels.cudnn import compressed_attention_grouped, window_attention_cudnn
from nsa_jax.kernels.flash_pallas import FlashBlockSizes, window_attention_pallas
from nsa_jax.kernels.reference import random_block_indices
from nsa_jax.kernels.selection_pallas import SelectionBlockSizes, selection_attention_pallas

PROD = dict(heads=12, kv_heads=2, head_dim=64, block_size=64, slots=16, window=512, cmp_l=32, cmp_d=16)
GPU_SEQ_LENS = (2048, 8192, 32768, 65536)
CPU_SEQ_LENS = (2048, 4096)
# Candidates that need a GPU to say anything about speed (the Pallas ones only interpret elsewhere).
GPU_ONLY = ("gather", "sel", "blocksparse", "pallas", "cudnn", "pallas-attn", "cudnn-attn")
# The forward+backward FLOPs over the forward's: QK^T and PV forward; the QK^T recompute, dP, dV, dQ, dK backward.
FWD_BWD_FLOP_RATIO = 3.5


def with_backward(fn):
    """fn(q, k, v, idx) -> (o, aux); forward+backward of sum(o * ct) w.r.t. q, k, v (aux kept)."""

    def run(q, k, v, idx, ct):
        o, vjp, aux = jax.vjp(lambda q, k, v: fn(q, k, v, idx), q, k, v, has_aux=True)
        return o, aux, vjp(ct)

    return run


def parse_sizes(cls, text: str, flag: str):
    """``cls(**values)`` from ``name=value,...`` (empty: None): integers, 0/1 for flags, words for
    text fields; exits with one line on a bad entry."""
    if not text:
        return None
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for item in text.split(","):
        name, _, value = (x.strip() for x in item.partition("="))
        kind = str(fields[name].type) if name in fields else ""
        if name not in fields or not value or ("str" not in kind and not value.isdigit()):
            raise SystemExit(f"error: {flag} entry {item!r} is not name=value with name one of {sorted(fields)}")
        values[name] = value if "str" in kind else bool(int(value)) if "bool" in kind else int(value)
    return cls(**values)


def variant_name(text: str, base: str = "sel") -> str:
    """('positions=4,num_warps=2', 'sel') -> 'sel[positions=4,num_warps=2]'."""
    return f"{base}[{text.replace(' ', '')}]"


def _no_aux(fn):
    return lambda *a: (fn(*a), None)


def _tilings(base: str, sizes: dict, run) -> dict:
    """{base: run with sizes[""], base[TEXT]: run with each other tiling}; fn(q, k, v, idx) -> (o, None)
    from run(q, k, v, idx, bsz) -> o."""
    return {
        (variant_name(text, base) if text else base): _no_aux(functools.partial(run, bsz=bsz))
        for text, bsz in sizes.items()
    }


def candidates(branch, selection_variants=(), flash_variants=()):
    """name -> fn(q, k, v, idx) -> (o, aux), the branch's candidates in table order.

    The block indices are an argument, not a closed-over constant: as a constant XLA
    would fold the selection backward's reverse-index sort into the program at compile
    time and the timings would leave that work out. The compressed branch gets the
    compressed keys and values (T/d of them) and returns the selected blocks as aux
    (the layer's call: scoring and top-n), so their cost is timed too.
    `flash_variants`: ``FlashBlockSizes`` texts, each a candidate of every flash kernel.
    """
    p = PROD
    lp, w = p["block_size"], p["window"]
    l, d = p["cmp_l"], p["cmp_d"]
    # Today's tiles ("") and each variant, by name; a candidate per tiling of each kernel below.
    flash = {"": None, **{t: parse_sizes(FlashBlockSizes, t, "--flash-variants") for t in flash_variants}}
    impls = {}
    if branch == "selection":

        def gather(q, k, v, idx, bsz):
            return selection_attention_pallas(q, k, v, idx, lp, block_sizes=bsz)

        # The tiling the layer runs (kernels.SELECTION_KERNELS), then the variants.
        impls["gather"] = _no_aux(functools.partial(gather, bsz=SELECTION_KERNELS["gather"]))
        sel = {t: parse_sizes(SelectionBlockSizes, t, "--selection-variants") for t in selection_variants}
        impls.update(_tilings("sel", sel, gather))
        impls.update(
            _tilings(
                "blocksparse",
                flash,
                lambda q, k, v, idx, bsz: selection_attention_blocksparse_pallas(q, k, v, idx, lp, block_sizes=bsz),
            )
        )
        impls["xla"] = _no_aux(lambda q, k, v, idx: xla_kernels.selection_attention_xla(q, k, v, idx, lp))
        # Each of the XLA path's strategies forced, whatever `auto` would take at this T: where its
        # T <= 2 n lp switch belongs on this host (docs/lab/2026-12-02-pretrained-long8k.md).
        for strategy in ("gather", "masked"):
            impls[f"xla-{strategy}"] = _no_aux(functools.partial(_selection_xla, lp=lp, strategy=strategy))
    elif branch == "compressed":
        for impl in ("pallas", "xla"):
            impls[impl] = functools.partial(compressed_branch, impl=impl)
        impls.update(
            _tilings(
                "pallas-attn",
                flash,
                lambda q, kc, vc, idx, bsz: compressed_attention_pallas(
                    q, kc, vc, l=l, d=d, block_sizes=bsz and CompressedBlockSizes(bsz)
                ),
            )
        )
        impls["cudnn-attn"] = _no_aux(lambda q, kc, vc, idx: compressed_attention_grouped(q, kc, vc, l=l, d=d))
    elif branch == "window":
        impls.update(
            _tilings("pallas", flash, lambda q, k, v, idx, bsz: window_attention_pallas(q, k, v, w, block_sizes=bsz))
        )
        impls["cudnn"] = _no_aux(lambda q, k, v, idx: window_attention_cudnn(q, k, v, w))
        impls["xla"] = _no_aux(lambda q, k, v, idx: xla_kernels.window_attention_xla(q, k, v, w))
    else:
        raise SystemExit(f"error: --branches entry {branch!r} is not one of selection, window, compressed")
    return impls


def _selection_xla(q, k, v, idx, *, lp, strategy):
    return xla_kernels.selection_attention_xla(q, k, v, idx, lp, strategy=strategy)


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


def attended_pairs(branch: str, seq: int, idx_BxTxKxN: np.ndarray | None = None) -> float:
    """(query head, key) pairs the branch attends to at length `seq` (per batch row, mean over rows).

    selection: every key p <= t of each selected block, from the indices themselves;
    window: min(t + 1, w) per query; compressed: the compressed tokens a query sees;
    dense: t + 1 per query.
    """
    p = PROD
    t = np.arange(seq, dtype=np.int64)
    if branch == "dense":
        per_query = t + 1
    elif branch == "window":
        per_query = np.minimum(t + 1, p["window"])
    elif branch == "compressed":
        per_query = np.maximum((t - p["cmp_l"] + 1) // p["cmp_d"] + 1, 0)
    else:
        lp = p["block_size"]
        blk = idx_BxTxKxN.astype(np.int64)
        seen = np.clip(t[None, :, None, None] - blk * lp + 1, 0, lp) * (blk >= 0)
        group = p["heads"] // p["kv_heads"]
        return float(seen.sum()) * group / idx_BxTxKxN.shape[0]
    return float(per_query.sum()) * p["heads"]


def matmul_flops(pairs: float, mode: str) -> float:
    d = PROD["head_dim"]
    fwd = 2.0 * pairs * (d + d)
    return fwd if mode == "fwd" else FWD_BWD_FLOP_RATIO * fwd


def run_one(name, fn, args, ct, mode, opts):
    """(median ms, error line or None)."""
    try:
        if mode == "fwd":
            return time_fn(fn, args, opts.warmup, opts.iters), None
        return time_fn(with_backward(fn), args + (ct,), opts.warmup, opts.iters), None
    except Exception as e:  # out of memory, unsupported size or card, ...
        msg = short_error(e)
        log(f"  {name} failed: {msg}")
        return None, msg


def output_diff(fn, ref_fn, args) -> float | None:
    """max |fn(args) - ref_fn(args)| of the forward outputs, in fp32 (None when either fails)."""
    try:
        a = jax.jit(fn)(*args)[0].astype(jnp.float32)
        b = jax.jit(ref_fn)(*args)[0].astype(jnp.float32)
        return float(jnp.max(jnp.abs(a - b)))
    except Exception:
        return None


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", default=None, help="comma-separated T values, 2k/64k allowed")
    parser.add_argument("--backward", action="store_true", help="also time forward+backward")
    parser.add_argument("--branches", default="selection,window,compressed")
    parser.add_argument(
        "--selection-variants",
        default="",
        help="';'-separated SelectionBlockSizes of extra selection candidates, e.g. "
        "'positions=4,num_warps=2;positions=1,rows_dkv=32' (each a candidate named sel[...])",
    )
    parser.add_argument(
        "--flash-variants",
        default="",
        help="';'-separated FlashBlockSizes of extra flash-kernel candidates (window pallas[...], compressed "
        "pallas-attn[...], selection blocksparse[...]), e.g. 'block_rows=128,num_warps=8;num_stages=3'",
    )
    parser.add_argument(
        "--idx-runs",
        type=int,
        default=1,
        help="runs of this many consecutive queries share one random selection (1: every query draws its own; "
        "a trained model's neighbours share most blocks, which the multi-position gather kernel exploits)",
    )
    parser.add_argument(
        "--idx-file",
        default=None,
        help="a model's own selections in place of random ones: an .npz written by experiments.selection_locality "
        "--save-idx (its first --seq-lens positions and first KV heads of layer --idx-layer)",
    )
    parser.add_argument("--idx-layer", type=int, default=None, help="the --idx-file layer (default: its first)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--dense-max-seq", type=int, default=None, help="largest T for dense attention")
    parser.add_argument("--impls", default=None, help="comma-separated candidate names to time (default: all)")
    parser.add_argument("--no-check", action="store_true", help="skip the forward-output comparison")
    parser.add_argument("--json", default=None, help="write {meta, rows} to this JSON file")
    opts = parser.parse_args(argv)
    if opts.idx_runs < 1 or PROD["block_size"] % opts.idx_runs:
        raise SystemExit(f"error: --idx-runs {opts.idx_runs} must divide the block length {PROD['block_size']}")
    if opts.idx_file and opts.idx_runs != 1:
        raise SystemExit("error: --idx-runs draws random selections; --idx-file gives a model's: name one")
    opts.real_idx = load_selections(opts.idx_file, opts.idx_layer) if opts.idx_file else None
    return opts


def load_selections(path: str, layer: int | None) -> np.ndarray:
    """[rows, T, K, n] block indices of one layer of an experiments.selection_locality --save-idx file."""
    try:
        with np.load(path) as f:
            return _layer_selections(path, dict(f), layer)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: --idx-file {path}: cannot read it ({e})") from None


def _layer_selections(path: str, f: dict, layer: int | None) -> np.ndarray:
    layers = sorted(int(k.removeprefix("idx_")) for k in f if k.startswith("idx_"))
    if not layers:
        raise SystemExit(f"error: --idx-file {path}: no idx_<layer> arrays (selection_locality --save-idx writes them)")
    layer = layers[0] if layer is None else layer
    if layer not in layers:
        raise SystemExit(f"error: --idx-layer {layer}: {path} holds layers {layers}")
    lp, n = int(f["lp"]), int(f["n"])
    if (lp, n) != (PROD["block_size"], PROD["slots"]):
        raise SystemExit(
            f"error: --idx-file {path}: blocks of {lp} and n={n}, the benchmark's are {PROD['block_size']} and "
            f"{PROD['slots']}"
        )
    idx = f[f"idx_{layer}"].astype(np.int32)
    if idx.shape[2] < PROD["kv_heads"]:
        raise SystemExit(f"error: --idx-file {path}: {idx.shape[2]} KV heads, the benchmark needs {PROD['kv_heads']}")
    return idx[:, :, : PROD["kv_heads"]]


def make_inputs(seq, opts, dtype):
    p = PROD
    kq, kk, kv, kc = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(0), seq), 4)
    shape_q = (opts.batch, seq, p["heads"], p["head_dim"])
    shape_kv = (opts.batch, seq, p["kv_heads"], p["head_dim"])
    q = jax.random.normal(kq, shape_q, dtype)
    k = jax.random.normal(kk, shape_kv, dtype)
    v = jax.random.normal(kv, shape_kv, dtype)
    ct = jax.random.normal(kc, shape_q, dtype)
    if opts.real_idx is not None:  # causal selections: a row's first `seq` positions choose among their own blocks
        rows, length = opts.real_idx.shape[:2]
        if seq > length or opts.batch > rows:
            raise SystemExit(f"error: --idx-file holds {rows} rows of {length}: T={seq} x --batch {opts.batch} is more")
        return q, k, v, ct, opts.real_idx[: opts.batch, :seq]
    idx = random_block_indices(np.random.default_rng(seq), opts.batch, seq, p["kv_heads"], p["slots"], p["block_size"])
    # Runs aligned to a divisor of lp share the current block, so the first query's draw is valid for all.
    idx = idx[:, (np.arange(seq) // opts.idx_runs) * opts.idx_runs]
    return q, k, v, ct, idx


def main(argv=None):
    opts = parse_args(argv)
    variants = [v.strip() for v in opts.selection_variants.split(";") if v.strip()]
    flash_variants = [v.strip() for v in opts.flash_variants.split(";") if v.strip()]
    gpu = on_gpu()
    dense_max = opts.dense_max_seq or (65536 if gpu else 16384)
    env = print_header(__doc__.splitlines()[0])
    if not gpu:
        print("No GPU: the Pallas and cuDNN candidates are SKIPPED (the interpreter is not a benchmark).")
    seq_lens = parse_ints(opts.seq_lens) if opts.seq_lens else list(GPU_SEQ_LENS if gpu else CPU_SEQ_LENS)
    # Commas inside a variant's brackets belong to it: sel[positions=4,num_warps=2],dense.
    chosen = None if opts.impls is None else {i.strip() for i in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", opts.impls)}
    chosen = None if chosen is None else {i for i in chosen if i}
    modes = ["fwd"] + (["fwd+bwd"] if opts.backward else [])
    branches = [b.strip() for b in opts.branches.split(",") if b.strip()]
    all_impls = {b: candidates(b, variants, flash_variants) for b in branches}
    known = {n for impls in all_impls.values() for n in impls} | {"dense"}
    if chosen is not None and (not chosen or chosen - known):
        raise SystemExit(f"error: --impls {opts.impls!r}: name one or more of {', '.join(sorted(known))}")
    dense_fn = dense_attention("cudnn" if gpu else "xla")
    p = PROD

    rows = []
    for seq in seq_lens:
        q, k, v, ct, idx_np = make_inputs(seq, opts, jnp.dtype(opts.dtype))
        idx = jnp.asarray(idx_np)
        tc = (seq - p["cmp_l"]) // p["cmp_d"] + 1
        dense_pairs = attended_pairs("dense", seq)
        for mode in modes:
            dense_ms, dense_note = None, f"T > --dense-max-seq {dense_max}"
            if chosen is not None and "dense" not in chosen:
                dense_note = "not chosen"
            elif seq <= dense_max:
                log(f"T={seq} dense {mode} ...")
                dense_ms, dense_note = run_one("dense", dense_fn, (q, k, v, idx), ct, mode, opts)
            rows.append(
                dict(
                    seq=seq,
                    branch="dense",
                    mode=mode,
                    impl="cudnn" if gpu else "xla",
                    ms=dense_ms,
                    tflops=dense_ms and matmul_flops(dense_pairs, mode) * opts.batch / dense_ms / 1e9,
                    dense_over=1.0 if dense_ms else None,
                    note=dense_note if dense_ms is None else None,
                )
            )
            for branch in branches:
                args = (q, k[:, :tc], v[:, :tc], idx) if branch == "compressed" else (q, k, v, idx)
                pairs = attended_pairs(branch, seq, idx_np if branch == "selection" else None)
                impls = all_impls[branch]
                ref_name = "xla"  # the reference path (tests/ check it against float64)
                for name, fn in impls.items():
                    if chosen is not None and name not in chosen:
                        continue
                    row = dict(seq=seq, branch=branch, mode=mode, impl=name, ms=None)
                    base = name.split("[")[0]
                    if base in GPU_ONLY and not gpu:
                        row["note"] = "no GPU"
                    else:
                        log(f"T={seq} {branch} {mode} {name} ...")
                        row["ms"], row["note"] = run_one(name, fn, args, ct, mode, opts)
                        if row["ms"]:
                            log(f"  {row['ms']:.3f} ms")
                    ms = row["ms"]
                    row["tflops"] = ms and matmul_flops(pairs, mode) * opts.batch / ms / 1e9
                    row["dense_over"] = (dense_ms / ms) if ms and dense_ms else None
                    if ms and mode == "fwd" and name != ref_name and not opts.no_check:
                        row["max_abs_diff"] = output_diff(fn, impls[ref_name], args)
                    rows.append(row)

    print_table(rows)
    meta = dict(
        env,
        dtype=opts.dtype,
        batch=opts.batch,
        config=PROD,
        selection_variants=variants,
        flash_variants=flash_variants,
        idx_runs=opts.idx_runs,
        idx_file=opts.idx_file,
        idx_layer=opts.idx_layer,
        pallas_skipped=not gpu,
    )
    write_json(opts.json, meta, rows)
    return rows


def print_table(rows):
    width = max([34, *(len(r["impl"]) for r in rows)])  # the column fits the longest variant name
    header = (
        f"{'T':>6} {'branch':<10} {'mode':<7} {'candidate':<{width}} {'ms':>9} {'TFLOP/s':>8} {'dense/x':>8} "
        f"{'max|o-ref|':>10}"
    )
    print()
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['seq']:>6} {r['branch']:<10} {r['mode']:<7} {r['impl']:<{width}} {fmt(r['ms'])} "
            f"{fmt(r.get('tflops'), '{:8.1f}', 8)} {fmt(r.get('dense_over'), '{:7.2f}x', 8)} "
            f"{fmt(r.get('max_abs_diff'), '{:10.2e}', 10)}" + (f"  ({r['note']})" if r.get("note") else "")
        )


if __name__ == "__main__":
    main()
