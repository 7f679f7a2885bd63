"""Compiling for a GPU that is not there: target cards, compiles, memory, launches, registers.

jax with the CUDA plugin compiles ahead of time for a card described by an XLA `GpuTargetConfigProto`, on
a host with no GPU and no driver: XLA's GPU pipeline runs and the Pallas kernels go through Triton and
ptxas to cubins (docs/PERFORMANCE.md, "Memory and kernel resources, compiled on a CPU host"). This module
owns that route:
* the cards (tools/cards.py `TARGETS`: A100 40GB and 80GB, H100, L4) as targets;
* `target_devices(target, n)`: n devices of that card to place abstract arguments on (`PluginMissing`,
  one line naming the install, when the plugin is absent);
* `compile_train_step` / `compile_layer`: the optimizer step of a config (any strategy, any device count)
  and the NSA layer's forward+backward, compiled for a card with the Pallas kernels (what
  `attention_impl: auto` runs on a GPU), with an optional XLA dump; memory in nsa_jax/ops/memory.py's schema;
* `fit_check` (`largest_batch` over compiles): whether a config's step fits a card and the most rows per
  device (micro-batch) that do.
Launches and the Pallas kernels' registers and spills are read back from the dump by xla_dump.py. Nothing
here allocates device memory or runs a program: figures are XLA's plan. Without a GPU XLA does not
autotune, so its own gemm fusions get default tiles (their registers are not the real card's); the Pallas
kernels' tiles are ours.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import math
import re
import shutil
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
from nsa_jax.kernels import cudnn_fits, plan_kernels
from nsa_jax.mesh import SEQ, make_mesh
from nsa_jax.nsa.context import SeqLayout
from nsa_jax.nsa.layer import NSAAttention
from nsa_jax.ops.memory import compiled_memory
from nsa_jax.seq_layout import chunk_len
from nsa_jax.step.step import make_train_step
from nsa_jax.step.strategies import make_plan, per_device_batch
from nsa_jax.tools.cards import (  # noqa: F401 - aot's names
    DEFAULT_MEM_FRACTION,
    TARGETS,
    TPU_TARGETS,
    GpuTarget,
    TpuTarget,
    get_target,
)
from nsa_jax.words import count

MiB = 1024 * 1024
GiB = 1024 * MiB
INSTALL_HINT = 'pip install -e ".[cuda12]"'
TPU_INSTALL_HINT = 'pip install -e ".[tpu]" (jax[tpu]: libtpu, which compiles for TPU slices on any host)'
TRITON_TARGET = "__gpu$xla.gpu.triton"
# cuDNN's fused attention, forward and backward (kernels/cudnn.py).
CUDNN_ATTENTION_TARGETS = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")


class PluginMissing(RuntimeError):
    """The CUDA plugin that compiles for a GPU target is not installed."""


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


def tpu_compiler_available() -> bool:
    """Whether libtpu (the `tpu` extra) is installed: it compiles for a TPU slice on a CPU host."""
    return _module_exists("libtpu")


def plugin_missing(target: str) -> str | None:
    """The one line saying what `target` needs installed to compile for, or None when it is there."""
    t = get_target(target)
    if isinstance(t, TpuTarget):
        if tpu_compiler_available():
            return None
        return f"--target {t.name} compiles with libtpu, which is not installed: {TPU_INSTALL_HINT}"
    if cuda_plugin_available():
        return None
    return f"--target {t.name} compiles with jax's CUDA plugin, which is not installed: {INSTALL_HINT}"


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


def target_devices(target: str | GpuTarget | TpuTarget, n_devices: int = 1) -> list:
    """`n_devices` devices of the card, or the first `n_devices` chips of the TPU slice, to compile for (nothing
    runs on them)."""
    name = target if isinstance(target, str) else target.name
    if isinstance(get_target(name), TpuTarget):
        return _tpu_devices(get_target(name), n_devices)
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


def _tpu_devices(t: TpuTarget, n_devices: int) -> list:
    if not tpu_compiler_available():
        raise PluginMissing(f"compiling for {t.name} needs libtpu, which is not installed: {TPU_INSTALL_HINT}")
    if n_devices > t.chips:
        raise ValueError(f"--devices {n_devices}: {t.name} has {t.chips} chips")
    compile_on_host()
    try:
        return list(topologies.get_topology_desc(t.topology, "tpu").devices)[:n_devices]
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise PluginMissing(f"libtpu could not describe {t.name} ({first}); reinstall: {TPU_INSTALL_HINT}") from e


def on_target(target: str):
    """The context a program for `target` lowers in: a GPU card's abstract device (`abstract_gpu`); a TPU
    slice needs none (its devices say what they are)."""
    if isinstance(get_target(target), TpuTarget):
        return contextlib.nullcontext()
    return abstract_gpu(target)


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
    (xla_dump.py `pallas_kernels` reads its kernels)."""
    options = {}
    if dump_dir:
        if Path(dump_dir).exists():
            shutil.rmtree(dump_dir)  # one program per folder: the parsers read every module in it
        options["xla_dump_to"] = str(dump_dir)
        # The kernels' PTX (ptxas reads it for registers and spills): jax 0.10 dumps it with the rest, newer
        # XLA only for the emitters this names.
        options["xla_dump_emitter_re"] = "ptx"
    t0 = time.perf_counter()
    with on_target(target):
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


