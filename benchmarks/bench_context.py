"""Context parallelism (parallel.context; nsa_jax/nsa/context.py): memory and wire per device against T and C.

Two modes:

* `aot` (compiled for cards that are not here: jax's CUDA plugin, no GPU): for each
  `--target`, each C of `--contexts` and each T of `--seq-lens`, the train step of
  `--config` with one sequence per step split over C cards (data 1 x seq C): per-device
  memory (temporaries, total, whether it fits jax's share of the card) and, per kind of
  collective, the launches, payload and bytes each device sends in one step
  (xla_dump.collective_traffic; ring algorithms' counts). With `--layer-seq-len T`, also one
  NSA layer's forward alone at T over each C > 1: what its K/V gathers move, beside the
  layer's own K/V bytes (three branches' keys and values of T tokens).
* `cpu`: the train step timed on this host's CPU devices for each C of `--contexts` at
  one global T (`--seq-len`), C host devices each (data 1 x seq C). The host's devices
  share its cores: the ratio shows the overheads of the split (collectives, padding,
  the per-chunk calls), not a speed-up; GPU step times need GPUs (one per C).

Usage:
  python -m benchmarks.bench_context aot --target a100-80 --target h100 [--config a100_pcie_256k]
      [--contexts 1,2,4,8] [--seq-lens 64k,256k] [--layer-seq-len 256k] [--set KEY=VALUE] [--json out.json]
      (--set parallel.strategy=zero1: the Adam moments split over the C cards)
  python -m benchmarks.bench_context cpu [--config cpu_tiny] [--contexts 1,2,4] [--seq-len 1024]
      [--steps 5] [--json out.json]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import jax
import numpy as np

from benchmarks.common import fmt_mib, log, parse_ints, short_error, write_json
from launch.cli import Parser, UsageError
from nsa_jax import config
from nsa_jax.config import ConfigError, load_config
from nsa_jax.mesh import make_mesh
from nsa_jax.step.step import create_state, make_train_step
from nsa_jax.step.strategies import make_plan
from nsa_jax.tools import aot, xla_dump


def _branch_kv_bytes(cfg, T: int) -> int:
    """Keys and values of the three branches for T tokens, in the model dtype."""
    m = cfg.model
    item = 2 if m.dtype == "bfloat16" else 4
    return 3 * T * m.n_kv_heads * (m.head_dim + m.v_head_dim) * item


def _one_sequence(cfg, C: int, T: int):
    """cfg with one sequence of T per step over C cards (data 1 x seq C), under its strategy if that
    runs with context parallelism (dp, zero1), else dp."""
    sets = [f"train.seq_len={T}", "train.global_batch=1", "train.accumulate=1", f"parallel.context={C}"]
    strategy = cfg.parallel.strategy if cfg.parallel.strategy in config.CONTEXT_STRATEGIES else "dp"
    return config.replace(cfg, sets + ["parallel.num_devices=0", f"parallel.strategy={strategy}"])


def run_aot(opts, cfg) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as dump_root:
        for target in opts.target:
            usable = aot.get_target(target).usable_bytes()
            for T in opts.seq_lens:
                for C in opts.contexts:
                    row = {"mode": "step", "target": target, "seq_len": T, "context": C}
                    t0 = time.perf_counter()
                    dump = f"{dump_root}/{target}-{T}-{C}"
                    try:
                        with aot.heartbeat(log, f"{target}: step, T={T:,} over {C} card(s)"):
                            c = aot.compile_train_step(_one_sequence(cfg, C, T), target, C, dump)
                        row.update(memory=c.memory, fits=c.memory["total"] <= usable, usable_bytes=usable)
                        row["collectives"] = xla_dump.collective_traffic(dump)
                    except (aot.PluginMissing, KeyboardInterrupt):
                        raise
                    except Exception as e:  # a length this C cannot split, a kernel over a limit: reported
                        row["error"] = short_error(e)
                    row["compile_s"] = time.perf_counter() - t0
                    rows.append(row)
                    print_step_row(row)
            if opts.layer_seq_len:
                T = opts.layer_seq_len
                for C in [c for c in opts.contexts if c > 1]:
                    dump = f"{dump_root}/{target}-layer-{T}-{C}"
                    row = {"mode": "layer_forward", "target": target, "seq_len": T, "context": C}
                    row["layer_kv_bytes"] = _branch_kv_bytes(cfg, T)
                    with aot.heartbeat(log, f"{target}: one layer's forward, T={T:,} over {C} cards"):
                        c = aot.compile_context_layer(cfg, target, T, C, dump_dir=dump)
                    row.update(memory=c.memory, collectives=xla_dump.collective_traffic(dump))
                    rows.append(row)
                    print_layer_row(row)
    return rows


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"


def print_step_row(r: dict) -> None:
    head = f"{r['target']:<8} T={r['seq_len']:>9,} C={r['context']}"
    if "error" in r:
        print(f"{head}: error: {r['error']}", flush=True)
        return
    m = r["memory"]
    wire = ", ".join(
        f"{k} x{v['count']} {_gib(v['sent_bytes'])} sent (largest {fmt_mib(v['largest'], 0).strip()} MiB)"
        for k, v in sorted(r["collectives"].items())
    )
    print(
        f"{head}: arguments {fmt_mib(m['argument'], 0).strip()} MiB, temporaries {fmt_mib(m['temp'], 0).strip()} MiB, "
        f"total {fmt_mib(m['total'], 0).strip()} MiB "
        f"per card ({'fits' if r['fits'] else 'does NOT fit'}); per step {wire or 'no collectives'}",
        flush=True,
    )


def print_layer_row(r: dict) -> None:
    gathers = r["collectives"].get("all-gather", {"payload_bytes": 0, "sent_bytes": 0, "count": 0})
    print(
        f"{r['target']:<8} one layer's forward at T={r['seq_len']:,} over {r['context']} cards: all-gathers "
        f"x{gathers['count']}, payload {_gib(gathers['payload_bytes'])} per card "
        f"({gathers['payload_bytes'] / r['layer_kv_bytes']:.2f}x the layer's K/V of {_gib(r['layer_kv_bytes'])}), "
        f"{_gib(gathers['sent_bytes'])} sent per card",
        flush=True,
    )


def run_cpu(opts, cfg) -> list[dict]:
    rows = []
    T = opts.seq_len
    for C in opts.contexts:
        c = _one_sequence(cfg, C, T)
        plan = make_plan(c, make_mesh(c, jax.devices()[:C]))
        state = create_state(plan)
        step = make_train_step(plan)
        tokens = np.random.default_rng(0).integers(0, c.model.vocab_size, (1, 1, T + 1)).astype(np.int32)
        batch = jax.device_put(tokens, plan.batch)
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        compile_s = time.perf_counter() - t0
        times = []
        for _ in range(opts.steps):
            t0 = time.perf_counter()
            state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - t0)
        ms = 1e3 * float(np.median(times))
        row = {"mode": "cpu", "seq_len": T, "context": C, "step_ms": ms, "tok_s": T / ms * 1e3, "first_s": compile_s}
        rows.append(row)
        base = rows[0]["step_ms"]
        print(
            f"cpu T={T:,} C={C}: {ms:,.0f} ms a step ({T / ms * 1e3:,.0f} tok/s; {ms / base:.2f}x "
            f"C={rows[0]['context']}'s), first step with compile {compile_s:.0f} s",
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m benchmarks.bench_context", description=__doc__.splitlines()[0], in_process=True)
    p.add_argument("mode", choices=("aot", "cpu"))
    p.add_argument("--config", default=None, help="config name (aot: a100_pcie_256k; cpu: cpu_tiny)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--target", action="append", default=None, help="aot: a100-40, a100-80, h100 (repeatable)")
    p.add_argument("--contexts", default=None, help="C values (aot: 1,2,4,8; cpu: 1,2,4)")
    p.add_argument("--seq-lens", default="64k,256k", help="aot: global T values")
    p.add_argument("--layer-seq-len", default=None, help="aot: T of the one-layer forward (e.g. 256k)")
    p.add_argument("--seq-len", type=int, default=1024, help="cpu: global T")
    p.add_argument("--steps", type=int, default=5, help="cpu: timed steps per C")
    p.add_argument("--json", default=None)
    try:
        opts = p.parse_args(argv)
        aot_mode = opts.mode == "aot"
        opts.contexts = parse_ints(opts.contexts or ("1,2,4,8" if aot_mode else "1,2,4"))
        opts.seq_lens = parse_ints(opts.seq_lens)
        opts.layer_seq_len = parse_ints(opts.layer_seq_len)[0] if opts.layer_seq_len else None
        opts.target = opts.target or ["a100-80"]
        cfg = load_config(opts.config or ("a100_pcie_256k" if aot_mode else "cpu_tiny"), opts.overrides)
    except (UsageError, ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if aot_mode:
        aot.compile_on_host()
        rows = run_aot(opts, cfg)
    else:
        # One host device per sequence part, set before jax starts.
        flag = f"--xla_force_host_platform_device_count={max(opts.contexts)}"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
        aot.compile_on_host()  # the host's CPU devices, whatever plugins are installed
        rows = run_cpu(opts, cfg)
    write_json(opts.json, {"config": opts.config, "overrides": opts.overrides, "mode": opts.mode}, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
