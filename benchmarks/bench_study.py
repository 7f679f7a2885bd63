"""The strategy study's table (seed 004) on cards that are not here: each strategy's step, compiled.

The study fine-tunes SmolLM2-360M-Instruct (dense) at a global batch of 8 on 2 x L4 24GB; this
compiles the same step (its published shape, random weights: only memory and traffic matter; bf16;
`--seq-len` tokens a row, default 512) under every `parallel.strategy` for 2 cards of each
`--targets` on this CPU host (nsa_jax/tools/aot.py, the `cuda12` extra), and prints per card:
arguments, temporaries and the total against jax's share of the card (XLA_PYTHON_CLIENT_MEM_FRACTION,
0.75: whether it fits), and the collectives of one optimizer step from the compiled program (ops and
the bytes of their results, a loop's counted per iteration; benchmarks.bench_strategies'
reading). The batch is plain tokens: a fine-tune's answer weights (data.dataset=reviews) add one
[B, T] fp32 input and change nothing else.

Usage:
  python -m benchmarks.bench_study [--targets l4,a100-80] [--model smollm2-360m] [--seq-len 512]
      [--global-batch 8] [--strategies dp,dp+overlap,pmap,gspmd,zero1,fsdp] [--set KEY=VALUE] [--json out.json]
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.bench_pretrained_fit import SHAPES, model_sets
from benchmarks.bench_strategies import SHORT, collectives_in_hlo
from benchmarks.common import write_json
from nsa_jax.config import ConfigError, load_config
from nsa_jax.tools import aot

STRATEGIES = "dp,dp+overlap,pmap,gspmd,zero1,fsdp"


def strategy_sets(name: str) -> list[str]:
    """`dp+overlap` -> dp with parallel.overlap_reduce; else parallel.strategy=NAME."""
    strategy, _, overlap = name.partition("+")
    if strategy not in ("dp", "pmap", "gspmd", "zero1", "fsdp") or overlap not in ("", "overlap"):
        raise ValueError(f"unknown strategy {name!r}; choose from {STRATEGIES}")
    return [f"parallel.strategy={strategy}", f"parallel.overlap_reduce={str(bool(overlap)).lower()}"]


def study_config(model: str, seq_len: int, batch: int, strategy: str, overrides: list[str]):
    """The study's step: `model` dense in bf16, `batch` rows of `seq_len` a step, bf16 gradient reduction."""
    sets = [*model_sets(model), "model.attention=dense", "model.dtype=bfloat16", "parallel.grad_reduce_dtype=bfloat16"]
    sets += [f"train.seq_len={seq_len}", f"train.global_batch={batch}", "train.accumulate=1"]
    return load_config("a100_pcie", [*sets, *strategy_sets(strategy), *overrides])


def measure(cfg, target: str, n_devices: int) -> dict:
    compiled = aot.compile_train_step(cfg, target, n_devices)
    coll = collectives_in_hlo(compiled.executable.as_text())
    usable = aot.get_target(target).usable_bytes()
    return {
        "memory": compiled.memory,
        "usable_bytes": usable,
        "fits": compiled.memory["total"] <= usable,
        "collectives": coll,
        "compile_s": compiled.lower_s + compiled.compile_s,
    }


def row_text(target: str, strategy: str, r: dict) -> str:
    m, mib = r["memory"], aot.MiB
    coll = r["collectives"].items()
    ops = [f"{SHORT[op]} {c['executed_count']} ops, {c['executed_bytes'] / mib:,.1f} MiB" for op, c in coll]
    ops = ", ".join(ops) if ops else "none"
    verdict = "fits" if r["fits"] else "DOES NOT FIT"
    return (
        f"{target:<8} {strategy:<11} arguments {m['argument'] / mib:>8,.0f}  temporaries {m['temp'] / mib:>8,.0f}  "
        f"total {m['total'] / mib:>8,.0f} MiB of {r['usable_bytes'] / mib:,.0f} ({verdict}) | {ops}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_study", description=__doc__.splitlines()[0])
    p.add_argument("--targets", default="l4,a100-80", help=f"cards, of {', '.join(aot.TARGETS)}")
    p.add_argument("--devices", type=int, default=2, help="cards (default 2, the study's)")
    p.add_argument("--model", default="smollm2-360m", help=f"one of {', '.join(SHAPES)}")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--strategies", default=STRATEGIES)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", default=None)
    opts = p.parse_args(argv)
    targets = [t.strip() for t in opts.targets.split(",") if t.strip()]
    names = [s.strip() for s in opts.strategies.split(",") if s.strip()]
    try:
        if opts.model not in SHAPES:
            raise ValueError(f"unknown --model {opts.model}; known: {', '.join(SHAPES)}")
        for t in targets:
            aot.get_target(t)
        cfgs = {s: study_config(opts.model, opts.seq_len, opts.global_batch, s, opts.overrides) for s in names}
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    aot.compile_on_host()
    print(f"{opts.model} dense, bf16, {opts.global_batch} rows of {opts.seq_len} a step on {opts.devices} cards")
    rows = []
    for target in targets:
        for name, cfg in cfgs.items():
            r = measure(cfg, target, opts.devices)
            rows.append({"target": target, "strategy": name, **r})
            print(row_text(target, name, r), flush=True)
    meta = {"model": opts.model, "seq_len": opts.seq_len, "global_batch": opts.global_batch, "devices": opts.devices}
    write_json(opts.json, {**meta, "overrides": opts.overrides}, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
