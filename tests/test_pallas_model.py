"""A few training steps with the Pallas kernels (interpreted on CPU) track the XLA path."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest

from nsa_jax.model import NSALM, cross_entropy

from helpers import tiny_model_cfg


def _losses(cfg, params, tokens, steps=3):
    opt = optax.adam(3e-3)
    state = opt.init(params)

    @jax.jit
    def step(p, s):
        def loss_fn(pp):
            return cross_entropy(NSALM(cfg).apply({"params": pp}, tokens[:, :-1]), tokens[:, 1:])

        loss, g = jax.value_and_grad(loss_fn)(p)
        upd, s = opt.update(g, s, p)
        return optax.apply_updates(p, upd), s, loss

    out = []
    for _ in range(steps):
        params, state, loss = step(params, state)
        out.append(float(loss))
    return np.array(out)


@pytest.mark.slow
def test_pallas_training_steps_match_xla():
    # Pallas tiles need power-of-two blocks of at least 16 rows.
    base = tiny_model_cfg(G=2, K=2, l=16, d=8, lp=16, n=3, w=16, query_chunk=64)
    base = dataclasses.replace(base, head_dim=16, v_head_dim=16, init_std=0.1)
    xla = dataclasses.replace(base, nsa=dataclasses.replace(base.nsa, attention_impl="xla"))
    pallas = dataclasses.replace(base, nsa=dataclasses.replace(base.nsa, attention_impl="pallas"))
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 50), 0, base.vocab_size)
    params = jax.jit(NSALM(xla).init)(jax.random.PRNGKey(1), tokens[:, :-1])["params"]
    ref = _losses(xla, params, tokens)
    got = _losses(pallas, params, tokens)
    assert ref[-1] < ref[0]  # the steps do train
    np.testing.assert_allclose(got, ref, rtol=1e-2)
    # Well inside bf16 tolerance in fp32:
    assert np.max(np.abs(got - ref)) < 1e-3


def test_local_and_global_layers_run_the_pallas_kernels_inside_their_cond():
    # Gemma 3 as NSA: the global layer's branches and the local layers' window run the Pallas
    # kernels (interpreted) under lax.cond per scanned layer; the XLA path is the reference.
    import pathlib

    import jax.numpy as jnp

    from nsa_jax.config import NSAConfig
    from nsa_jax.kernels.plan import KernelPlan
    from nsa_jax.pretrained.checkpoints import open_checkpoint
    from nsa_jax.pretrained.families import model_config
    from nsa_jax.pretrained.weights import dense_params, nsa_params

    folder = pathlib.Path(__file__).parent / "golden" / "pretrained" / "gemma3"
    ckpt = open_checkpoint(folder)
    dense = model_config(ckpt.hf_config)
    nsa = NSAConfig(l=16, d=8, lp=16, n=3, w=16, gate_bias_init=(-6.0, 6.0, -6.0))
    cfg = dataclasses.replace(dense, attention="nsa", nsa=nsa)
    params = nsa_params(dense_params(ckpt, dense), cfg, jax.random.PRNGKey(0))
    ids = jnp.asarray(np.load(folder / "golden.npz")["input_ids"])
    ref = NSALM(cfg, kernels=KernelPlan()).apply({"params": params}, ids)
    plan = KernelPlan(cmp="pallas", slc="blocksparse", win="pallas", interpret=True)
    got = NSALM(cfg, kernels=plan).apply({"params": params}, ids)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=2e-5)
