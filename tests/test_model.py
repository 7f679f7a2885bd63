"""Whole-model properties: causality, gradients reach every parameter, scanned layers."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nsa_jax.config import load_config
from nsa_jax.kernels.plan import KernelPlan
from nsa_jax.model import NSALM, cast_dense_kernels, cross_entropy, init_params, per_layer
from nsa_jax.step.loss import loss_and_stats

from helpers import TINY_NSA, assert_close, rel_err, tiny_model_cfg


def _run(cfg, params, tokens):
    fn = jax.jit(lambda p, t: NSALM(cfg).apply({"params": p}, t, mutable=["intermediates"]))
    logits, state = fn(params, tokens)
    inter = state["intermediates"]["layers"]["attn"]
    return logits, inter["block_idx"][0], inter["gates"][0]


@pytest.mark.slow
@pytest.mark.parametrize("scorer", ["cmp", "minmax", "mix"])
def test_model_is_causal(scorer):
    """Changing tokens after t changes no logit, selected index or gate at positions <= t, whatever
    the block scorer (minmax over sub-blocks of 4: position t + 1 lies in the current block's bound)."""
    sub = 4 if scorer != "cmp" else 0
    cfg = tiny_model_cfg(G=2, K=2, n=4, lp=8, l=8, d=4, w=10, scorer=scorer, scorer_sub=sub)
    T, t = 57, 30
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, T), 0, cfg.vocab_size)
    params = jax.jit(NSALM(cfg).init)(jax.random.PRNGKey(1), tokens)["params"]
    changed = tokens.at[:, t + 1 :].set((tokens[:, t + 1 :] + 7) % cfg.vocab_size)
    logits_a, idx_a, g_a = _run(cfg, params, tokens)
    logits_b, idx_b, g_b = _run(cfg, params, changed)
    assert_close(logits_a[:, : t + 1], logits_b[:, : t + 1], 1e-5)
    np.testing.assert_array_equal(idx_a[:, :, : t + 1], idx_b[:, :, : t + 1])
    np.testing.assert_allclose(g_a[:, :, : t + 1], g_b[:, :, : t + 1], rtol=0, atol=1e-6)
    # The change is real: later positions do differ.
    assert not np.allclose(logits_a[:, t + 1 :], logits_b[:, t + 1 :], atol=1e-3)


@pytest.mark.slow
def test_every_parameter_gets_a_finite_nonzero_gradient():
    cfg = tiny_model_cfg(G=2, K=1)
    T = 48
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, T + 1), 0, cfg.vocab_size)
    params = jax.jit(NSALM(cfg).init)(jax.random.PRNGKey(3), tokens[:, :-1])["params"]

    def loss(p):
        return cross_entropy(NSALM(cfg).apply({"params": p}, tokens[:, :-1]), tokens[:, 1:])

    grads = jax.jit(jax.grad(loss))(params)
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        g = np.asarray(g)
        name = jax.tree_util.keystr(path)
        assert np.all(np.isfinite(g)), name
        # Scanned params carry a layer axis: every layer's slice must move.
        g_by_layer = g.reshape(g.shape[0], -1) if "layers" in name else g.reshape(1, -1)
        assert np.all(np.abs(g_by_layer).max(axis=1) > 0), f"zero gradient for {name}"


