"""Training throughput and model-FLOPs utilisation, against this machine's matmul peak.

For each config: tokens/s of the real jitted train step (nsa_jax.step.step),
the model FLOPs per token (6 x matmul parameters, plus the attention FLOPs NSA
actually does: QK and PV over the keys each branch reads, from nsa_jax.info),
and MFU = achieved FLOP/s / peak, where the peak is a large matmul in the
compute dtype timed in the same run:

    python -m benchmarks.bench_train --configs cpu_tiny --steps 10
    python -m benchmarks.bench_train --configs cpu_tiny,a100_pcie --set train.seq_len=256 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from nsa_jax.config import load_config
from nsa_jax.info import keys_per_query, parameter_counts
from nsa_jax.mesh import make_mesh, put_batch
from nsa_jax.step.step import create_state, make_train_step
from nsa_jax.step.strategies import make_plan


def matmul_peak(dtype: str, n: int, iters: int = 20) -> float:
    """FLOP/s of an n x n x n matmul: the fastest of `iters` calls after three untimed ones.

    The fastest, not the median: a peak is the best the card reaches, and the median of a
    few 2 ms calls moved by 25% between two runs on one H200 (523 vs ~650 TFLOP/s at
    n=8192), which moved the MFU by as much with the step time unchanged.
    """
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x, y: x @ y)
    for _ in range(3):
        f(a, a).block_until_ready()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        f(a, a).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * n**3 / float(np.min(times))


def flops_per_token(cfg) -> dict[str, float]:
    """Training FLOPs per token: 3 x forward (forward + backward)."""
    m = cfg.model
    counts = parameter_counts(m)
    # Embedding lookups are not matmuls; every other weight is used once per token.
    matmul_params = counts["total"] - counts["embed"] - counts.get("norms", 0) - counts.get("final_norm", 0)
    keys = keys_per_query(m, cfg.train.seq_len)
    attn_keys = keys["nsa_total"]
    # QK^T (2*Dk) and PV (2*Dv) per key, per query head, per layer, forward.
    attn_fwd = m.n_layers * m.n_heads * attn_keys * 2 * (m.head_dim + m.v_head_dim)
    return {"matmul": 6.0 * matmul_params, "attention": 3.0 * attn_fwd, "keys_per_query": attn_keys}


def bench(name: str, overrides: list[str], steps: int, variant: str = "") -> dict:
    cfg = load_config(name, overrides)
    mesh = make_mesh(cfg)
    plan = make_plan(cfg, mesh)
    state = create_state(plan)
    train_step = make_train_step(plan)
    rng = np.random.default_rng(0)
    A, B, T = cfg.train.accumulate, cfg.train.global_batch, cfg.train.seq_len
    tokens = put_batch(rng.integers(0, cfg.model.vocab_size, (A, B, T + 1), dtype=np.int32), mesh)
    t = time.perf_counter()
    state, metrics = train_step(state, tokens)
    jax.block_until_ready(metrics["loss"])
    first_s = time.perf_counter() - t
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        state, metrics = train_step(state, tokens)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - t)
    step_s = float(np.median(times))
    toks = A * B * T / step_s
    f = flops_per_token(cfg)
    return {
        "config": name,
        "variant": variant,
        "dtype": cfg.model.dtype,
        "params": parameter_counts(cfg.model)["total"],
        "global_batch": B,
        "accumulate": A,
        "devices": len(jax.devices()),
        "tokens_per_step": A * B * T,
        "compile_and_first_step_s": first_s,
        "step_s": step_s,
        "tokens_per_s": toks,
        "flops_per_token": f["matmul"] + f["attention"],
        "attention_share": f["attention"] / (f["matmul"] + f["attention"]),
        "achieved_flops": toks * (f["matmul"] + f["attention"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="cpu_tiny")
    ap.add_argument("--steps", type=int, default=5, help="timed steps after the first")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument(
        "--global-batches",
        default=None,
        help="comma-separated train.global_batch values, one row each per config (default: the config's)",
    )
    ap.add_argument(
        "--variants",
        default="",
        help="';'-separated sets of comma-separated KEY=VALUE overrides, each timed as its own row beside the "
        "config's, e.g. 'logging.aux_stats=false;model.remat=dots'",
    )
    ap.add_argument("--peak-n", type=int, default=2048, help="matmul size for the peak")
    ap.add_argument("--json")
    args = ap.parse_args()

    dev = jax.devices()[0]
    print(f"backend {jax.default_backend()} | {len(jax.devices())} x {dev.device_kind}")
    batches = [None] if not args.global_batches else [int(b) for b in args.global_batches.split(",") if b]
    variants = [""] + [v.strip() for v in args.variants.split(";") if v.strip()]
    rows, failed, seen, peaks = [], [], set(), {}

    def save():  # after every row: a run stopped from outside keeps what finished
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"peaks": peaks, "rows": rows, "failed": failed}, f, indent=2)

    for name in args.configs.split(","):
        for batch, variant in [(b, v) for b in batches for v in variants]:
            extra = [] if batch is None else [f"train.global_batch={batch}"]
            extra += [kv.strip() for kv in variant.split(",") if kv.strip()]
            # A variant that sets its own batch is timed once, not once per --global-batches entry.
            pairs = (kv.partition("=") for kv in [*args.overrides, *extra])
            settings = (name, tuple(sorted({k.strip(): v.strip() for k, _, v in pairs}.items())))
            if settings in seen:
                continue
            seen.add(settings)
            try:
                r = bench(name, [*args.overrides, *extra], args.steps, variant)
            except Exception as e:  # one failing variant must not cost the others' rows and the peak
                traceback.print_exc()
                line = f"{name} batch {batch or 'as configured'} {variant or 'as configured'}: {type(e).__name__}: {e}"
                print(f"  FAILED {line.splitlines()[0]}", flush=True)
                failed.append(line.splitlines()[0])
                save()
                continue
            if r["dtype"] not in peaks:  # measured once per dtype, after the first row (a warm card)
                peaks[r["dtype"]] = matmul_peak(r["dtype"], args.peak_n)
                print(
                    f"  matmul peak ({args.peak_n}^3, fastest of 20): {r['dtype']} "
                    f"{peaks[r['dtype']] / 1e9:.1f} GFLOP/s"
                )
            r["peak_flops"] = peaks[r["dtype"]]
            r["mfu"] = r["achieved_flops"] / r["peak_flops"]
            print(
                f"  {name} batch {r['global_batch']}x{r['accumulate']} {variant or 'as configured'}: "
                f"compile + first step {r['compile_and_first_step_s']:.1f} s, step {1e3 * r['step_s']:.1f} ms, "
                f"{r['tokens_per_s']:,.0f} tok/s, MFU {100 * r['mfu']:.1f}%",
                flush=True,
            )
            rows.append(r)
            save()
    print(f"matmul peak ({args.peak_n}^3): " + ", ".join(f"{dt} {p / 1e9:.1f} GFLOP/s" for dt, p in peaks.items()))
    print(
        f"{'config':<12} {'variant':<24} {'params':>11} {'batch':>9} {'tok/step':>9} {'step s':>8} {'tok/s':>10} "
        f"{'GFLOP/tok':>10} {'attn %':>7} {'GFLOP/s':>9} {'MFU':>7}"
    )
    for r in rows:
        print(
            f"{r['config']:<12} {r['variant'] or '-':<24} {r['params']:>11,} "
            f"{str(r['global_batch']) + 'x' + str(r['accumulate']):>9} "
            f"{r['tokens_per_step']:>9} {r['step_s']:>8.3f} "
            f"{r['tokens_per_s']:>10,.0f} {r['flops_per_token'] / 1e9:>10.4f} {100 * r['attention_share']:>6.1f}% "
            f"{r['achieved_flops'] / 1e9:>9.1f} {100 * r['mfu']:>6.1f}%"
        )
    if failed:
        raise SystemExit(f"error: {len(failed)} of {len(rows) + len(failed)} rows failed: " + "; ".join(failed))


if __name__ == "__main__":
    main()
