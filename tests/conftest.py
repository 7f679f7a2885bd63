"""Test setup: CPU backend with several host devices, fp32 matmuls, repo on sys.path."""

import os
import sys

# Before jax is imported anywhere: data-parallel tests need more than one device.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
