"""Helpers shared by the benchmark scripts: timing, compiled memory, environment, output.

Conventions (the same as bench_kernels.py): a run prints one header line with the
backend and device kind, times every function after `warmup` untimed calls and
reports the median of `iters` timed calls in milliseconds, and writes
`{"meta": ..., "rows": [...]}` when given `--json PATH`.

Timing goes through an AOT-compiled executable (`compile_fn`), so one
compilation serves both the memory figures (`memory_analysis()`) and the timed
calls, and compile time is measured apart from run time.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax

MiB = 1024 * 1024


def on_gpu() -> bool:
    return jax.default_backend() in ("gpu", "cuda", "rocm")


def environment() -> dict[str, Any]:
    """What the figures were measured on, for the JSON `meta` block and the header."""
    device = jax.devices()[0]
    return {
        "backend": jax.default_backend(),
        "device": device.device_kind,
        "n_devices": jax.device_count(),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def print_header(title: str) -> dict[str, Any]:
    """Prints the title and the backend / device line; returns `environment()`."""
    env = environment()
    print(title)
    print(
        f"backend: {env['backend']}  device: {env['device']} (x{env['n_devices']})  "
        f"jax {env['jax']}  python {env['python']}  host cpus: {env['cpu_count']}"
    )
    return env


def add_config_args(parser, default: str = "cpu_tiny", *, dest: str = "set", json: bool = True) -> None:
    """Every benchmark's config flags: --config NAME, repeatable --set KEY=VALUE (into `dest`),
    and with `json` --json PATH (write {meta, rows})."""
    parser.add_argument("--config", default=default, help="config name or YAML path")
    parser.add_argument(
        "--set",
        dest=dest,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override, e.g. --set train.global_batch=1 (repeatable)",
    )
    if json:
        parser.add_argument("--json", default=None, help="write {meta, rows} to this JSON file")


def print_table_header(header: str) -> None:
    """A blank line, the header and a rule under it."""
    print()
    print(header)
    print("-" * len(header))


def parse_ints(text: str) -> list[int]:
    """'2048,4096' -> [2048, 4096]; also accepts 2k / 64k."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if part:
            digits = part[:-1] if part.endswith("k") else part
            if not digits.isdigit():
                raise ValueError(f"{part!r} is not a whole number (such as 2048 or 64k)")
            out.append(int(digits) * 1024 if part.endswith("k") else int(digits))
    return out


def short_error(e: BaseException) -> str:
    """One line naming an exception (out of memory, unsupported size, ...)."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first[:160]}"


def compile_fn(fn: Callable, *args, **jit_kwargs) -> tuple[Any, float, float]:
    """jit(fn).lower(*args).compile(): (executable, lower seconds, compile seconds).

    `args` may be arrays or `jax.ShapeDtypeStruct`s: nothing is allocated.
    """
    t0 = time.perf_counter()
    lowered = jax.jit(fn, **jit_kwargs).lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    return compiled, t1 - t0, t2 - t1


def available_memory_bytes() -> int | None:
    """Free memory of the device the benchmarks run on (GPU limit, or host MemAvailable)."""
    stats = None
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # not every backend implements memory_stats
        pass
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def time_compiled(
    compiled, args: Sequence, warmup: int = 1, iters: int = 5, max_seconds: float | None = None
) -> dict[str, float]:
    """Median / min / max wall milliseconds of `compiled(*args)` after `warmup` calls.

    `max_seconds` bounds the time spent on one program, so slow points (long T on
    a CPU) do not dominate a run: warm-up stops early once one call has taken
    half of it, and timed calls stop once their sum exceeds it, after at least
    one (`n` says how many were timed). `cpu_ms` is this process's CPU time per
    call (all threads): on a shared host it is less inflated by other jobs than
    wall time, but it counts spinning threads and means little on an accelerator.
    """
    for _ in range(warmup):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        if max_seconds is not None and time.perf_counter() - start > max_seconds / 2:
            break
    wall, cpu = [], []
    while len(wall) < max(iters, 1):
        start, start_cpu = time.perf_counter(), time.process_time()
        jax.block_until_ready(compiled(*args))
        wall.append((time.perf_counter() - start) * 1e3)
        cpu.append((time.process_time() - start_cpu) * 1e3)
        if max_seconds is not None and sum(wall) > max_seconds * 1e3:
            break
    return {
        "median_ms": statistics.median(wall),
        "min_ms": min(wall),
        "max_ms": max(wall),
        "cpu_ms": statistics.median(cpu),
        "n": len(wall),
    }


def time_fn(fn: Callable, args: Sequence, warmup: int = 1, iters: int = 5) -> float:
    """Median wall milliseconds of the jitted `fn(*args)` (bench_kernels.py's convention)."""
    compiled, _, _ = compile_fn(fn, *args)
    return time_compiled(compiled, args, warmup, iters)["median_ms"]


def fmt(x: float | None, spec: str = "{:9.2f}", width: int = 9) -> str:
    """A table cell; '-' for missing values."""
    return spec.format(x) if x is not None else f"{'-':>{width}}"


def fmt_mib(n_bytes: int | None, width: int = 9) -> str:
    return fmt(None if n_bytes is None else n_bytes / MiB, f"{{:{width}.1f}}", width)


def config_meta(config: str, overrides: Sequence[str], train: Any) -> dict[str, Any]:
    """Which config a benchmark ran, under the same keys in every JSON: its name, the
    overrides, and the step's shape (train.seq_len, global_batch, accumulate)."""
    return dict(
        config=config,
        overrides=list(overrides),
        seq_len=train.seq_len,
        global_batch=train.global_batch,
        accumulate=train.accumulate,
    )


def write_json(path: str | None, meta: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Writes {"meta": meta, "rows": rows} to `path` (nothing when path is None)."""
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {path}")


def import_pyplot():
    """matplotlib.pyplot with a file-only backend, or None (with a message) when not installed."""
    try:
        import matplotlib  # noqa: PLC0415 - optional for the benchmarks: only for --plot

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415 - after matplotlib.use
    except ImportError:
        print("matplotlib is not installed: --plot skipped (pip install matplotlib)", file=sys.stderr)
        return None
    return plt


def log(msg: str) -> None:
    """Progress line on stderr, so stdout holds only the results."""
    print(msg, file=sys.stderr, flush=True)
