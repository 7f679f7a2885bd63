"""Test setup: CPU backend with several host devices, fp32 matmuls (pyproject puts the repo on sys.path)."""

import os

# Before jax is imported anywhere: data-parallel tests need more than one device.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
