"""Benchmark NSA decode: tokens read per step, and decode tokens/s against dense attention.

1. Tokens read per decode step by branch at contexts 8k..64k with the production
   NSA hyper-parameters (l=32, d=16, lp=64, n=16, w=512): compressed T_cmp(t),
   selected n*lp (fewer while the current block is partial), window w, against
   dense attention's t + 1, and the paper's Table 4 counts (T/d + n*lp + w).
2. Decode tokens/s of the NSA decode step (nsa_jax.inference.decode_step, the
   model's own decode mode) and of dense-attention KV-cache decode of the
   same model and params, in one run, at the same contexts. The dense
   baseline is the same decode step with only the window branch and a window
   as long as the cache (w = cache length): every cached token attended in
   full. Caches are filled with random values and every row starts at the
   context length: step time does not depend on the values, and this skips a
   long prefill. `--cache-len` sizes the caches for more tokens than the
   context (a long generation ahead); a decode step reads only the compressed
   tokens that exist (in power-of-two buckets), the dense one the whole cache.

Usage:
  python -m benchmarks.bench_decode [--contexts 8192,32768] [--d-model 256]
      [--layers 4] [--heads 8] [--kv-heads 2] [--head-dim 32] [--batch 1]
      [--steps 32] [--cache-len N] [--json out.json]

On a CPU the defaults are a small model (about 3M parameters) and two
contexts, so the run takes about a minute; pass larger sizes on an accelerator.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from nsa_jax.config import ModelConfig, NSAConfig
from nsa_jax.inference import cache_sizes, decode_step, init_cache
from nsa_jax.inference.decode import inference_config
from nsa_jax.info import param_shapes
from nsa_jax.kernels.xla import num_compressed

PROD_NSA = NSAConfig(l=32, d=16, lp=64, n=16, w=512, attention_impl="xla")
TABLE_CONTEXTS = (8192, 16384, 32768, 65536)
PAPER_COUNTS = {8192: 2048, 16384: 2560, 32768: 3584, 65536: 5632}


def reads_per_step(a: NSAConfig, context: int) -> dict[str, int]:
    """Tokens read to decode the token at position t = context - 1 (it sees `context` tokens)."""
    t = context - 1
    cmp = num_compressed(t + 1, a.l, a.d)
    cur = t // a.lp
    # Selected blocks hold positions <= t only: the current block is cut at t.
    slc = min(a.n, cur + 1) * a.lp - (a.lp - 1 - t % a.lp)
    win = min(a.w, t + 1)
    return {"cmp": cmp, "slc": slc, "win": win, "nsa": cmp + slc + win, "dense": t + 1}


def read_table(a: NSAConfig) -> list[dict]:
    rows = []
    for c in TABLE_CONTEXTS:
        r = reads_per_step(a, c)
        rows.append({"context": c, **r, "paper": c // a.d + a.n * a.lp + a.w, "paper_table4": PAPER_COUNTS[c]})
    return rows


# ---------------------------------------------------------------------------
# timing


def random_params(cfg: ModelConfig, seed: int = 0):
    rng = np.random.default_rng(seed)
    shapes = param_shapes(cfg)
    return jax.tree.map(lambda s: jnp.asarray(0.02 * rng.standard_normal(s.shape, dtype=np.float32)), shapes)


def _fill(tree, key):
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(
        treedef, [jax.random.normal(k, x.shape, x.dtype) if x.dtype.kind == "f" else x for k, x in zip(keys, leaves)]
    )


def dense_config(cfg: ModelConfig, max_len: int) -> ModelConfig:
    """The same model decoding with dense attention: the window branch alone, its window the whole cache."""
    S = cache_sizes(cfg, max_len).S
    return dataclasses.replace(cfg, nsa=dataclasses.replace(cfg.nsa, branches=("win",), w=S))


def _time_steps(cfg: ModelConfig, params, context: int, batch: int, steps: int, max_len: int) -> float:
    """Median seconds per decode step, every row at position `context` of a random cache."""
    tokens = jnp.zeros((batch,), jnp.int32)
    cache = _fill(init_cache(cfg, batch, max_len), jax.random.PRNGKey(1))
    cache = cache.replace(pos_B=jnp.full((batch,), context, jnp.int32))
    logits, cache = decode_step(cfg, params, cache, tokens)  # compile
    logits.block_until_ready()
    # Median of per-step times: robust to other work on a shared machine.
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits, cache = decode_step(cfg, params, cache, tokens)
        logits.block_until_ready()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def time_decode(cfg: ModelConfig, params, context: int, batch: int, steps: int, cache_len: int = 0) -> dict:
    """Seconds per step and tokens/s of NSA and dense decode, every row at position `context`."""
    max_len = max(context + steps + 2, cache_len)
    out = {"cache_len": max_len}
    out["nsa_s"] = _time_steps(cfg, params, context, batch, steps, max_len)
    out["dense_s"] = _time_steps(dense_config(cfg, max_len), params, context, batch, steps, max_len)
    out["nsa_tok_s"] = batch / out["nsa_s"]
    out["dense_tok_s"] = batch / out["dense_s"]
    out["speedup"] = out["dense_s"] / out["nsa_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    on_accel = jax.default_backend() in ("gpu", "cuda", "rocm", "tpu")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default=None, help="comma-separated decode contexts for the speed test")
    p.add_argument("--d-model", type=int, default=768 if on_accel else 256)
    p.add_argument("--layers", type=int, default=12 if on_accel else 4)
    p.add_argument("--heads", type=int, default=12 if on_accel else 8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64 if on_accel else 32)
    p.add_argument("--d-ff", type=int, default=None, help="MLP width (default 8/3 d_model rounded)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--cache-len", type=int, default=0, help="cache length (default: context + steps + 2)")
    p.add_argument("--dtype", default="bfloat16" if on_accel else "float32")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    default_contexts = "8192,16384,32768,65536" if on_accel else "8192,32768"
    contexts = [int(c) for c in (args.contexts or default_contexts).split(",") if c.strip()]

    nsa = PROD_NSA
    rows = read_table(nsa)
    hp = f"l={nsa.l} d={nsa.d} lp={nsa.lp} n={nsa.n} w={nsa.w}"
    print(f"tokens read per decode step (query at t = context - 1), {hp}")
    print(f"{'context':>8} {'cmp':>6} {'slc':>6} {'win':>5} {'nsa':>6} {'paper':>6} {'dense':>7} {'dense/nsa':>10}")
    for r in rows:
        print(
            f"{r['context']:>8} {r['cmp']:>6} {r['slc']:>6} {r['win']:>5} {r['nsa']:>6} {r['paper_table4']:>6} "
            f"{r['dense']:>7} {r['dense'] / r['nsa']:>9.2f}x"
        )
    print("  (cmp counts complete blocks only, T_cmp = floor((T - l)/d) + 1 = T/d - 1 here; the paper uses T/d)")

    d_ff = args.d_ff or -(-(8 * args.d_model // 3) // 64) * 64
    cfg = ModelConfig(
        vocab_size=256,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        v_head_dim=args.head_dim,
        d_ff=d_ff,
        dtype=args.dtype,
        nsa=nsa,
    )
    cfg = inference_config(cfg)
    params = random_params(cfg)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    device = jax.devices()[0].device_kind
    print()
    print(
        f"decode speed on {jax.default_backend()} ({device}, {platform.machine()}): "
        f"d_model={cfg.d_model} layers={cfg.n_layers} heads={cfg.n_heads}/{cfg.n_kv_heads} head_dim={cfg.head_dim} "
        f"d_ff={cfg.d_ff} dtype={cfg.dtype} ({n_params / 1e6:.1f}M params), batch={args.batch}, {args.steps} steps"
        + (f", cache length {args.cache_len}" if args.cache_len else "")
    )
    if not on_accel:
        print("  CPU run: a small model and contexts chosen to finish in about a minute; these are CPU figures")
    print(f"{'context':>8} {'nsa tok/s':>10} {'dense tok/s':>12} {'nsa ms':>8} {'dense ms':>9} {'speedup':>8}")
    speed = []
    for c in contexts:
        r = time_decode(cfg, params, c, args.batch, args.steps, args.cache_len)
        speed.append({"context": c, **r})
        print(
            f"{c:>8} {r['nsa_tok_s']:>10.1f} {r['dense_tok_s']:>12.1f} {1e3 * r['nsa_s']:>8.2f} "
            f"{1e3 * r['dense_s']:>9.2f} {r['speedup']:>7.2f}x",
            flush=True,
        )
    if args.json:
        report = {
            "nsa": dataclasses.asdict(nsa),
            "reads": rows,
            "model": dataclasses.asdict(cfg),
            "backend": jax.default_backend(),
            "device": device,
            "batch": args.batch,
            "steps": args.steps,
            "speed": speed,
        }
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
