"""Compiling for a GPU that is not there: target cards, compiles, memory, launches, registers.

jax with the CUDA plugin compiles ahead of time for a card described by an XLA
`GpuTargetConfigProto`, on a host with no GPU and no driver: XLA's GPU pipeline
runs (fusion, buffer assignment, command buffers) and the Pallas kernels go
through Triton and ptxas to cubins. This module owns that route:

* `TARGETS`: the cards (A100 40GB and 80GB PCIe, sm_80; H100 80GB SXM, sm_90) as
  public specification values, and `GpuTarget.config_text()`, their target config;
* `target_devices(target, n)`: n devices of that card to place abstract arguments on
  (`PluginMissing`, one line naming the install, when the plugin is absent);
* `compile_train_step` / `compile_layer`: the optimizer step of a config (any
  strategy, any device count) and the NSA layer's forward+backward, compiled for a
  card with the Pallas kernels (what `attention_impl: auto` runs on a GPU), with an
  optional XLA dump; the result's memory in nsa_jax/ops/memory.py's schema;
* `read_launches(dump)`: every launch of the compiled program from the dump's thunk
  sequence, multiplied by the trip counts of the while loops it sits in, in
  categories (Pallas kernels, gemm fusions, other fusions, copy kernels, then copy
  thunks and collectives); `pallas_kernels(dump)`: each Pallas kernel's grid,
  threads, shared memory and, from `ptxas -v` on its PTX, registers and spill bytes;
  `occupancy_blocks`: the blocks per SM those allow;
* `fit_check` (`largest_batch` over compiles): whether a config's step fits a card
  and the most rows per device (micro-batch) that do.

Nothing here allocates device memory or runs a program; figures are XLA's plan.
Without a GPU XLA does not autotune: its own gemm fusions get default tiles, so
their registers are not the real card's; the Pallas kernels' tiles are ours.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import importlib.util
import math
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import xla_bridge
from jax.experimental import topologies
from jax.sharding import PartitionSpec as P

from nsa_jax import config
from nsa_jax.config import Config, ModelConfig
from nsa_jax.kernels import plan_kernels
from nsa_jax.nsa.context import SEQ, SeqShard
from nsa_jax.nsa.layer import NSAAttention
from nsa_jax.ops.memory import compiled_memory
from nsa_jax.train.step import make_mesh, make_train_step
from nsa_jax.train.strategies import make_plan, per_device_batch

MiB = 1024 * 1024
GiB = 1024 * MiB
INSTALL_HINT = 'pip install -e ".[cuda12]"'
# jax's default GPU allocator takes this fraction of the card at start-up (XLA_PYTHON_CLIENT_MEM_FRACTION).
DEFAULT_MEM_FRACTION = 0.75
TRITON_TARGET = "__gpu$xla.gpu.triton"
# cuDNN's fused attention, forward and backward (kernels/cudnn.py).
CUDNN_ATTENTION_TARGETS = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")


# ---------------------------------------------------------------------------
# target cards


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """One card, from its public specifications (the fields of XLA's GpuDeviceInfoProto)."""

    name: str
    description: str  # device_description_str: what jax reports as device_kind
    compute_capability: tuple[int, int]
    core_count: int  # SMs
    fpus_per_core: int
    shared_memory_per_block_optin: int
    shared_memory_per_core: int
    device_memory_size: int
    memory_bandwidth: int  # bytes / s
    l2_cache_size: int
    clock_rate_ghz: float
    shared_memory_per_block: int = 49152
    threads_per_block_limit: int = 1024
    threads_per_warp: int = 32
    threads_per_core_limit: int = 2048
    registers_per_core_limit: int = 65536
    registers_per_block_limit: int = 65536

    @property
    def arch(self) -> str:
        """ptxas -arch of the card (sm_90a: the Hopper instructions Triton emits)."""
        major, minor = self.compute_capability
        return f"sm_{major}{minor}" + ("a" if major >= 9 else "")

    def usable_bytes(self, fraction: float | None = None) -> int:
        """Device memory jax's allocator can hand out: `fraction` (default XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75)."""
        if fraction is None:
            fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_MEM_FRACTION))
        return int(self.device_memory_size * fraction)

    def config_text(self) -> str:
        """The GpuTargetConfigProto in protobuf text form."""
        major, minor = self.compute_capability
        fields = {
            k: getattr(self, k)
            for k in (
                "threads_per_block_limit",
                "threads_per_warp",
                "shared_memory_per_block",
                "shared_memory_per_core",
                "threads_per_core_limit",
                "core_count",
                "fpus_per_core",
                "memory_bandwidth",
                "l2_cache_size",
                "clock_rate_ghz",
                "device_memory_size",
                "shared_memory_per_block_optin",
                "registers_per_core_limit",
                "registers_per_block_limit",
            )
        }
        fields.update(block_dim_limit_x=2147483647, block_dim_limit_y=65535, block_dim_limit_z=65535)
        lines = ["gpu_device_info {"] + [f"  {k}: {v}" for k, v in fields.items()]
        lines += [f"  cuda_compute_capability {{ major: {major} minor: {minor} }}", "}"]
        lines += [
            'platform_name: "CUDA"',
            "dnn_version_info { major: 9 minor: 8 }",
            "runtime_version { major: 12 minor: 9 }",
            f'device_description_str: "{self.description}"',
        ]
        return "\n".join(lines) + "\n"


