"""Benchmark NSA decode: tokens read per step, and decode tokens/s against dense attention.

1. Tokens read per decode step by branch at contexts 8k..64k with the production
   NSA hyper-parameters (l=32, d=16, lp=64, n=16, w=512): compressed T_cmp(t),
   selected n*lp (fewer while the current block is partial), window w, against
   dense attention's t + 1, and the paper's Table 4 counts (T/d + n*lp + w).
2. Decode tokens/s of the NSA decode step (nsa_jax.inference.decode_step) and
   of a dense-attention KV-cache decode of the same model size (same
   embedding, projections, MLP and LM head; one K/V per layer attended in
   full), in one run, at the same contexts. Caches are filled with random
   values and every row starts at the context length: step time does not
   depend on the values, and this skips a long prefill.

Usage:
  python -m benchmarks.bench_decode [--contexts 8192,32768] [--d-model 256]
      [--layers 4] [--heads 8] [--kv-heads 2] [--head-dim 32] [--batch 1]
      [--steps 32] [--json out.json]

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

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from nsa_jax.config import ModelConfig, NSAConfig
from nsa_jax.inference import decode_step, init_cache
from nsa_jax.inference.decode import embed_tokens, inference_config, lm_head, mlp_step
from nsa_jax.info import param_shapes
from nsa_jax.kernels.xla import masked_softmax_attend
from nsa_jax.layers import RMSNorm, rope
from nsa_jax.nsa.selection import num_compressed

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
# dense-attention KV-cache decode (the baseline)


def _dense_step(cfg: ModelConfig, params, k_LxBxKxSxDk, v_LxBxKxSxDv, pos_B, tokens_B):
    """One token per row with full causal attention over a K/V cache (k_slc/v_slc weights).

    Cache layout [L, B, K, S, D]: each head's keys are contiguous, so the score and
    value contractions read the cache without a transposed copy.
    """
    dt = jnp.dtype(cfg.dtype)
    B = tokens_B.shape[0]
    D, H, K, Dk, Dv = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.v_head_dim
    S = k_LxBxKxSxDk.shape[3]
    b_B = jnp.arange(B)
    x = embed_tokens(cfg, params, tokens_B)

    def layer(carry, xs):
        x, kc, vc = carry
        p, i = xs
        h = RMSNorm(cfg.norm_eps, dtype=dt).apply({"params": p["attn_norm"]}, x)
        a = p["attn"]

        def proj(name, heads, dim):
            y = nn.Dense(heads * dim, use_bias=False, dtype=dt).apply({"params": a[name]}, h)
            return y.reshape(B, 1, heads, dim)

        def roped(y):
            return jax.vmap(lambda yb, tb: rope(yb[None], tb[None], cfg.rope_theta)[0])(y, pos_B)

        q = roped(proj("q", H, Dk)).reshape(B, K, H // K, Dk)
        kc = kc.at[i, b_B, :, pos_B].set(roped(proj("k_slc", K, Dk))[:, 0])
        vc = vc.at[i, b_B, :, pos_B].set(proj("v_slc", K, Dv)[:, 0])
        s = jnp.einsum("bkgd,bksd->bkgs", q, kc[i], preferred_element_type=jnp.float32) * Dk**-0.5
        vis = (jnp.arange(S)[None, :] <= pos_B[:, None])[:, None, None, :]
        o = masked_softmax_attend(s, vis, vc[i], "bkgs,bksd->bkgd").astype(dt).reshape(B, 1, H * Dv)
        x = x + nn.Dense(D, use_bias=False, dtype=dt).apply({"params": a["o"]}, o)
        return (mlp_step(cfg, p, x), kc, vc), None

    (x, k_LxBxKxSxDk, v_LxBxKxSxDv), _ = jax.lax.scan(
        layer, (x, k_LxBxKxSxDk, v_LxBxKxSxDv), (params["layers"], jnp.arange(cfg.n_layers))
    )
    return lm_head(cfg, params, x), k_LxBxKxSxDk, v_LxBxKxSxDv, pos_B + 1


dense_step = jax.jit(_dense_step, static_argnums=(0,), donate_argnums=(2, 3))


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


def time_decode(cfg: ModelConfig, params, context: int, batch: int, steps: int) -> dict[str, float]:
    """Seconds per step and tokens/s of NSA and dense decode, every row at position `context`."""
    max_len = context + steps + 2
    tokens = jnp.zeros((batch,), jnp.int32)
    out = {}

    cache = _fill(init_cache(cfg, batch, max_len), jax.random.PRNGKey(1))
    cache = cache.replace(pos_B=jnp.full((batch,), context, jnp.int32))
    logits, cache = decode_step(cfg, params, cache, tokens)  # compile
    logits.block_until_ready()
    t0 = time.perf_counter()
    for _ in range(steps):
        logits, cache = decode_step(cfg, params, cache, tokens)
    logits.block_until_ready()
    out["nsa_s"] = (time.perf_counter() - t0) / steps
    del cache

    S = -(-max_len // cfg.nsa.lp) * cfg.nsa.lp
    k = jax.random.normal(jax.random.PRNGKey(2), (cfg.n_layers, batch, cfg.n_kv_heads, S, cfg.head_dim), cfg.dtype)
    v = jax.random.normal(jax.random.PRNGKey(3), (cfg.n_layers, batch, cfg.n_kv_heads, S, cfg.v_head_dim), cfg.dtype)
    pos = jnp.full((batch,), context, jnp.int32)
    logits, k, v, pos = dense_step(cfg, params, k, v, pos, tokens)  # compile
    logits.block_until_ready()
    t0 = time.perf_counter()
    for _ in range(steps):
        logits, k, v, pos = dense_step(cfg, params, k, v, pos, tokens)
    logits.block_until_ready()
    out["dense_s"] = (time.perf_counter() - t0) / steps
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
    )
    if not on_accel:
        print("  CPU run: a small model and contexts chosen to finish in about a minute; these are CPU figures")
    print(f"{'context':>8} {'nsa tok/s':>10} {'dense tok/s':>12} {'nsa ms':>8} {'dense ms':>9} {'speedup':>8}")
    speed = []
    for c in contexts:
        r = time_decode(cfg, params, c, args.batch, args.steps)
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
