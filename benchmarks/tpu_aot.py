"""The selection branch compiled for TPU slices on this host (libtpu, the `tpu` extra): kernels against XLA.

`python -m benchmarks.tpu_aot [--targets v5e-4,v6e-4] [--lengths 8192,32768]` compiles, for one chip of
each slice, the selection attention's forward and forward+backward of the a100_pcie layer (12 heads over
2 KV heads, head dim 64, lp = 64, n = 16, bf16, one row) twice, through the Pallas TPU kernels
(kernels/selection_tpu.py) and through the XLA gather path (one query chunk: XLA's cost analysis counts a
loop's body once), and prints from XLA's compiled cost analysis
(the kernels' bytes are their own DMA estimates) the bytes moved, the temporaries and the compile time,
side by side, with their ratio. Nothing runs on a TPU: these are XLA's plan, not timings.

`--branches` instead compiles the window branch (w = 512), dense causal attention and the compressed branch
(l = 32, d = 16) at the same shapes through splash attention (kernels/splash_tpu.py) and through XLA's query
chunks, and prints the tiles splash visits of all (its masks skip the rest), its forward's DMA by that count
(splash gives XLA no estimate: its cost analysis counts the operands once), XLA's forward bytes (one chunk's
body times the trips) and both paths' temporaries for forward + backward.

`--step CONFIG [--set key=value ...]` instead compiles CONFIG's whole train step (its strategy, its
parallel.context) once for each slice of --targets, over all of its chips, and prints the per-chip memory,
the bytes of XLA's cost analysis (a scanned layer's body and each loop's counted once), the collectives'
payload per chip (xla_dump.hlo_collectives: loops by their trip counts), the compile time and the Mosaic
kernels in it: one compile, where `launch.info --target` searches.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from launch.cli import add_overrides  # noqa: E402
from nsa_jax.config import ConfigError, load_config  # noqa: E402
from nsa_jax.kernels import splash_tpu, xla  # noqa: E402
from nsa_jax.kernels.selection_tpu import selection_attention_tpu  # noqa: E402
from nsa_jax.tools import aot, xla_dump  # noqa: E402

G, K, D, LP, N = 6, 2, 64, 64, 16
GiB = 2**30
W, L_CMP, D_CMP, CHUNK = 512, 32, 16, 512


def _on_chip(target: str):
    """shape, dtype -> an abstract array on one chip of `target`."""
    sharding = NamedSharding(Mesh(np.array(aot.target_devices(target, 1)), ("d",)), P())
    return lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def measure(target: str, T: int, attend, backward: bool) -> dict:
    sds = _on_chip(target)
    q, kv, idx = sds((1, T, G * K, D), jnp.bfloat16), sds((1, T, K, D), jnp.bfloat16), sds((1, T, K, N), jnp.int32)
    fn = attend
    if backward:
        fn = jax.grad(lambda q, k, v, i: attend(q, k, v, i).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(q, kv, kv, idx).compile()
    return {
        "bytes": compiled.cost_analysis()["bytes accessed"],
        "temp": compiled.memory_analysis().temp_size_in_bytes,
        "seconds": time.perf_counter() - t0,
    }


def _compile(target: str, fn, q_len: int, kv_len: int, backward: bool):
    sds = _on_chip(target)
    q, kv = sds((1, q_len, G * K, D), jnp.bfloat16), sds((1, kv_len, K, D), jnp.bfloat16)
    if backward:
        fn = jax.grad(lambda q, k, v, f=fn: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    return jax.jit(fn).lower(q, kv, kv).compile()


def branch_lines(target: str, T: int) -> list[str]:
    """Splash against XLA's query chunks for the window, dense and compressed attention at length T."""
    tc = (T - L_CMP) // D_CMP + 1
    cases = {  # name: (splash fn, xla fn over one chunk of CHUNK queries at the end, keys, mask kind)
        "window": (
            lambda q, k, v: splash_tpu.window_attention_splash(q, k, v, W),
            lambda q, k, v: xla.window_attention_xla(q, k, v, W, query_chunk=CHUNK, q_offset=T - CHUNK),
            T, ("local", W),
        ),
        "causal": (
            lambda q, k, v: splash_tpu.window_attention_splash(q, k, v, T),
            lambda q, k, v: xla.window_attention_xla(q, k, v, T, query_chunk=CHUNK, q_offset=T - CHUNK),
            T, ("causal",),
        ),
        "compressed": (
            lambda q, k, v: splash_tpu.compressed_attention_splash(q, k, v, l=L_CMP, d=D_CMP),
            lambda q, k, v: xla.compressed_attention_xla(
                q, k, v, l=L_CMP, d=D_CMP, lp=LP, scale=D**-0.5, query_chunk=CHUNK, q_offset=T - CHUNK, pool=None)[0],
            tc, ("compressed", L_CMP, D_CMP),
        ),
    }  # fmt: skip
    out = []
    for name, (splash_fn, xla_fn, keys, kind) in cases.items():
        visited, total, tile = splash_tpu.tiles_visited(kind, T, keys)
        # Forward DMA: q and o once, and each visited tile's keys and values once per query head.
        dma = 2 * (2 * T * G * K * D + G * K * visited * tile * 2 * D)
        xla_fwd = _compile(target, xla_fn, CHUNK, keys, False).cost_analysis()["bytes accessed"] * (T // CHUNK)
        temp = [
            _compile(target, fn, T if fn is splash_fn else CHUNK, keys, True).memory_analysis().temp_size_in_bytes
            for fn in (splash_fn, xla_fn)
        ]
        out.append(
            f"{target:8s} {T:<7d} {name:10s} {visited:>6d}/{total:<6d} {dma / GiB:10.3f} {xla_fwd / GiB:9.3f} "
            f"{xla_fwd / dma:5.1f}x {temp[0] / 2**20:10.0f} {temp[1] / 2**20:13.0f}"
        )
    return out


def step_line(cfg, target: str) -> str:
    """One compile of `cfg`'s train step over every chip of `target`: per-chip memory, seconds, kernels."""
    t = aot.get_target(target)
    head = (
        f"{target}: {t.chips} chips, strategy {cfg.parallel.strategy}, context {cfg.parallel.context}, "
        f"T={cfg.train.seq_len}, global batch {cfg.train.global_batch}: "
    )
    t0 = time.perf_counter()
    try:
        c = aot.compile_train_step(cfg, target, t.chips)
    except jax.errors.JaxRuntimeError as e:
        if not aot.HBM_REFUSAL.search(str(e)):
            raise
        took = time.perf_counter() - t0
        return f"{head}does NOT fit: libtpu refused it ({str(e).splitlines()[0][-110:]}); {took:.0f} s"
    m = c.memory
    text = c.executable.as_text()
    kernels = text.count("tpu_custom_call")
    moved = c.executable.cost_analysis().get("bytes accessed", 0.0)  # a loop's body counted once
    collectives = ", ".join(
        f"{kind} {row['payload_bytes'] / 2**20:.1f} MiB ({row['count']}x)"
        for kind, row in sorted(xla_dump.hlo_collectives(text).items())
    )
    return (
        f"{head}per chip {m['total'] / GiB:.2f} GiB "
        f"(arguments {m['argument'] / GiB:.2f}, temporaries {m['temp'] / GiB:.2f}) of {t.usable_bytes() / GiB:.0f} "
        f"-> {'fits' if m['total'] <= t.usable_bytes() else 'does NOT fit'}; {kernels} Mosaic calls; "
        f"{moved / GiB:.2f} GiB in the cost analysis; collectives per chip and step: {collectives or 'none'}; "
        f"compiled in {c.lower_s + c.compile_s:.0f} s"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tpu_aot", description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="v5e-4,v6e-4", help=f"TPU slices, of {', '.join(aot.TPU_TARGETS)}")
    parser.add_argument("--lengths", default="8192,32768", help="sequence lengths, comma-separated")
    parser.add_argument("--step", default=None, help="a config (name, YAML or model folder): compile its train step")
    parser.add_argument("--branches", action="store_true", help="splash attention against XLA for window, dense, cmp")
    add_overrides(parser)
    args = parser.parse_args(argv)
    try:
        targets = [aot.get_target(t).name for t in args.targets.split(",")]
        lengths = [int(x) for x in args.lengths.split(",")]
        missing = aot.plugin_missing(targets[0])
        if missing:
            raise aot.PluginMissing(missing)
        if args.step is not None:
            folder = os.path.join(args.step, "config.yaml")
            saved = os.path.isfile(folder)
            cfg = load_config(folder if saved else args.step, args.overrides, saved=saved)
            for target in targets:
                print(step_line(cfg, target), flush=True)
            return 0
    except (ValueError, aot.PluginMissing, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.branches:
        print("target   T       attention  tiles visited  splash fwd GiB  xla fwd GiB  ratio  splash temp MiB  "
              "xla chunk temp MiB")  # fmt: skip
        for target in targets:
            for T in lengths:
                print("\n".join(branch_lines(target, T)), flush=True)
        return 0
    kernels = lambda q, k, v, i: selection_attention_tpu(q, k, v, i, LP)  # noqa: E731
    print("target   T       pass      kernels GiB  xla GiB  ratio  kernels temp MiB  xla temp MiB")
    for target in targets:
        for T in lengths:
            for backward in (False, True):
                # The XLA path in one query chunk: XLA's cost analysis counts a loop's body once, not per trip.
                gather = lambda q, k, v, i, T=T: xla.selection_attention_xla(q, k, v, i, LP, query_chunk=T)  # noqa: E731
                a = measure(target, T, kernels, backward)
                try:
                    b = measure(target, T, gather, backward)
                except jax.errors.JaxRuntimeError as e:  # the compile's own refusal (HBM), in one line
                    b = {"error": str(e).splitlines()[0][:160]}
                head = f"{target:8s} {T:<7d} {'fwd+bwd' if backward else 'fwd':8s} {a['bytes'] / GiB:11.2f} "
                if "error" in b:
                    print(f"{head}{'-':>8s} {'-':>6s} {a['temp'] / 2**20:16.0f}  xla: {b['error']}", flush=True)
                    continue
                print(
                    f"{head}{b['bytes'] / GiB:8.2f} {b['bytes'] / a['bytes']:5.1f}x {a['temp'] / 2**20:16.0f} "
                    f"{b['temp'] / 2**20:13.0f}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