# libtpu refuses a program over a chip's HBM at compile time, naming what its temporaries need (a GPU compile
# reports the plan and leaves the judgement to us).
HBM_REFUSAL = re.compile(r"HLO temporaries \(([\d.]+)([KMGT])\) exceeds available HBM \(([\d.]+)([KMGT])\)")


def step_memory(cfg: Config, target: str, n_devices: int) -> dict:
    """The per-device memory of `cfg`'s step compiled for `target` (compiled_memory's schema). A TPU compile
    that libtpu refuses for HBM gives its stated temporaries, `refused` set, and a total over the chip."""
    try:
        return compile_train_step(cfg, target, n_devices).memory
    except jax.errors.JaxRuntimeError as e:
        m = HBM_REFUSAL.search(str(e))
        if m is None:
            raise
        unit = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
        temp, hbm = float(m.group(1)) * unit[m.group(2)], float(m.group(3)) * unit[m.group(4)]
        out = dict.fromkeys(("argument", "output", "alias", "generated_code"), 0)
        return {**out, "temp": int(temp), "total": int(max(temp, hbm + 1)), "refused": True}


def layer_forward_backward(cfg: ModelConfig, seq_len: int, batch: int = 1, sharding=None):
    """(fn, abstract (params, x, ct)): the NSA layer's output and its VJP w.r.t. parameters and input,
    with the kernel plan of a GPU (kernels compiled, not interpreted, whatever this host is)."""
    module = NSAAttention(cfg, kernels=plan_kernels(cfg.nsa, seq_len, "gpu", cudnn_ok=cudnn_fits(cfg)))
    x = jax.ShapeDtypeStruct((batch, seq_len, cfg.d_model), jnp.dtype(cfg.dtype))
    params = jax.eval_shape(lambda xx: module.init(jax.random.PRNGKey(0), xx)["params"], x)
    if sharding is not None:
        params, x = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), (params, x))

    def forward_backward(p, x_BxTxD, ct_BxTxD):
        # The output too: a step consumes it (without it, XLA drops the output projection's forward).
        y, vjp = jax.vjp(lambda pp, xx: module.apply({"params": pp}, xx), p, x_BxTxD)
        return y, vjp(ct_BxTxD)

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
    layout = SeqLayout(context, chunk_len(seq_len, context, a.l, a.lp), seq_len)
    mesh = jax.sharding.Mesh(np.asarray(devices), (SEQ,))
    module = NSAAttention(cfg, kernels=plan_kernels(a, layout.seq_len, "gpu", layout=layout))
    rows = jax.sharding.NamedSharding(mesh, P(None, SEQ))
    x = jax.ShapeDtypeStruct((1, layout.seq_len, cfg.d_model), jnp.dtype(cfg.dtype), sharding=rows)
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
    if a == b:  # a start of one unit: the line needs a second point
        b = 2 * a
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
            with heartbeat(log, f"  {count(b, 'row')} per device: compiling"):
                memo[b] = step_memory(with_batch(cfg, b, n_devices), target, n_devices)
            if log:
                took = time.perf_counter() - t0
                log(f"  {count(b, 'row')} per device: {memo[b]['total'] / MiB:.0f} MiB ({took:.0f} s)")
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
                memo[T] = step_memory(config.replace(cfg, [f"train.seq_len={T}"]), target, n_devices)
            if log:
                log(f"  T={T:,}: {memo[T]['total'] / MiB:,.0f} MiB per device ({time.perf_counter() - t0:.0f} s)")
        return memo[T]["total"] <= usable, memo[T]

    T, _ = largest_seq_len(fits, cfg.train.seq_len, unit, usable)
    return {
        "largest_seq_len": T,
        "largest": memo.get(T),
        "seq_probes": {t: m["total"] for t, m in sorted(memo.items())},
    }
