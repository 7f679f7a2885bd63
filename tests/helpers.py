"""Small configs and comparison helpers shared by the tests."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from nsa_jax.config import load_config
from nsa_jax.step import optimizer as O

ROOT = pathlib.Path(__file__).resolve().parent.parent

# The tiny run of the tests that train through the launcher or the Trainer (overrides of
# cpu_tiny or the defaults); a test adds what it exercises (logging.tensorboard=false where
# it reads no TensorBoard files: the writer costs start-up time).
TINY_RUN = [
    "model.d_model=64",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.d_ff=128",
    "train.seq_len=64",
    "train.global_batch=4",
]
# TINY_RUN saving every second step, compressed branch only (it compiles fastest): the runs
# that are stopped, killed or refused around their checkpoints.
TINY_SAVING_RUN = [
    *TINY_RUN,
    "train.global_batch=2",
    "train.log_every=1",
    "train.eval_every=1000",
    "checkpoint.save_every=2",
    "logging.tensorboard=false",
    "model.nsa.branches=[cmp]",
]
# Every NSA size set small, for the tests that hold the train step and the evaluator to a
# host reference (over the defaults; a test adds its vocabulary and train keys).
# The smallest model of those (one layer, 2 heads of 16 over one KV head).
TINY_MODEL = [
    "model.d_model=32",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.head_dim=16",
    "model.v_head_dim=16",
    "model.d_ff=64",
]
TINY_NSA = [
    *TINY_MODEL,
    "model.nsa.l=8",
    "model.nsa.d=4",
    "model.nsa.lp=16",
    "model.nsa.n=3",
    "model.nsa.w=16",
    "model.nsa.cmp_mlp_hidden=16",
    "model.nsa.gate_hidden=8",
    "model.nsa.attention_impl=xla",
    "model.dtype=float32",
]


# The launcher over cpu_tiny, as a subprocess command (a test adds its flags).
LAUNCH_TRAIN = [sys.executable, "-m", "launch.train", "--config", "cpu_tiny"]
# training.csv's per-layer-mean NSA columns (docs/RUNBOOK.md "Artifacts").
NSA_CSV_COLUMNS = ("gate_cmp", "gate_slc", "gate_win", "gate_entropy", "sel_far_frac", "cmp_k_ratio", "cmp_v_ratio")


def set_flags(overrides: list[str]) -> list[str]:
    """["a=1", "b=2"] -> ["--set", "a=1", "--set", "b=2"]: overrides as launcher flags."""
    return [a for s in overrides for a in ("--set", s)]


def cpu_env(devices: int | None = 1, cache: pathlib.Path | None = None, **extra: str) -> dict[str, str]:
    """The environment of a subprocess that runs the repository on CPU.

    This one's without NSA_* settings and jax's multi-process variables; `devices` host CPU
    devices (None: XLA_FLAGS as inherited); `cache`: a persistent compilation cache that every
    compile goes to, so identical steps in later runs skip XLA; `extra` set last.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NSA_", "JAX_COORD", "JAX_NUM", "JAX_PROC"))}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    if devices is not None:
        # The device count, and the test process's other XLA flags (conftest's compile flags, where it set them).
        count = "--xla_force_host_platform_device_count"
        kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(count)]
        env["XLA_FLAGS"] = " ".join([f"{count}={devices}", *kept])
    if cache is not None:
        env.update(JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    env.update(extra)
    return env


def run_module(module: str, *args: str, env: dict[str, str] | None = None, timeout: float = 600):
    """`python -m module ARGS` in the repository root (env: cpu_env() unless given); output captured."""
    cmd = [sys.executable, "-m", module, *args]
    env = cpu_env() if env is None else env
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def run_cli(module: str, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    """`python -m <module> ARGS` (e.g. "benchmarks.bench_train") on the CPU's one device; check: exit status 0."""
    proc = run_module(module, *args, env=cpu_env(devices=None), timeout=timeout)
    if check:
        assert proc.returncode == 0, f"{module} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def sigterm_after_step(at: int) -> None:
    """In a launch.train subprocess (a driver ahead of its main): the process sends itself SIGTERM
    once step `at` is logged, as a preemption would (a checkpoint, exit 0; the learning-rate
    schedule stays the full run's)."""
    from nsa_jax.train import loop

    record = loop.Trainer._record

    def _record(self, p):
        ok = record(self, p)
        if p.step == at:
            os.kill(os.getpid(), signal.SIGTERM)
        return ok

    loop.Trainer._record = _record


def python_c(code: str) -> subprocess.CompletedProcess:
    """`python -c code` in the repository root with the repository on the path; output captured."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env)


def tiny_model_cfg(T_hint: int = 64, G: int = 2, K: int = 1, **nsa):
    """A model config small enough for per-token references."""
    # The paper's MLP compressor: the per-token references exercise its weights (the configs'
    # default, mean pooling, is asked for by name where a test wants it).
    base = {"l": 8, "d": 4, "lp": 8, "n": 3, "w": 12, "cmp_phi": "mlp", "cmp_mlp_hidden": 16}
    base.update({"gate_hidden": 8, "query_chunk": 16})
    base.update(nsa)
    overrides = [
        "model.vocab_size=32",
        "model.d_model=24",
        "model.n_layers=2",
        f"model.n_heads={G * K}",
        f"model.n_kv_heads={K}",
        "model.head_dim=8",
        "model.v_head_dim=8",
        "model.d_ff=32",
        "model.init_std=0.3",
        f"train.seq_len={T_hint}",
    ] + [f"model.nsa.{k}={v if not isinstance(v, (list, tuple)) else ','.join(v)}" for k, v in base.items()]
    return load_config(None, overrides).model


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def as_f32(*xs):
    """jax arrays as fp32 numpy (the float64 references' inputs)."""
    return [np.asarray(x.astype(jnp.float32)) for x in xs]


def scaled_atol(want, tol: float) -> float:
    """`tol` times the largest |want| (at least 1): fp32 rounding grows with the magnitude of the values
    compared (another summation order moves a value near 4 by a few 1e-6), so an absolute tolerance on
    values of order > 1 scales with them; never tighter than `tol`."""
    want = np.asarray(want)
    return tol * max(1.0, float(np.max(np.abs(want)))) if want.size else tol


def assert_close(got, want, tol: float, err_msg: str = "") -> None:
    """got == want within `scaled_atol(want, tol)` everywhere (fp32 values against another computation's)."""
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=scaled_atol(want, tol), err_msg=err_msg)


def check_all(results, reference, dtype):
    """(o, dq, dk, dv) of a kernel against a float64 reference: fp32 within 1e-5 (relative to the largest
    reference value), otherwise a relative RMS error below 5e-3."""
    for name, got, want in zip(("o", "dq", "dk", "dv"), results, reference):
        assert got.shape == want.shape, name
        assert np.all(np.isfinite(got)), name
        if dtype == jnp.float32:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=scaled_atol(want, 1e-5), err_msg=name)
        else:
            err = float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2)))
            assert err < 5e-3, f"{name}: relative RMS error {err:.2e}"