_A100 = dict(
    compute_capability=(8, 0),
    core_count=108,
    fpus_per_core=64,
    shared_memory_per_block_optin=166912,
    shared_memory_per_core=167936,
    l2_cache_size=41943040,
    clock_rate_ghz=1.41,
)
TARGETS: dict[str, GpuTarget] = {
    "a100-40": GpuTarget(
        "a100-40", "NVIDIA A100-PCIE-40GB", device_memory_size=42331013120, memory_bandwidth=1555200000000, **_A100
    ),
    "a100-80": GpuTarget(
        "a100-80", "NVIDIA A100 80GB PCIe", device_memory_size=85899345920, memory_bandwidth=1935000000000, **_A100
    ),
    "h100": GpuTarget(
        "h100",
        "NVIDIA H100 80GB HBM3",
        compute_capability=(9, 0),
        core_count=132,
        fpus_per_core=128,
        shared_memory_per_block_optin=232448,
        shared_memory_per_core=233472,
        device_memory_size=85520809984,
        memory_bandwidth=3352320000000,
        l2_cache_size=52428800,
        clock_rate_ghz=1.98,
    ),
}


class PluginMissing(RuntimeError):
    """The CUDA plugin that compiles for a GPU target is not installed."""


def get_target(name: str) -> GpuTarget:
    if name not in TARGETS:
        raise ValueError(f"unknown GPU target {name!r}; choose one of {', '.join(TARGETS)}")
    return TARGETS[name]


# jax's CUDA plugins: jax[cuda12] (the `cuda12` extra) and jax[cuda13].
CUDA_PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # find_spec imports the parent package, which may be absent
        return False


def cuda_plugin_available() -> bool:
    """Whether one of jax's CUDA plugins is installed; it compiles for a card without one."""
    return any(_module_exists(name) for name in CUDA_PLUGINS)


def compile_on_host() -> bool:
    """Run this process's jax on the CPU unless JAX_PLATFORMS chose: compiling for a card needs no local GPU.

    Without a GPU the CUDA plugin fails its start-up check when jax starts every
    backend it finds, and then cannot describe a card either; with JAX_PLATFORMS=cpu
    it skips that check and still compiles for the card. Returns whether it set it:
    only before jax has started its backends, and never over the user's own choice.
    """
    if jax.config.jax_platforms or xla_bridge.backends_are_initialized():
        return False
    jax.config.update("jax_platforms", "cpu")
    return True


@functools.lru_cache(maxsize=None)
def _topology(name: str, n_devices: int):
    return topologies.get_topology_desc(
        platform="cuda", target_config=get_target(name).config_text(), topology=f"1x1x{n_devices}"
    )


def target_devices(target: str | GpuTarget, n_devices: int = 1) -> list:
    """`n_devices` devices of the card, to compile for (nothing runs on them)."""
    name = target.name if isinstance(target, GpuTarget) else get_target(target).name
    if not cuda_plugin_available():
        raise PluginMissing(f"compiling for {name} needs jax's CUDA plugin, which is not installed: {INSTALL_HINT}")
    compile_on_host()
    try:
        return list(_topology(name, n_devices).devices)
    except Exception as e:  # a plugin that cannot load reads like a missing one to the user
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        if "not implemented for cuda" in first:  # jax started before JAX_PLATFORMS could be set, on no GPU
            raise PluginMissing(
                f"jax's CUDA plugin did not start in this process ({first}): on a machine without a GPU "
                f"start it with JAX_PLATFORMS=cpu; else reinstall: {INSTALL_HINT}"
            ) from e
        raise PluginMissing(f"jax's CUDA plugin could not describe {name} ({first}); reinstall: {INSTALL_HINT}") from e


def abstract_gpu(target: str | GpuTarget = "a100-40"):
    """A context in which Pallas lowers its Triton kernels for `target`, with or without a GPU here.

    jax 0.11 and later ask the context's abstract device which card to lower a Triton
    kernel for, and refuse without a GPU and without one (`No supported GPU devices
    found`); jax 0.10 lowers for sm_90 when there is no GPU and ignores it. The mesh
    has no axes: a jit's own shardings still place its arguments.
    """
    t = target if isinstance(target, GpuTarget) else get_target(target)
    device = jax.sharding.AbstractDevice(device_kind=t.description, num_cores=t.core_count, platform="gpu")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device))


