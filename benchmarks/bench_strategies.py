"""Data-parallel strategy study: step time, per-device state bytes and collectives of each strategy.

For a config (default `cpu_tiny`) on every visible device (on a CPU host it sets
`--xla_force_host_platform_device_count=2` itself when XLA_FLAGS is unset), each
variant of `parallel.strategy` (nsa_jax/step/strategies.py) builds the real train
step (`nsa_jax.step.step.make_train_step`) and reports

* step time: median (and min, max, process CPU time) of `--steps` timed steps
  after `--warmup` untimed ones, on one fixed random batch;
* bytes per device of params, reduced gradients and optimizer state, from the
  shardings: the addressable shard of each leaf on the first device (params and
  optimizer state of the live state; gradients from the strategy's gradient
  shardings). Before the reduction every strategy also holds a full-size local
  gradient; that is in the compiled temp bytes, not in this column;
* collectives, read from HLO text at two points: `partitioned`, the program right
  after XLA's SPMD partitioner (what the strategy asks for, in the requested dtype,
  one op per gradient leaf), and `compiled`, the final optimised program that runs
  (after XLA combined, decomposed or retyped collectives; on XLA:CPU bf16
  all-reduces are promoted to fp32). For each of all-reduce, reduce-scatter,
  all-gather, all-to-all and collective-permute: the number of ops in the text,
  and the bytes of their results; `executed` counts an op inside a while loop once
  per iteration (XLA's known trip count), i.e. per optimizer step;
* the losses of the timed steps (every strategy computes the same update, so they
  agree up to reduction rounding).

Usage:
  python -m benchmarks.bench_strategies [--config cpu_tiny] [--steps 5] [--json out.json]
      [--strategies dp-bf16,dp-fp32,pmap,gspmd,zero1,fsdp] [--reduce-dtype float32] [--set KEY=VALUE]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

if "XLA_FLAGS" not in os.environ:  # before jax is imported: two devices on a CPU host
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax
import numpy as np

from benchmarks.common import MiB, add_config_args, config_meta, fmt, log, print_header, short_error, write_json
from nsa_jax.config import load_config
from nsa_jax.mesh import make_mesh, put_batch
from nsa_jax.ops.memory import compiled_memory
from nsa_jax.step import strategies
from nsa_jax.step.step import create_state, make_train_step

COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
SHORT = {
    "all-reduce": "AR",
    "reduce-scatter": "RS",
    "all-gather": "AG",
    "all-to-all": "A2A",
    "collective-permute": "CP",
}
DEFAULT_VARIANTS = "dp-bf16,dp-fp32,pmap,gspmd,zero1,fsdp"
DTYPE_BYTES = {
    "pred": 1,
    "s4": 1,
    "u4": 1,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}

# One HLO instruction whose opcode is a collective: `%name = <result shape> <opcode>(`.
# Async pairs are counted once, at their `-done` (whose result is the op's output);
# `-start` results bundle inputs and outputs.
_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.+?)\s+"
    r"(?P<op>all-reduce|reduce-scatter|all-gather|all-to-all|collective-permute)(?P<phase>-start|-done)?\("
)
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s+\(.*\{\s*$")
_CALLEE = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


def _result_bytes(shape: str) -> tuple[int, set[str]]:
    total, dtypes = 0, set()
    for dtype, dims in _ARRAY.findall(shape):
        if dtype not in DTYPE_BYTES:
            continue
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * DTYPE_BYTES[dtype]
        dtypes.add(dtype)
    return total, dtypes


def collectives_in_hlo(text: str) -> dict[str, dict]:
    """{op: {count, bytes, executed_count, executed_bytes, dtypes}} of the collectives in HLO text.

    `bytes` sums the result shapes (a combined op's tuple counted whole); `executed_*`
    weighs each op by how often its computation runs per call of the entry
    computation: the product of the known trip counts of the while loops around it
    (`unknown_trip_count` is set when one of those loops has none; it then counts
    once, as before XLA's loop analysis in the partitioned program).
    """
    ops: list[tuple[str, str, int, set[str]]] = []  # (computation, op, bytes, dtypes)
    calls: dict[str, list[tuple[str, int | None]]] = defaultdict(list)  # callee -> [(caller, factor)]
    entry, current = None, None
    for line in text.splitlines():
        head = _COMPUTATION.match(line)
        if head and not line.startswith(" "):
            current = head.group("name")
            if line.startswith("ENTRY"):
                entry = current
            continue
        if current is None:
            continue
        for kind, callee in _CALLEE.findall(line):
            factor: int | None = 1
            if kind == "body":
                trip = _TRIP.search(line)
                factor = int(trip.group(1)) if trip else None
            calls[callee].append((current, factor))
        for group in _BRANCHES.findall(line):
            for callee in group.split(","):
                calls[callee.strip().lstrip("%")].append((current, 1))
        m = _INSTR.match(line)
        if m and m.group("phase") != "-start":
            nbytes, dtypes = _result_bytes(m.group("shape"))
            ops.append((current, m.group("op"), nbytes, dtypes))

    memo: dict[str, tuple[int, bool]] = {}

    def runs(comp: str, depth: int = 0) -> tuple[int, bool]:
        """(executions per entry call, whether a loop on the way had no known trip count)."""
        if comp == entry or depth > 64:
            return 1, False
        if comp not in memo:
            n, unknown = 0, False
            for caller, factor in calls.get(comp, []):
                n_caller, unknown_caller = runs(caller, depth + 1)
                n += n_caller * (factor or 1)
                unknown |= unknown_caller or factor is None
            memo[comp] = (n or 1, unknown)
        return memo[comp]

    out: dict[str, dict] = {}
    for comp, op, nbytes, dtypes in ops:
        r = out.setdefault(op, {"count": 0, "bytes": 0, "executed_count": 0, "executed_bytes": 0, "dtypes": set()})
        n, unknown = runs(comp)
        r["count"] += 1
        r["bytes"] += nbytes
        r["executed_count"] += n
        r["executed_bytes"] += n * nbytes
        r["dtypes"] |= dtypes
        if unknown:
            r["unknown_trip_count"] = True
    for r in out.values():
        r["dtypes"] = sorted(r["dtypes"])
    return out


def compile_with_partitioned_hlo(lowered) -> tuple[object, str | None]:
    """lowered.compile(), plus the HLO text right after the SPMD partitioner (None if XLA wrote none)."""
    with tempfile.TemporaryDirectory(prefix="nsa_hlo_") as tmp:
        compiled = lowered.compile(compiler_options={"xla_dump_to": tmp, "xla_dump_hlo_pass_re": "spmd-partitioning"})
        found = sorted(Path(tmp).glob("*after_spmd-partitioning*.txt"))
        text = found[-1].read_text() if found else None
    return compiled, text


def parse_variant(name: str, default_dtype: str) -> tuple[str, str]:
    """'dp-bf16' -> ('dp', 'bfloat16'); 'zero1' -> ('zero1', default_dtype)."""
    strategy, _, dt = name.partition("-")
    dtypes = {"bf16": "bfloat16", "fp32": "float32", "": default_dtype}
    if strategy not in strategies.STRATEGIES or dt not in dtypes:
        raise SystemExit(
            f"--strategies: unknown variant {name!r}; use <strategy>[-bf16|-fp32] with strategy one of "
            + ", ".join(strategies.STRATEGIES)
        )
    return strategy, dtypes[dt]


def shard_bytes_on(tree, device) -> int:
    """Bytes of the shards of `tree`'s arrays that live on `device`."""
    return sum(s.data.nbytes for leaf in jax.tree.leaves(tree) for s in leaf.addressable_shards if s.device == device)


def grad_bytes_per_device(plan: strategies.ShardingPlan) -> int:
    params_shapes = plan.state_shapes.params
    return sum(
        int(np.prod(sh.shard_shape(p.shape))) * 4  # reduced gradients are fp32
        for p, sh in zip(jax.tree.leaves(params_shapes), jax.tree.leaves(plan.grads))
    )


def measure(cfg, steps: int, warmup: int) -> dict:
    mesh = make_mesh(cfg)
    plan = strategies.make_plan(cfg, mesh)
    device0 = mesh.devices.flat[0]
    state = create_state(plan)
    row = {
        "params_bytes": shard_bytes_on(state.params, device0),
        "opt_bytes": shard_bytes_on(state.opt_state, device0),
        "grads_bytes": grad_bytes_per_device(plan),
    }
    A, B, T = cfg.train.accumulate, cfg.train.global_batch, cfg.train.seq_len
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (A, B, T + 1), dtype=np.int32)
    batch = put_batch(tokens, mesh)
    t0 = time.perf_counter()
    lowered = make_train_step(plan).lower(state, batch)
    compiled, partitioned = compile_with_partitioned_hlo(lowered)
    row["compile_s"] = time.perf_counter() - t0
    row["mem"] = compiled_memory(compiled)
    row["collectives"] = {
        "partitioned": collectives_in_hlo(partitioned) if partitioned else None,
        "compiled": collectives_in_hlo(compiled.as_text()),
    }
    for _ in range(warmup):
        state, metrics = compiled(state, batch)
    jax.block_until_ready(state)
    wall, cpu, losses = [], [], []
    for _ in range(steps):
        t, c = time.perf_counter(), time.process_time()
        state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics))
        wall.append((time.perf_counter() - t) * 1e3)
        cpu.append((time.process_time() - c) * 1e3)
        losses.append(float(metrics["loss"]))
    row.update(
        step_ms=statistics.median(wall),
        step_min_ms=min(wall),
        step_max_ms=max(wall),
        cpu_ms=statistics.median(cpu),
        losses=losses,
    )
    return row