def random_inputs(rng, b, t, h, kvh, d, dtype, dv=None):
    """q, k, v, do of an attention call (h query heads over kvh KV heads), N(0, 1) in `dtype`."""
    dv = d if dv is None else dv

    def draw(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)

    return draw(b, t, h, d), draw(b, t, kvh, d), draw(b, t, kvh, dv), draw(b, t, h, dv)


def run_with_grads(fn, q, k, v, do):
    """Output and (dq, dk, dv) of ``fn`` for cotangent ``do``, jitted once, as fp32 numpy."""

    def both(q, k, v, do):
        o, vjp = jax.vjp(fn, q, k, v)
        return (o,) + vjp(do)

    return [np.asarray(x.astype(jnp.float32)) for x in jax.jit(both)(q, k, v, do)]


def host_train_state(cfg, shapes, seed: int, scale: float):
    """A TrainState in numpy with the layout of `shapes`, filled from a seeded generator.

    Stands in for the model's init (one compilation less); norm scales are 1, biases 0,
    every other weight scale * N(0, 1). The optimizer state is the real optax init.
    """
    rng = np.random.default_rng(seed)

    def fill(path, leaf):
        name = path[-1].key
        if name == "scale":
            return np.ones(leaf.shape, np.float32)
        if name == "bias":
            return np.zeros(leaf.shape, np.float32)
        return (scale * rng.standard_normal(leaf.shape)).astype(np.float32)

    params = jax.tree_util.tree_map_with_path(fill, shapes.params)
    opt_state = jax.device_get(O.make_optimizer(cfg.train).init(params))
    return shapes.replace(step=np.int32(0), params=params, opt_state=opt_state, rng=np.zeros((2,), np.uint32))