def export_for_cuda(fn: Callable, *args, target: str | GpuTarget = "a100-40"):
    """`jax.export` of `fn` for CUDA with the Pallas kernels as Triton calls and cuDNN's attention as its own
    calls, on any host (no GPU needed; for reading the program: such calls carry no serialization guarantee)."""
    disabled = [jax.export.DisabledSafetyCheck.custom_call(t) for t in (TRITON_TARGET, *CUDNN_ATTENTION_TARGETS)]
    with abstract_gpu(target):
        return jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=disabled)(*args)


# ---------------------------------------------------------------------------
# compiling


@dataclasses.dataclass
class Compiled:
    """A program compiled for a card: the executable, its memory plan, seconds and dump folder."""

    target: str
    executable: Any
    memory: dict
    lower_s: float
    compile_s: float
    dump_dir: str | None


def compile_for(target: str, fn: Callable, args, dump_dir: str | None = None, **jit_kwargs) -> Compiled:
    """`fn` (jitted or not) compiled for `target` at the abstract `args`; `dump_dir`: XLA's dump with the PTX
    (`pallas_kernels` reads its kernels)."""
    options = {}
    if dump_dir:
        if Path(dump_dir).exists():
            shutil.rmtree(dump_dir)  # one program per folder: the parsers read every module in it
        options["xla_dump_to"] = str(dump_dir)
        # The kernels' PTX (ptxas reads it for registers and spills): jax 0.10 dumps it with the rest, newer
        # XLA only for the emitters this names.
        options["xla_dump_emitter_re"] = "ptx"
    t0 = time.perf_counter()
    with abstract_gpu(target):
        lowered = (fn if hasattr(fn, "lower") else jax.jit(fn, **jit_kwargs)).lower(*args)
        t1 = time.perf_counter()
        executable = lowered.compile(compiler_options=options or None)
    t2 = time.perf_counter()
    return Compiled(target, executable, compiled_memory(executable), t1 - t0, t2 - t1, dump_dir)


def train_step_args(cfg: Config, devices: list):
    """(jitted train step, abstract (state, tokens_AxBxT1)) of `cfg` on a data mesh of `devices`."""
    plan = make_plan(cfg, make_mesh(cfg, devices))
    t = cfg.train
    tokens_AxBxT1 = jax.ShapeDtypeStruct((t.accumulate, t.global_batch, t.seq_len + 1), jnp.int32, sharding=plan.batch)
    return make_train_step(plan), (plan.abstract_state(), tokens_AxBxT1)


def compile_train_step(cfg: Config, target: str, n_devices: int, dump_dir: str | None = None) -> Compiled:
    """One optimizer step of `cfg` (its parallel.strategy, its batch) for `n_devices` cards; memory is per device.

    The step's kernel plan is the card's (the mesh's devices are GPUs): Pallas kernels compiled, not interpreted.
    """
    step, args = train_step_args(cfg, target_devices(target, n_devices))
    return compile_for(target, step, args, dump_dir)


def layer_forward_backward(cfg: ModelConfig, seq_len: int, batch: int = 1, sharding=None):
    """(fn, abstract (params, x, ct)): the NSA layer's forward and its VJP w.r.t. parameters and input,
    with the kernel plan of a GPU (kernels compiled, not interpreted, whatever this host is)."""
    module = NSAAttention(cfg, kernels=plan_kernels(cfg.nsa, seq_len, "gpu"))
    x = jax.ShapeDtypeStruct((batch, seq_len, cfg.d_model), jnp.dtype(cfg.dtype))
    params = jax.eval_shape(lambda xx: module.init(jax.random.PRNGKey(0), xx)["params"], x)
    if sharding is not None:
        params, x = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), (params, x))

    def forward_backward(p, x_BxTxD, ct_BxTxD):
        _, vjp = jax.vjp(lambda pp, xx: module.apply({"params": pp}, xx), p, x_BxTxD)
        return vjp(ct_BxTxD)

    return forward_backward, (params, x, x)


def compile_layer(cfg: Config, target: str, seq_len: int, batch: int = 1, dump_dir: str | None = None) -> Compiled:
    """The NSA layer's forward+backward of `cfg.model` at T=`seq_len` for one card."""
    device = target_devices(target, 1)[0]
    fn, args = layer_forward_backward(cfg.model, seq_len, batch, jax.sharding.SingleDeviceSharding(device))
    return compile_for(target, fn, args, dump_dir)