@pytest.mark.slow
def test_scan_and_unrolled_layers_agree():
    cfg = tiny_model_cfg(G=2, K=1)
    unrolled = cfg.__class__(**{**cfg.__dict__, "scan_layers": False})
    tokens = jax.random.randint(jax.random.PRNGKey(4), (1, 40), 0, cfg.vocab_size)
    p_scan = jax.jit(NSALM(cfg).init)(jax.random.PRNGKey(5), tokens)["params"]
    p_unrolled = {k: v for k, v in p_scan.items() if k != "layers"}
    for i in range(cfg.n_layers):
        p_unrolled[f"layer_{i}"] = jax.tree.map(lambda x: x[i], p_scan["layers"])
    a = jax.jit(lambda p: NSALM(cfg).apply({"params": p}, tokens))(p_scan)
    b = jax.jit(lambda p: NSALM(unrolled).apply({"params": p}, tokens))(p_unrolled)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # What the layers sow, stacked per layer, is the same from either layout.
    _, sa = jax.jit(lambda p: NSALM(cfg).apply({"params": p}, tokens, mutable=["intermediates"]))(p_scan)
    _, sb = jax.jit(lambda p: NSALM(unrolled).apply({"params": p}, tokens, mutable=["intermediates"]))(p_unrolled)
    for name in ("block_idx", "gates"):
        va, vb = (per_layer(s, "intermediates", name, c) for s, c in ((sa, cfg), (sb, unrolled)))
        assert va.shape[:3] == (cfg.n_layers, *tokens.shape), (name, va.shape)
        np.testing.assert_allclose(va, vb, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(vb[1], sb["intermediates"]["layer_1"]["attn"][name][0])
    # scan_unroll changes the loop, not the stacked [L, ...] parameters nor what they compute.
    unroll = dataclasses.replace(cfg, scan_unroll=cfg.n_layers)
    shapes = jax.eval_shape(lambda: NSALM(unroll).init(jax.random.PRNGKey(5), tokens)["params"])
    assert jax.tree.map(lambda x: x.shape, shapes) == jax.tree.map(lambda x: x.shape, p_scan)
    c = jax.jit(lambda p: NSALM(unroll).apply({"params": p}, tokens))(p_scan)
    np.testing.assert_allclose(c, b, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_bf16_compute_keeps_fp32_params_and_logits():
    cfg = tiny_model_cfg(G=2, K=1)
    cfg16 = cfg.__class__(**{**cfg.__dict__, "dtype": "bfloat16"})
    tokens = jax.random.randint(jax.random.PRNGKey(6), (1, 40), 0, cfg.vocab_size)
    params = jax.jit(NSALM(cfg16).init)(jax.random.PRNGKey(7), tokens)["params"]
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    lo16 = jax.jit(lambda p: NSALM(cfg16).apply({"params": p}, tokens))(params)
    lo32 = jax.jit(lambda p: NSALM(cfg).apply({"params": p}, tokens))(params)
    assert lo16.dtype == jnp.float32
    assert np.max(np.abs(np.asarray(lo16) - np.asarray(lo32))) < 0.1 * np.max(np.abs(np.asarray(lo32)))


@pytest.mark.slow
def test_dense_kernels_cast_once_give_the_same_loss_and_fp32_gradients():
    # The train step casts every Dense kernel to the compute dtype before the layer scan;
    # each Dense casts it anyway, so loss and gradients match the uncast parameters'.
    cfg = tiny_model_cfg(G=2, K=1)
    cfg16 = cfg.__class__(**{**cfg.__dict__, "dtype": "bfloat16"})
    tokens = jax.random.randint(jax.random.PRNGKey(8), (1, 41), 0, cfg.vocab_size)
    params = jax.jit(NSALM(cfg16).init)(jax.random.PRNGKey(9), tokens[:, :-1])["params"]

    def loss(p, cast):
        p = cast_dense_kernels(p, cfg16.dtype) if cast else p
        return cross_entropy(NSALM(cfg16).apply({"params": p}, tokens[:, :-1]), tokens[:, 1:])

    cast = cast_dense_kernels(params, "bfloat16")
    kernels = [x for path, x in jax.tree_util.tree_leaves_with_path(cast) if path[-1].key == "kernel"]
    assert kernels and all(x.dtype == jnp.bfloat16 for x in kernels)
    assert any(x.dtype == jnp.float32 for x in jax.tree.leaves(cast))  # norms, biases, embedding stay fp32
    (l0, g0), (l1, g1) = (jax.jit(jax.value_and_grad(lambda p, c=c: loss(p, c)))(params) for c in (False, True))
    assert float(l0) == float(l1)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        assert b.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-9)


def test_prefill_and_decode_modes_reject_a_missing_cache_or_unscanned_layers():
    """Prefill/decode read the `cache` collection (nsa_jax.inference.init_cache) and run scanned layers."""
    cfg = tiny_model_cfg(G=2, K=1)
    tokens = jnp.zeros((2, 1), jnp.int32)
    params = jax.eval_shape(lambda: NSALM(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32)))["params"]

    def run(c, mode):
        return jax.eval_shape(lambda p: NSALM(c, mode=mode).apply({"params": p}, tokens, mutable=["cache"]), params)

    for mode in ("prefill", "decode"):
        with pytest.raises(ValueError, match="init_cache"):
            run(cfg, mode)
    with pytest.raises(ValueError, match="scan_layers"):
        run(dataclasses.replace(cfg, scan_layers=False), "decode")
    with pytest.raises(ValueError, match="mode"):
        run(cfg, "sample")


