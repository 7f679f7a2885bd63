"""nsa-jax: Native Sparse Attention language models in JAX."""

__version__ = "0.1.0"