def _cell(stats: dict | None, op: str, executed: bool = False) -> str:
    if stats is None:
        return f"{'?':>13}"
    r = stats.get(op)
    if not r:
        return f"{'-':>13}"
    n, b = (r["executed_count"], r["executed_bytes"]) if executed else (r["count"], r["bytes"])
    return f"{n:>4}{'*' if r.get('unknown_trip_count') else ' '}{b / MiB:8.3f}"


def print_tables(rows: list[dict]) -> None:
    head = (
        f"{'variant':<9} {'reduce':<6} {'step ms':>9} {'min ms':>8} {'cpu ms':>9} "
        f"{'params MiB':>10} {'grads MiB':>9} {'opt MiB':>8} {'temp MiB':>8}  last loss"
    )
    print()
    print("Per device: step time, state bytes (first device's shards), compiled temp")
    print(head)
    print("-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:<9} {r['dtype']:<6} {r['error']}")
            continue
        mem = r.get("mem") or {}
        temp = mem.get("temp")
        print(
            f"{r['variant']:<9} {r['dtype']:<6} {fmt(r['step_ms'])} {fmt(r['step_min_ms'], '{:8.1f}', 8)} "
            f"{fmt(r['cpu_ms'])} {r['params_bytes'] / MiB:10.3f} {r['grads_bytes'] / MiB:9.3f} "
            f"{r['opt_bytes'] / MiB:8.3f} {fmt(None if temp is None else temp / MiB, '{:8.2f}', 8)}  "
            f"{r['losses'][-1]:.6f}"
        )
    head = f"{'variant':<9} {'HLO':<11} " + " ".join(f"{SHORT[op] + ' n   MiB':>13}" for op in COLLECTIVES)
    print()
    print(
        "Collectives per step: ops and result MiB (partitioned = after the SPMD partitioner; "
        "compiled = what runs; loop bodies counted per iteration, * = in a loop of unknown trip count)"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        if "error" in r:
            continue
        for stage in ("partitioned", "compiled"):
            stats = r["collectives"][stage]
            cells = " ".join(_cell(stats, op, executed=True) for op in COLLECTIVES)
            dtypes = sorted({d for s in (stats or {}).values() for d in s["dtypes"]})
            print(f"{r['variant']:<9} {stage:<11} {cells}  {','.join(dtypes)}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_args(parser, "cpu_tiny")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per strategy (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after compiling")
    parser.add_argument(
        "--strategies", default=DEFAULT_VARIANTS, help="comma list of <strategy>[-bf16|-fp32] (default: %(default)s)"
    )
    parser.add_argument(
        "--reduce-dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="parallel.grad_reduce_dtype of variants without a -bf16/-fp32 suffix",
    )
    opts = parser.parse_args(argv)

    variants = [v.strip() for v in opts.strategies.split(",") if v.strip()]
    parsed = [parse_variant(v, opts.reduce_dtype) for v in variants]
    env = print_header("Data-parallel strategies: step time, per-device state bytes, collectives")
    base = load_config(opts.config, opts.set)
    m, t = base.model, base.train
    print(
        f"config {opts.config}: L={m.n_layers} D={m.d_model} V={m.vocab_size} dtype={m.dtype} | "
        f"T={t.seq_len} global batch {t.global_batch} x accumulate {t.accumulate} | "
        f"{jax.device_count()} device(s) on the data axis | {opts.warmup} warm-up + {opts.steps} timed steps"
    )
    rows = []
    for variant, (strategy, dtype) in zip(variants, parsed):
        cfg = load_config(
            opts.config, [*opts.set, f"parallel.strategy={strategy}", f"parallel.grad_reduce_dtype={dtype}"]
        )
        row = {"variant": variant, "strategy": strategy, "dtype": "bf16" if dtype == "bfloat16" else "fp32"}
        log(f"{variant}: compile and run ...")
        try:
            row.update(measure(cfg, opts.steps, opts.warmup))
        except Exception as e:  # report and go on with the other strategies
            row["error"] = short_error(e)
            log(f"  failed: {row['error']}")
        rows.append(row)
    print_tables(rows)
    meta = dict(env, **config_meta(opts.config, opts.set, t), steps=opts.steps, warmup=opts.warmup)
    write_json(opts.json, meta, rows)


if __name__ == "__main__":
    main()