@pytest.mark.slow  # 11 s each; test_context.py keeps a chunked loss under C = 2 and fsdp
@pytest.mark.parametrize("tied", [True, False])
def test_a_chunked_loss_equals_the_loss_of_whole_logits(tied):
    """train.loss_chunk=16 over rows of 50 (the last chunk padded): the loss equals a float64 numpy
    cross-entropy of the model's logits, and loss and every gradient equal train.loss_chunk=0's."""
    T = 50
    cfg = load_config(None, [*TINY_NSA, f"train.seq_len={T}", f"model.tie_embeddings={str(tied).lower()}"])
    chunked = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, loss_chunk=16))
    params = init_params(cfg.model, jax.random.PRNGKey(0), T)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, T + 1), 0, cfg.model.vocab_size)

    logits = np.asarray(NSALM(cfg.model).apply({"params": params}, tokens[:, :-1]), np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    gold = np.take_along_axis(logits, np.asarray(tokens[:, 1:])[..., None], -1)[..., 0]
    want = float(np.mean(logz - gold))

    def value_and_grad(c):
        return jax.jit(jax.value_and_grad(lambda p: loss_and_stats(p, tokens, cfg=c)[0]))(params)

    (l0, g0), (l1, g1) = value_and_grad(cfg), value_and_grad(chunked)
    assert abs(float(l1) - want) / want < 1e-6 and abs(float(l0) - want) / want < 1e-6
    for path, a, b in zip(jax.tree_util.tree_leaves_with_path(g1), jax.tree.leaves(g1), jax.tree.leaves(g0)):
        assert rel_err(a, b) < 1e-5, jax.tree_util.keystr(path[0])


def test_a_scanned_model_inits_and_applies_with_the_cudnn_compressed_branch():
    """The cuDNN compressed branch (fused attention + the Pallas lse pass, interpreted here) under the
    layer scan: init gives the parameters every other plan gives, and apply the logits' shape.
    On an H200 (jax 0.11.2, flax 0.12.10) init failed in flax's scan check (test_kernels_pallas.py,
    test_an_unused_lse_pass_is_dropped_with_its_kernel); this is the user's view of that fix."""
    cfg = tiny_model_cfg(G=2, K=1, lp=16, n=3, l=16, d=8, w=16)
    assert cfg.scan_layers
    tokens = jnp.zeros((1, 64), jnp.int32)
    rng = jax.random.PRNGKey(0)

    def init(plan):
        return jax.eval_shape(lambda r: NSALM(cfg, kernels=plan).init(r, tokens)["params"], rng)

    cudnn = KernelPlan(cmp="cudnn", interpret=True)
    params = init(cudnn)
    want = init(KernelPlan())
    assert jax.tree.structure(params) == jax.tree.structure(want)
    assert jax.tree.leaves(jax.tree.map(lambda a, b: a.shape == b.shape, params, want)) == [True] * len(
        jax.tree.leaves(want)
    )
    logits = jax.eval_shape(lambda p: NSALM(cfg, kernels=cudnn).apply({"params": p}, tokens), params)
    assert logits.shape == (1, 64, cfg.vocab_size)
