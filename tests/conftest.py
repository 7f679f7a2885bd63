"""Test setup: CPU backend with several host devices, fp32 matmuls (pyproject puts the repo on sys.path)."""

import os

# Before jax starts a backend: data-parallel tests need more than one device.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from nsa_jax.tools.aot import cuda_plugin_available  # noqa: E402 (XLA_FLAGS is read when a backend starts)

# The tests compile hundreds of small programs that then run for milliseconds, so on the CPU
# their time is XLA's compiles, most of it LLVM optimizing code: without its passes the suite
# takes about a third less time and computes the same results (no fast-math either way). Not
# where jax's CUDA plugin is installed: there the aot tier compiles for the cards, and its
# register, spill and memory figures must be those of the default pipeline.
FAST_COMPILE_FLAG = "--xla_backend_optimization_level=0"
if os.environ["JAX_PLATFORMS"] == "cpu" and not cuda_plugin_available():
    os.environ["XLA_FLAGS"] += f" {FAST_COMPILE_FLAG}"  # helpers.cpu_env passes it to subprocesses

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