def context_layer(cfg: ModelConfig, seq_len: int, context: int, devices: list, backward: bool = False):
    """(fn, abstract (params, x[, ct])): the NSA layer over one sequence of `seq_len` split over `context`
    devices (a `seq` mesh of `devices`; nsa/context.py), forward only or forward+backward, with a GPU's
    kernel plan. The collectives of one layer, apart from the rest of a step."""
    a = cfg.nsa
    shard = SeqShard(context, config.context_chunk_len(seq_len, context, a.l, a.lp), seq_len)
    mesh = jax.sharding.Mesh(np.asarray(devices), (SEQ,))
    module = NSAAttention(cfg, kernels=plan_kernels(a, shard.seq_len, "gpu", context=context), shard=shard)
    rows = jax.sharding.NamedSharding(mesh, P(None, SEQ))
    x = jax.ShapeDtypeStruct((1, shard.seq_len, cfg.d_model), jnp.dtype(cfg.dtype), sharding=rows)
    # The parameters do not depend on the split: those of the unsplit layer at a short length.
    small = jax.ShapeDtypeStruct((1, max(a.l, 16), cfg.d_model), jnp.dtype(cfg.dtype))
    params = jax.eval_shape(lambda xx: NSAAttention(cfg).init(jax.random.PRNGKey(0), xx)["params"], small)
    params = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=jax.sharding.NamedSharding(mesh, P())), params
    )

    def local(p, x_BxLxD, ct_BxLxD=None):
        if ct_BxLxD is None:
            return module.apply({"params": p}, x_BxLxD)
        _, vjp = jax.vjp(lambda pp, xx: module.apply({"params": pp}, xx), p, x_BxLxD)
        dp, dx = vjp(ct_BxLxD)
        return jax.tree.map(lambda g: jax.lax.psum(g, SEQ), dp), dx

    specs = (P(), P(None, SEQ), P(None, SEQ)) if backward else (P(), P(None, SEQ))
    out_specs = (P(), P(None, SEQ)) if backward else P(None, SEQ)
    fn = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=out_specs, check_vma=False)
    return fn, (params, x, x) if backward else (params, x)


def compile_context_layer(
    cfg: Config, target: str, seq_len: int, context: int, backward: bool = False, dump_dir: str | None = None
) -> Compiled:
    """The NSA layer of `cfg.model` over one sequence of `seq_len` split over `context` cards of `target`."""
    fn, args = context_layer(cfg.model, seq_len, context, target_devices(target, context), backward)
    return compile_for(target, fn, args, dump_dir)


def largest_batch(
    fits: Callable[[int], tuple[bool, Any]],
    limit: int = 4096,
    guess: Callable[[dict[int, Any]], int | None] | None = None,
) -> tuple[int, dict[int, Any]]:
    """The largest b in [1, limit] with fits(b) true, fitting being monotone in b.

    `fits(b)` -> (bool, detail). Probes 1 and 2, then `guess(probes)` (e.g. an affine
    extrapolation of the bytes; a right guess costs two more probes: it and the next),
    then doubling and bisection between the proven bounds (a guess past `limit` probes
    `limit`). Returns (b, or 0 when even 1 does not fit; {b: detail} of every probe).
    """
    probes: dict[int, Any] = {}

    def probe(b: int) -> bool:
        ok, probes[b] = fits(b)
        return ok

    if not probe(1):
        return 0, probes
    if limit < 2 or not probe(2):
        return 1, probes
    lo, hi = 2, None
    g = guess(probes) if guess else None
    if g is not None and g > limit:  # a guess past the limit: the limit itself is the one probe that may end it
        g = limit
    if g is not None and lo < g <= limit:
        if not probe(g):
            hi = g
        elif g == limit:
            return g, probes
        elif probe(g + 1):
            lo = g + 1
        else:
            return g, probes
    while hi is None:
        b = min(2 * lo, limit)
        if b == lo:
            return lo, probes
        if probe(b):
            lo = b
        else:
            hi = b
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if probe(mid):
            lo = mid
        else:
            hi = mid
    return lo, probes


def affine_guess(budget: int) -> Callable[[dict[int, dict]], int | None]:
    """A largest_batch guess from probes whose detail is a compiled memory (`total`): where the line through
    b=1, 2 meets `budget`."""

    def guess(probes: dict[int, dict]) -> int | None:
        per_row = probes[2]["total"] - probes[1]["total"]
        if per_row <= 0:
            return None
        return 1 + (budget - probes[1]["total"]) // per_row

    return guess


HEARTBEAT_S = 15.0


@contextlib.contextmanager
def heartbeat(log: Callable[[str], None] | None, what: str, every: float | None = None):
    """`log(what ...)` when the block starts and every `every` (HEARTBEAT_S) seconds while it runs.

    A compile for a card takes a minute or more on a CPU; no command stays silent that long.
    """
    if log is None:
        yield
        return
    every = HEARTBEAT_S if every is None else every
    log(f"{what} ...")
    t0 = time.perf_counter()
    done = threading.Event()

    def beat() -> None:
        while not done.wait(every):
            log(f"{what}: {time.perf_counter() - t0:.0f} s so far")

    thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def with_batch(cfg: Config, rows_per_device: int, n_devices: int) -> Config:
    """`cfg` with train.global_batch = rows_per_device x the devices on the data axis (n_devices over
    parallel.context): the micro-batch summed over the data axis."""
    return config.replace(cfg, [f"train.global_batch={rows_per_device * (n_devices // cfg.parallel.context)}"])


