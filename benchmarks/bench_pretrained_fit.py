"""Pretrained Llama-family models as NSA on cards that are not here: per-card memory of a train step.

For each model of docs/PRETRAINED.md (its shape as its published config.json gives it), the
NSA model launch.convert makes of it (configs/llama8b_64k.yaml's settings otherwise: remat
full, bf16, one sequence per step, parallel.strategy fsdp) compiled for `--target` at each T
of `--seq-lens` over each C of `--contexts` cards (data 1 x seq C), through
benchmarks.bench_context's aot mode: arguments, temporaries, total per card, whether it fits
jax's share of the card, and the bytes each card sends a step.

With `--loss-chunks 0,4096` each model runs with its loss's logits whole and made 4,096
positions at a time (train.loss_chunk), side by side. With `--largest` it searches, per model,
the longest T whose step fits each C > 1 instead (nsa_jax.tools.aot.seq_len_fit, launch.info's
search: the first of `--seq-lens` and its half, a line through their totals, then bisection to
within 1/16; a handful of compiles per model).

Usage:
  python -m benchmarks.bench_pretrained_fit [--models smollm2-135m,...] [--target a100-80]
      [--contexts 1,2] [--seq-lens 32k,64k] [--loss-chunks 0,4096] [--largest] [--set KEY=VALUE] [--json out.json]
"""

from __future__ import annotations

import argparse
import sys

from benchmarks import bench_context
from benchmarks.common import parse_ints, write_json
from nsa_jax.config import ConfigError, load_config
from nsa_jax.tools import aot

# (d_model, n_layers, n_heads, n_kv_heads, head_dim, d_ff, vocab, tied, rope_theta, qkv_bias) of each
# model's config.json; Llama 3.2 adds rope_scaling llama3 (factor 32, original 8192).
SHAPES = {
    "smollm2-135m": (576, 30, 9, 3, 64, 1536, 49152, True, 100000.0, False),
    "smollm2-360m": (960, 32, 15, 5, 64, 2560, 49152, True, 100000.0, False),
    "smollm2-1.7b": (2048, 24, 32, 32, 64, 8192, 49152, True, 130000.0, False),
    "qwen2.5-0.5b": (896, 24, 14, 2, 64, 4864, 151936, True, 1000000.0, True),
    "qwen2.5-1.5b": (1536, 28, 12, 2, 128, 8960, 151936, True, 1000000.0, True),
    "llama3.2-1b": (2048, 16, 32, 8, 64, 8192, 128256, True, 500000.0, False),
    "llama3.2-3b": (3072, 28, 24, 8, 128, 8192, 128256, True, 500000.0, False),
}
LLAMA32_ROPE = "model.rope_scaling={kind: llama3, factor: 32.0, low_freq_factor: 1.0, high_freq_factor: 4.0}"


def model_sets(name: str) -> list[str]:
    d, L, H, K, Dh, F, V, tied, theta, bias = SHAPES[name]
    sets = [f"model.d_model={d}", f"model.n_layers={L}", f"model.n_heads={H}", f"model.n_kv_heads={K}"]
    sets += [f"model.head_dim={Dh}", f"model.v_head_dim={Dh}", f"model.d_ff={F}", f"model.vocab_size={V}"]
    sets += [
        f"model.tie_embeddings={str(tied).lower()}",
        f"model.rope_theta={theta}",
        f"model.qkv_bias={str(bias).lower()}",
    ]
    sets.append(LLAMA32_ROPE if name.startswith("llama3.2") else "model.rope_scaling={kind: none}")
    return sets


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_pretrained_fit", description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--target", action="append", default=None, help="a100-40, a100-80, h100 (repeatable)")
    p.add_argument("--contexts", default="2", help="C values: cards each sequence is split over")
    p.add_argument("--seq-lens", default="32k,64k")
    p.add_argument("--loss-chunks", default="0", help="train.loss_chunk values, side by side (0: whole logits)")
    p.add_argument("--largest", action="store_true", help="search each model's longest T per C > 1 from --seq-lens")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", default=None)
    opts = p.parse_args(argv)
    models = [m.strip() for m in opts.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in SHAPES]
    try:
        if unknown:
            raise ValueError(f"unknown --models {', '.join(unknown)}; known: {', '.join(SHAPES)}")
        opts.contexts, opts.seq_lens, opts.layer_seq_len = parse_ints(opts.contexts), parse_ints(opts.seq_lens), None
        opts.target = opts.target or ["a100-80"]
        chunks = parse_ints(opts.loss_chunks)
        cfgs = {
            (m, c): load_config("llama8b_64k", [*model_sets(m), f"train.loss_chunk={c}", *opts.overrides])
            for m in models
            for c in chunks
        }
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    aot.compile_on_host()
    rows = []
    for (name, chunk), cfg in cfgs.items():
        print(f"-- {name}, train.loss_chunk={chunk}", flush=True)
        run = largest_rows if opts.largest else bench_context.run_aot
        rows += [{**row, "model": name, "loss_chunk": chunk} for row in run(opts, cfg)]
    write_json(opts.json, {"models": models, "overrides": opts.overrides, "mode": "aot"}, rows)
    return 0


def largest_rows(opts, cfg) -> list[dict]:
    """The longest T (from the first of --seq-lens) whose step fits each target over each C > 1."""
    rows = []
    for target in opts.target:
        for C in [c for c in opts.contexts if c > 1]:
            one = bench_context._one_sequence(cfg, C, opts.seq_lens[0])
            r = aot.fit_check(one, target, C, log=lambda line: print(line, flush=True))
            T, m = r["largest_seq_len"], r["largest"]
            rows.append(
                {
                    "mode": "largest",
                    "target": target,
                    "context": C,
                    "seq_len": T,
                    "memory": m,
                    "probes": r["seq_probes"],
                    "usable_bytes": r["usable_bytes"],
                }
            )
            total = f"{m['total'] / aot.MiB:,.0f} MiB per card" if m else "nothing fits"
            print(f"{target:<8} C={C}: largest T {T:,} ({total}; probes {len(r['seq_probes'])})", flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