def largest_seq_len(
    fits: Callable[[int], tuple[bool, dict]], start: int, unit: int, budget: int, tolerance: float = 1 / 16
) -> tuple[int, dict[int, dict]]:
    """The largest T (a multiple of `unit`) with fits(T) true, to within `tolerance` of itself; fitting is
    monotone in T. (T, or 0 when not even `unit` fits; {T: detail} of every probe.)

    `fits(T)` -> (bool, compiled memory with `total`). Probes `start` and start / 2, draws
    the line through their totals to `budget` and probes where it lands (bytes grow about
    linearly in T), then doubles or bisects between the proven bounds: a compile per probe,
    a handful in all.
    """
    probes: dict[int, dict] = {}
    ok: dict[int, bool] = {}

    def probe(T: int) -> None:
        if T not in ok:
            ok[T], probes[T] = fits(T)

    def down(x: float) -> int:
        return max(unit, int(x) // unit * unit)

    def bounds() -> tuple[int, int | None]:
        lo = max((T for T in ok if ok[T]), default=0)
        hi = min((T for T in ok if not ok[T]), default=None)
        return lo, hi

    a, b = down(start / 2), down(start)
    probe(b)
    probe(a)
    slope = (probes[b]["total"] - probes[a]["total"]) / (b - a) if b > a else 0
    if slope > 0:
        guess = down(b + (budget - probes[b]["total"]) / slope)
        probe(guess)
        if ok[guess]:  # a right guess: one step past it settles it
            probe(down(guess * (1 + tolerance)) + unit)
    lo, hi = bounds()
    while lo == 0 and hi > unit:  # nothing fits yet: halve
        probe(down(hi / 2))
        lo, hi = bounds()
    if lo == 0:
        return 0, probes
    while hi is None:  # everything fits yet: double
        probe(2 * lo)
        lo, hi = bounds()
    while hi - lo > max(unit, lo * tolerance) and down((lo + hi) / 2) > lo:
        probe(down((lo + hi) / 2))
        lo, hi = bounds()
    return lo, probes


def fit_check(cfg: Config, target: str, n_devices: int, limit: int = 4096, log: Callable | None = None) -> dict:
    """Whether `cfg`'s step fits `target`, and the most rows per device (micro-batch) that do.

    Compiles the step at the configured batch, then searches the rows per device
    (largest_batch: 1, 2, an affine guess, doubling, bisection). Fitting means the
    step's total (argument + output + temp - alias) within jax's share of the card.
    """
    usable = get_target(target).usable_bytes()
    memo: dict[int, dict] = {}

    def memory(b: int) -> dict:
        if b not in memo:
            t0 = time.perf_counter()
            with heartbeat(log, f"  {b} row(s) per device: compiling"):
                memo[b] = compile_train_step(with_batch(cfg, b, n_devices), target, n_devices).memory
            if log:
                log(f"  {b} row(s) per device: {memo[b]['total'] / MiB:.0f} MiB ({time.perf_counter() - t0:.0f} s)")
        return memo[b]

    def fits(b: int) -> tuple[bool, dict]:
        mem = memory(b)
        return mem["total"] <= usable, mem

    configured = per_device_batch(cfg, n_devices // cfg.parallel.context)
    mem = memory(configured)
    out = {
        "target": target,
        "n_devices": n_devices,
        "usable_bytes": usable,
        "configured_rows": configured,
        "configured": mem,
        "configured_fits": mem["total"] <= usable,
    }
    if cfg.parallel.context > 1:
        # A sequence split over `seq` is there because one row is long: the question is how long.
        out.update(seq_len_fit(cfg, target, n_devices, usable, mem, log))
        return out
    largest, _ = largest_batch(fits, limit, affine_guess(usable))
    out.update(largest_rows=largest, largest=memo.get(largest), probes={b: m["total"] for b, m in sorted(memo.items())})
    return out


def seq_len_fit(cfg: Config, target: str, n_devices: int, usable: int, configured: dict, log: Callable | None):
    """{largest_seq_len, seq_probes}: the longest train.seq_len whose step fits `target` at cfg's batch
    (largest_seq_len over whole multiples of 2 C lcm(l, lp): the padded layouts of context parallelism)."""
    a, C = cfg.model.nsa, cfg.parallel.context
    unit = 2 * C * math.lcm(a.l, a.lp)
    memo = {cfg.train.seq_len: configured}

    def fits(T: int) -> tuple[bool, dict]:
        if T not in memo:
            t0 = time.perf_counter()
            with heartbeat(log, f"  T={T:,}: compiling"):
                memo[T] = compile_train_step(config.replace(cfg, [f"train.seq_len={T}"]), target, n_devices).memory
            if log:
                log(f"  T={T:,}: {memo[T]['total'] / MiB:,.0f} MiB per device ({time.perf_counter() - t0:.0f} s)")
        return memo[T]["total"] <= usable, memo[T]

    T, _ = largest_seq_len(fits, cfg.train.seq_len, unit, usable)
    return {
        "largest_seq_len": T,
        "largest": memo.get(T),
        "seq_probes": {t: m["total"] for t, m in sorted(memo.items())},
    }


# ---------------------------------------------------------------------------
# reading the dump: launches and loop trip counts

_THUNK = re.compile(r"^(\s*)(\d+): (k\w+)\s+\[[^\]]*\]\s*(.*)$")
_KERNEL = re.compile(
    r"(\S+) grid: \[(\d+), (\d+), (\d+)\] threads: \[(\d+), (\d+), (\d+)\]\s+shared_memory: (\d+) bytes"
)
_TRIP = re.compile(r'%([\w.\-]+) = .*"known_trip_count":\{"n":"(\d+)"\}')
_TRITON_CALL = re.compile(r'%([\w.\-]+) = .*custom_call_target="__gpu\$xla\.gpu\.triton"')
_META = re.compile(r'profile_annotation: "([^"]*)"\s*thunk_id: (\d+)')
# Thunks that only order or group others.
_STRUCTURAL = {"kWhile", "kSequential", "kConditional", "kCommandBuffer"}
# Kernels (what XLA launches as kernels) by category, then the thunks that copy buffers without a kernel
# of their own (memcpy, or a fusion addressed at a dynamic offset), then collectives.
KERNEL_CATEGORIES = ("pallas", "gemm", "fusions", "copies")
CATEGORIES = KERNEL_CATEGORIES + ("copy_thunks", "collectives")


@dataclasses.dataclass
class Launch:
    """One launch site of the compiled program and how often one call of it runs there."""

    thunk_id: int
    kind: str  # XLA thunk kind: kCustomKernel (a kernel), kCopy, kDynamicSliceFusion, kAllReduce, ...
    hlo: str  # the HLO instruction (thunk metadata)
    kernel: str  # the kernel's name, or the HLO name for thunks that launch no named kernel
    category: str  # one of CATEGORIES
    count: int  # static 1 x the trip counts of the enclosing loops (a condition runs trips + 1 times)
    loops: tuple[str, ...]  # enclosing while loops, outermost first
    grid: tuple[int, int, int] | None = None
    threads: tuple[int, int, int] | None = None
    shared_memory: int | None = None


def _module_prefixes(dump_dir: str) -> list[str]:
    return sorted(p[: -len(".thunk_sequence.txt")] for p in glob.glob(os.path.join(dump_dir, "*.thunk_sequence.txt")))


def _hlo_text(prefix: str) -> str:
    files = glob.glob(prefix + ".sm_*_gpu_after_optimizations.txt")
    return Path(files[0]).read_text() if files else ""


def _category(kind: str, hlo: str, kernel: str, triton: set[str]) -> str:
    if kind.startswith(("kAll", "kReduceScatter", "kCollective", "kNccl", "kSend", "kRecv")):
        return "collectives"
    if hlo in triton:
        return "pallas"
    if kind in ("kGemm", "kCublasLtMatmul", "kCuDnn") or kernel.startswith(("gemm_fusion", "cublas")):
        return "gemm"
    if kind in ("kCopy", "kMemcpy", "kDeviceToDevice", "kDynamicSliceFusion"):
        return "copy_thunks"
    if "dynamic_update_slice" in hlo or "dynamic_slice" in hlo:
        return "copies"
    if hlo.startswith("copy") or kernel.startswith(("wrapped_copy", "copy")):
        return "copies"
    return "fusions"


def read_launches(dump_dir: str) -> list[Launch]:
    """Every launch site of the program(s) dumped in `dump_dir`, with executions per call.

    From `*.thunk_sequence.txt` (launches in order, while loops nested), the thunk
    metadata (thunk id -> HLO instruction) and the optimized HLO (`known_trip_count`
    of each loop, custom calls to Triton = the Pallas kernels). A loop whose trip
    count XLA does not know counts once.
    """
    out = []
    for prefix in _module_prefixes(dump_dir):
        hlo_text = _hlo_text(prefix)
        trips = {m.group(1): int(m.group(2)) for m in _TRIP.finditer(hlo_text)}
        triton = set(_TRITON_CALL.findall(hlo_text))
        meta_path = Path(prefix + ".thunk_metadata.txt")
        meta = {}
        if meta_path.exists():
            meta = {int(i): name for name, i in _META.findall(meta_path.read_text())}
        stack: list[list] = []  # [indent, loop hlo, trips, section]
        for line in Path(prefix + ".thunk_sequence.txt").read_text().splitlines():
            stripped = line.strip()
            if stripped in ("condition:", "body:"):
                if stack:
                    stack[-1][3] = stripped[:-1]
                continue
            m = _THUNK.match(line)
            if not m:
                continue
            indent, thunk_id, kind, rest = len(m.group(1)), int(m.group(2)), m.group(3), m.group(4)
            while stack and indent <= stack[-1][0]:
                stack.pop()
            hlo = meta.get(thunk_id, "")
            if kind == "kWhile":
                stack.append([indent, hlo, trips.get(hlo, 1), "body"])
                continue
            if kind in _STRUCTURAL:
                continue
            count = 1
            for _, _, n, section in stack:
                count *= n + 1 if section == "condition" else n
            k = _KERNEL.search(rest)
            kernel = k.group(1) if k else (hlo or kind)
            launch = Launch(
                thunk_id, kind, hlo, kernel, _category(kind, hlo, kernel, triton), count, tuple(s[1] for s in stack)
            )
            if k:
                launch.grid = tuple(int(x) for x in k.group(2, 3, 4))
                launch.threads = tuple(int(x) for x in k.group(5, 6, 7))
                launch.shared_memory = int(k.group(8))
            out.append(launch)
    return out


def launch_counts(launches: list[Launch]) -> dict[str, int]:
    """Executions per call by category; `kernels`: the kernel launches (KERNEL_CATEGORIES); `total`: every thunk."""
    counts = {c: 0 for c in CATEGORIES}
    for launch in launches:
        counts[launch.category] += launch.count
    counts["kernels"] = sum(counts[c] for c in KERNEL_CATEGORIES)
    counts["total"] = sum(counts[c] for c in CATEGORIES)
    return counts


_COLLECTIVE = re.compile(
    r"%([\w.\-]+) = (.+?) (all-gather-start|all-gather|reduce-scatter|all-reduce-start|all-reduce|"
    r"collective-permute-start|collective-permute|all-to-all)\(.*?replica_groups=(\{[^=]*?\}\})"
)
_ARRAY = re.compile(r"\b(pred|[sfu]\d+|bf16)\[([\d,]*)\]")
_ITEM_BYTES = {"pred": 1, "bf16": 2}


def _array_bytes(shape_text: str) -> list[int]:
    """Bytes of every array in an HLO shape (a tuple lists several)."""
    out = []
    for dtype, dims in _ARRAY.findall(shape_text):
        n = 1
        for d in dims.split(","):
            n *= int(d) if d else 1
        out.append(n * _ITEM_BYTES.get(dtype, int(dtype[1:]) // 8 if dtype[1:].isdigit() else 4))
    return out


def collective_traffic(dump_dir: str) -> dict[str, dict[str, int]]:
    """Per collective kind: executions per call, payload bytes and bytes each device sends, per call.

    Payload: what the collective produces on each device (an all-gather's gathered array, a
    reduce-scatter's shard, an all-reduce's sum). Sent per device, the ring algorithms' count
    over a group of g devices: all-gather payload (g-1)/g, reduce-scatter payload (g-1),
    all-reduce 2 payload (g-1)/g, a permute its payload. `largest` is the largest single
    payload (bytes) of the kind. Loops count by their trip counts (read_launches).
    """
    counts: dict[str, int] = {}
    for launch in read_launches(dump_dir):
        if launch.category == "collectives":
            counts[launch.hlo] = counts.get(launch.hlo, 0) + launch.count
    out: dict[str, dict[str, int]] = {}
    for prefix in _module_prefixes(dump_dir):
        for name, shape, op, groups in _COLLECTIVE.findall(_hlo_text(prefix)):
            if name not in counts:
                continue  # a collective that is not launched on its own (inside a fusion or a start/done pair)
            kind = op.removesuffix("-start")
            arrays = _array_bytes(shape)
            if kind == "all-gather" and op.endswith("-start"):
                arrays = arrays[len(arrays) // 2 :]  # ((inputs), (outputs))
            elif kind == "collective-permute" and op.endswith("-start"):
                arrays = arrays[:1]
            payload = sum(arrays)
            g = len(groups.split("},{")[0].strip("{}").split(","))
            sent = {
                "all-gather": payload * (g - 1) // g,
                "reduce-scatter": payload * (g - 1),
                "all-reduce": 2 * payload * (g - 1) // g,
            }.get(kind, payload)
            row = out.setdefault(kind, {"count": 0, "payload_bytes": 0, "sent_bytes": 0, "largest": 0})
            n = counts[name]
            row["count"] += n
            row["payload_bytes"] += n * payload
            row["sent_bytes"] += n * sent
            row["largest"] = max(row["largest"], payload)
    return out


def loop_trip_counts(dump_dir: str) -> dict[str, int]:
    """{while loop HLO name: known trip count} of the dumped program(s)."""
    out = {}
    for prefix in _module_prefixes(dump_dir):
        out.update({m.group(1): int(m.group(2)) for m in _TRIP.finditer(_hlo_text(prefix))})
    return out


# ---------------------------------------------------------------------------
# registers and spills

_PTXAS_FUNC = re.compile(
    r"Function properties for (\S+)\s*\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, "
    r"(\d+) bytes spill loads"
)
_PTXAS_USED = re.compile(r"Compiling entry function '([^']+)' for '(\w+)'.*?Used (\d+) registers", re.S)
_ENTRY = re.compile(r"\.entry (\w+)\(")
_PTX_TARGET = re.compile(r"^\.target (\w+)", re.M)


def ptxas_path() -> str | None:
    """ptxas from the CUDA wheels jax's plugin installs (nvidia/cuda_nvcc for CUDA 12, nvidia/cu13 for 13),
    else the one on PATH, else CUDA's default install."""
    try:
        import nvidia  # noqa: PLC0415 - optional: the CUDA wheels of jax's plugin (the cuda12 extra)

        bases = list(getattr(nvidia, "__path__", []))
    except ImportError:
        bases = []
    for base in bases:
        for sub in ("cuda_nvcc", "cu13"):
            candidate = os.path.join(base, sub, "bin", "ptxas")
            if os.access(candidate, os.X_OK):
                return candidate
    found = shutil.which("ptxas")
    if found is None and os.access("/usr/local/cuda/bin/ptxas", os.X_OK):
        found = "/usr/local/cuda/bin/ptxas"
    return found


def ptx_entries(dump_dir: str) -> dict[str, str]:
    """{kernel entry name: PTX file} of the dumped program(s)."""
    out = {}
    for path in sorted(glob.glob(os.path.join(dump_dir, "*.ptx"))):
        for name in _ENTRY.findall(Path(path).read_text()):
            out.setdefault(name, path)
    return out


def ptxas_usage(ptx_path: str, arch: str | None = None) -> dict[str, dict]:
    """{entry: registers, spill_stores, spill_loads, stack_frame, arch} from `ptxas -v` (arch: the PTX's .target)."""
    text = Path(ptx_path).read_text()
    if arch is None:
        m = _PTX_TARGET.search(text)
        arch = m.group(1) if m else "sm_80"
    return {k: dict(v) for k, v in _ptxas_log(text, arch).items()}


@functools.lru_cache(maxsize=256)
def _ptxas_log(ptx_text: str, arch: str) -> dict[str, dict]:
    # Cached on the PTX itself: the same kernel compiled for two cards of one architecture is one ptxas run.
    exe = ptxas_path()
    if exe is None:
        raise PluginMissing(f"ptxas not found (it comes with jax[cuda12]): {INSTALL_HINT}")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx_text)
        f.flush()
        res = subprocess.run([exe, f"-arch={arch}", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"ptxas -arch={arch} failed: {res.stderr.strip()[:300]}")
    log = res.stderr + res.stdout
    out = {}
    for name, stack, stores, loads in _PTXAS_FUNC.findall(log):
        out[name] = dict(stack_frame=int(stack), spill_stores=int(stores), spill_loads=int(loads), arch=arch)
    for name, used_arch, regs in _PTXAS_USED.findall(log):
        out.setdefault(name, dict(arch=used_arch))["registers"] = int(regs)
    return out


def pallas_kernels(dump_dir: str, launches: list[Launch] | None = None) -> list[dict]:
    """One row per Pallas kernel of the dumped program: grid, threads, shared memory, registers, spills, launches."""
    launches = read_launches(dump_dir) if launches is None else launches
    entries = ptx_entries(dump_dir)
    rows: dict[str, dict] = {}
    for launch in launches:
        if launch.category != "pallas":
            continue
        row = rows.get(launch.kernel)
        if row is None:
            row = rows[launch.kernel] = dict(
                name=launch.kernel,
                grid=list(launch.grid or ()),
                threads=launch.threads[0] if launch.threads else None,
                shared_memory=launch.shared_memory,
                launches=0,
            )
            if launch.kernel in entries:
                row.update(ptxas_usage(entries[launch.kernel]).get(launch.kernel, {}))
        row["launches"] += launch.count
    return sorted(rows.values(), key=lambda r: r["name"])


def occupancy_blocks(registers: int, threads: int, shared_memory: int, target: GpuTarget) -> int:
    """Blocks of `threads` that fit one SM by registers (allocated per warp in units of 256) and shared memory."""
    warps = -(-threads // target.threads_per_warp)
    per_warp = -(-registers * target.threads_per_warp // 256) * 256
    by_regs = target.registers_per_core_limit // max(per_warp * warps, 1)
    by_threads = target.threads_per_core_limit // threads
    by_smem = target.shared_memory_per_core // shared_memory if shared_memory else by_threads
    return max(0, min(by_regs, by_threads, by_smem, 32))
