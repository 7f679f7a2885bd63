"""The NSA layer against the naive reference: values, block indices, gradients."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import nsa_layer_ref

from nsa_jax.layers import matmul_parts
from nsa_jax.nsa.layer import NSAAttention
from nsa_jax.nsa.stats import aux_stat_sums, aux_stats

from helpers import rel_err, tiny_model_cfg

ON_GPU = jax.default_backend() in ("gpu", "cuda")


def _setup(cfg, T, B=2, seed=0):
    x = jax.random.normal(jax.random.PRNGKey(seed), (B, T, cfg.d_model), jnp.float32)
    params = jax.jit(NSAAttention(cfg).init)(jax.random.PRNGKey(seed + 1), x)["params"]
    return x, params


def _apply(cfg, params, x):
    apply = jax.jit(lambda p, xx: NSAAttention(cfg).apply({"params": p}, xx, mutable=["intermediates"]))
    out, state = apply(params, x)
    inter = state["intermediates"]
    idx = inter["block_idx"][0] if "block_idx" in inter else None
    return out, idx


@pytest.mark.parametrize(
    "G,K,T,phi",
    [
        (1, 2, 40, "mlp"),
        pytest.param(6, 1, 64, "mlp", marks=pytest.mark.slow),
        (6, 1, 37, "avg"),
        pytest.param(2, 2, 53, "mlp", marks=pytest.mark.slow),
    ],
)
def test_layer_matches_reference_forward_and_indices(G, K, T, phi):
    cfg = tiny_model_cfg(G=G, K=K, cmp_phi=phi)
    x, params = _setup(cfg, T)
    out, idx = _apply(cfg, params, x)
    ref, ref_idx = nsa_layer_ref(params, x, cfg)
    np.testing.assert_array_equal(np.asarray(idx), ref_idx)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize(
    "scorer,sub,G,K,T",
    [
        ("minmax", 0, 2, 2, 53),
        pytest.param("minmax", 2, 3, 1, 47, marks=pytest.mark.slow),
        pytest.param("minmax", 1, 1, 2, 41, marks=pytest.mark.slow),
        ("mix", 0, 2, 2, 53),
        ("rescore", 5, 2, 2, 53),  # 5 of 7 blocks cmp's candidates: the second stage re-ranks them
        pytest.param("rescore", 0, 3, 1, 47, marks=pytest.mark.slow),  # 4 n: every block a candidate
    ],
)
def test_scorers_match_reference_forward_and_indices(scorer, sub, G, K, T):
    # Every scorer's blocks equal the float64 per-token reference's (tests/reference.py, written from
    # docs/NSA.md "Block scorers"), and the layer's output with them; n = 4 leaves free blocks to rank.
    # `sub`: minmax's sub-block, rescore's candidates.
    extra = {"scorer_candidates": sub} if scorer == "rescore" else {"scorer_sub": sub}
    cfg = tiny_model_cfg(G=G, K=K, n=4, scorer=scorer, **extra)
    x, params = _setup(cfg, T, seed=11)
    out, idx = _apply(cfg, params, x)
    ref, ref_idx = nsa_layer_ref(params, x, cfg)
    np.testing.assert_array_equal(np.asarray(idx), ref_idx)
    assert rel_err(out, ref) < 1e-5
    plain = dataclasses.replace(cfg, nsa=dataclasses.replace(cfg.nsa, scorer="cmp", scorer_sub=0, scorer_candidates=0))
    assert not np.array_equal(np.asarray(_apply(plain, params, x)[1]), ref_idx), "the scorer changed no block"


@pytest.mark.parametrize(
    "G,K,T,kernel,cmp",
    [
        pytest.param(2, 2, 53, "auto", "auto", marks=pytest.mark.slow),
        pytest.param(6, 1, 64, "auto", "auto", marks=pytest.mark.slow),
        pytest.param(6, 1, 64, "gather", "auto", marks=pytest.mark.slow),
        # fp32 through XLA's attention: off a GPU only (cuDNN takes 16-bit inputs; test_block_scores
        # runs the cuDNN path in bf16 on a GPU).
        pytest.param(6, 2, 61, "auto", "cudnn", marks=pytest.mark.skipif(ON_GPU, reason="cuDNN takes 16-bit inputs")),
    ],
)
def test_pallas_layer_matches_reference_forward_and_indices(G, K, T, kernel, cmp):
    # All three branches through the Pallas kernels (interpreted off-GPU): the compressed
    # branch's group probabilities must rank the same blocks as the per-token reference.
    # `auto` runs the block-sparse selection kernel at these lengths; the others are named.
    # cmp=cudnn: the compressed attention through jax's fused attention (XLA's off a GPU) and the
    # scores from the separate log-sum-exp pass.
    cfg = tiny_model_cfg(G=G, K=K, l=16, d=8, lp=16, n=3, w=16)
    nsa = dataclasses.replace(cfg.nsa, attention_impl="pallas", selection_kernel=kernel, compressed_kernel=cmp)
    cfg = dataclasses.replace(cfg, nsa=nsa)
    x, params = _setup(cfg, T, seed=5)
    out, idx = _apply(cfg, params, x)
    ref, ref_idx = nsa_layer_ref(params, x, cfg)
    np.testing.assert_array_equal(np.asarray(idx), ref_idx)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize(
    "scorer,cmp",
    [
        ("minmax", "pallas"),
        pytest.param(
            "minmax",
            "cudnn",
            marks=[pytest.mark.slow, pytest.mark.skipif(ON_GPU, reason="cuDNN takes 16-bit inputs")],
        ),
        pytest.param("mix", "pallas", marks=pytest.mark.slow),
        ("rescore", "pallas"),
    ],
)
def test_pallas_layer_with_the_key_scorers_matches_reference(scorer, cmp):
    # The compressed attention through its Pallas (or cuDNN) path, the blocks from minmax's fused kernel
    # (mix: cmp's scores from the Pallas scoring kernel, added to minmax's on XLA; rescore: cmp's best 5
    # of 6 blocks from the fused scoring + top-n kernel, re-ranked on XLA), the selection through the
    # block-sparse kernel.
    extra = {"scorer_candidates": 5} if scorer == "rescore" else {"scorer_sub": 8}
    cfg = tiny_model_cfg(G=3, K=2, l=16, d=8, lp=16, n=4, w=16, scorer=scorer, **extra)
    nsa = dataclasses.replace(cfg.nsa, attention_impl="pallas", compressed_kernel=cmp)
    cfg = dataclasses.replace(cfg, nsa=nsa)
    x, params = _setup(cfg, 83, seed=5)
    out, idx = _apply(cfg, params, x)
    ref, ref_idx = nsa_layer_ref(params, x, cfg)
    np.testing.assert_array_equal(np.asarray(idx), ref_idx)
    assert rel_err(out, ref) < 1e-5


def _live_primitives(cfg, T, used):
    """Primitives of the layer's jaxpr that survive dead-code elimination for outputs `used`."""
    from jax._src.interpreters import partial_eval as pe

    x, params = _setup(cfg, T)
    jaxpr = jax.make_jaxpr(lambda p, xx: NSAAttention(cfg).apply({"params": p}, xx))(params, x).jaxpr
    live, _ = pe.dce_jaxpr(jaxpr, [used] * len(jaxpr.outvars))

    def name(e):  # custom VJPs without a kernel inside (the projections' layers.matmul_parts) apart
        no_kernel = str(e.primitive) == "custom_vjp_call" and "pallas_call" not in str(e.params["call_jaxpr"])
        return "custom_vjp_call without a kernel" if no_kernel else str(e.primitive)

    return [name(e) for e in live.eqns]


@pytest.mark.slow
def test_pallas_layer_is_dead_code_when_unused():
    # jax never drops a bare pallas_call as dead code. flax's nn.scan traces its body and
    # requires that nothing in it survives elimination when only parameters are needed, and
    # a model without the selection branch must not launch the group-probability kernel.
    cfg = tiny_model_cfg(G=2, K=1, l=16, d=8, lp=16, n=3, w=16)
    cfg = dataclasses.replace(cfg, nsa=dataclasses.replace(cfg.nsa, attention_impl="pallas"))
    assert _live_primitives(cfg, 48, used=False) == []
    no_slc = dataclasses.replace(cfg, nsa=dataclasses.replace(cfg.nsa, branches=("cmp", "win")))
    live = _live_primitives(no_slc, 48, used=True)
    # Compressed and window attention are one custom_vjp call each, with no bare kernel beside them.
    assert live.count("custom_vjp_call") == 2 and "pallas_call" not in live
    assert live.count("custom_vjp_call without a kernel") == 1


@pytest.mark.slow
@pytest.mark.parametrize("G,K,T", [(1, 2, 40), (6, 1, 45)])
def test_layer_matches_reference_gradients(G, K, T):
    cfg = tiny_model_cfg(G=G, K=K)
    x, params = _setup(cfg, T, B=1, seed=3)
    _, idx = _apply(cfg, params, x)
    cot = jax.random.normal(jax.random.PRNGKey(7), (1, T, cfg.d_model))

    def loss(p, xx):
        return jnp.sum(NSAAttention(cfg).apply({"params": p}, xx) * cot)

    def loss_ref(p, xx):
        return jnp.sum(nsa_layer_ref(p, xx, cfg, idx=np.asarray(idx))[0] * cot)

    gp, gx = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
    rp, rx = jax.jit(jax.grad(loss_ref, argnums=(0, 1)))(params, x)
    assert rel_err(gx, rx) < 1e-4
    flat_g = jax.tree_util.tree_leaves_with_path(gp)
    flat_r = dict(jax.tree_util.tree_leaves_with_path(rp))
    assert len(flat_g) == len(flat_r)
    for path, g in flat_g:
        r = flat_r[path]
        assert np.linalg.norm(np.asarray(r)) > 0, f"reference gradient of {jax.tree_util.keystr(path)} is zero"
        assert rel_err(g, r) < 1e-4, jax.tree_util.keystr(path)


@pytest.mark.slow
def test_branch_ablation_matches_reference():
    cfg = tiny_model_cfg(G=2, K=1, branches=("slc", "win"))
    x, params = _setup(cfg, 33)
    out, idx = _apply(cfg, params, x)
    ref, ref_idx = nsa_layer_ref(params, x, cfg)
    np.testing.assert_array_equal(np.asarray(idx), ref_idx)
    assert rel_err(out, ref) < 1e-5


def test_selected_blocks_rules():
    """Forced blocks present; -1 only when fewer candidates than n; rows distinct."""
    cfg = tiny_model_cfg(G=2, K=2, n=4, lp=8)
    T = 61
    x, params = _setup(cfg, T)
    _, idx = _apply(cfg, params, x)
    idx = np.asarray(idx)  # [B, T, K, n]: one row per KV group, shared by its heads
    assert idx.shape == (2, T, cfg.n_kv_heads, cfg.nsa.n)
    lp, n = cfg.nsa.lp, cfg.nsa.n
    for t in range(T):
        cur = t // lp
        forced = {0, cur} | ({cur - 1} if cur >= 1 else set())
        n_cand = cur + 1
        for row in idx[:, t].reshape(-1, n):
            used = [j for j in row if j >= 0]
            assert len(used) == len(set(used))
            assert forced <= set(used)
            assert all(0 <= j <= cur for j in used)
            assert len(used) == min(n, n_cand)
            assert all(j == -1 for j in row[len(used) :])


def test_long_sequence_runs_without_dense_scores():
    """A T=4096 layer forward compiles with memory far below a T x T score matrix."""
    cfg = tiny_model_cfg(G=6, K=2, l=32, d=16, lp=64, n=16, w=512, query_chunk=256)
    T = 4096
    x = jax.ShapeDtypeStruct((1, T, cfg.d_model), jnp.float32)
    params = jax.eval_shape(lambda: NSAAttention(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, T, cfg.d_model))))
    compiled = jax.jit(lambda p, xx: NSAAttention(cfg).apply(p, xx)).lower(params, x).compile()
    mem = compiled.memory_analysis()
    dense_scores_bytes = T * T * cfg.n_heads * 4
    assert mem.temp_size_in_bytes < dense_scores_bytes / 4


@pytest.mark.slow
def test_scale_stats_follow_the_compressed_values():
    """cmp_v_ratio is RMS(compressed values) / RMS(selection values): the MLP phi is linear in
    fc2, so scaling cmp_v's fc2 by c scales the ratio by c and leaves the keys' ratio alone."""
    cfg = tiny_model_cfg(G=2, K=2)
    x, params = _setup(cfg, 40)

    def stats(p):
        _, state = NSAAttention(cfg).apply({"params": p}, x, mutable=["aux"])
        st = aux_stats(state["aux"]["stat_sums"][0], cfg)
        return {k: float(st[k]) for k in ("cmp_k_ratio", "cmp_v_ratio")}

    s1 = stats(params)
    c = 37.0
    scaled = jax.tree_util.tree_map_with_path(
        lambda path, v: v * c if "cmp_v" in jax.tree_util.keystr(path) and "fc2" in jax.tree_util.keystr(path) else v,
        params,
    )
    s2 = stats(scaled)
    assert s1["cmp_v_ratio"] > 0 and s1["cmp_k_ratio"] > 0
    np.testing.assert_allclose(s2["cmp_v_ratio"], c * s1["cmp_v_ratio"], rtol=1e-4)
    np.testing.assert_allclose(s2["cmp_k_ratio"], s1["cmp_k_ratio"], rtol=1e-6)


def test_aux_stats_match_a_direct_computation():
    """The statistics from the layer's two reductions against each computed on its own, token by token."""
    rng = np.random.default_rng(0)
    cfg = dataclasses.replace(tiny_model_cfg(G=2, K=2, n=3), v_head_dim=6)
    B, T, H, K, N, Tc, Dk, Dv, lp, w = 2, 96, 4, 2, 3, 5, 8, 6, 16, 32
    g = rng.uniform(0.01, 1.0, (B, T, H, 3)).astype(np.float32)
    idx = rng.integers(-1, T // lp, (B, T, K, N)).astype(np.int32)
    kc, vc = rng.normal(size=(B, Tc, K, Dk)) * 3.0, rng.normal(size=(B, Tc, K, Dv)) * 0.5
    ks, vs = rng.normal(size=(B, T, K, Dk)), rng.normal(size=(B, T, K, Dv)) * 2.0
    arrays = [jnp.asarray(x, jnp.float32) for x in (kc, vc, ks, vs)]
    st = aux_stats(aux_stat_sums(jnp.asarray(g), jnp.asarray(idx), *arrays, lp, w), cfg)

    far = used = 0
    entropies = []
    for b, t, h in np.ndindex(B, T, H):
        p = g[b, t, h] / g[b, t, h].sum()
        entropies.append(-(p * np.log(p)).sum())
    for b, t, k, j in np.ndindex(B, T, K, N):
        if idx[b, t, k, j] >= 0:
            used += 1
            far += (idx[b, t, k, j] + 1) * lp - 1 < t - w + 1  # the block's last token lies before the window

    def rms(x):
        return np.sqrt(np.mean(np.square(x)))

    np.testing.assert_allclose(st["gate_mean"], g.reshape(-1, 3).mean(0), rtol=1e-5)
    np.testing.assert_allclose(st["gate_entropy"], np.mean(entropies), rtol=1e-5)
    np.testing.assert_allclose(st["sel_far_frac"], far / used, rtol=1e-6)
    assert 0 < far < used
    np.testing.assert_allclose(st["cmp_k_ratio"], rms(kc) / rms(ks), rtol=1e-5)
    np.testing.assert_allclose(st["cmp_v_ratio"], rms(vc) / rms(vs), rtol=1e-5)
    no_cmp = jnp.zeros((B, 0, K, Dk)), jnp.zeros((B, 0, K, Dv))
    empty = aux_stats(aux_stat_sums(jnp.asarray(g), jnp.asarray(idx), *no_cmp, *arrays[2:], lp, w), cfg)
    assert float(empty["cmp_k_ratio"]) == float(empty["cmp_v_ratio"]) == 0.0


def test_matmul_parts_gradients_match_separate_matmuls():
    """matmul_parts' one-matmul backward against autodiff of a separate x @ W_i per part."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(2, 5, 7)), jnp.float32)
    kernels = tuple(jnp.asarray(rng.normal(size=(7, n)), jnp.float32) for n in (3, 8, 1))
    weights = [jnp.asarray(rng.normal(size=(2, 5, k.shape[1])), jnp.float32) for k in kernels]

    def loss(fn):
        return lambda xx, ks: sum(jnp.sum(w * jnp.tanh(y)) for w, y in zip(weights, fn(xx, ks)))

    fused = jax.grad(loss(matmul_parts), argnums=(0, 1))(x, kernels)
    separate = jax.grad(loss(lambda xx, ks: [xx @ k for k in ks]), argnums=(0, 1))(x, kernels)
    for got, want in zip(jax.tree.leaves(fused), jax.tree.leaves(separate)):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for y, k in zip(matmul_parts(x, kernels), kernels):
        np.testing.assert_allclose(y, np.asarray(x) @ np.asarray(k), rtol=1e-5, atol=1e-6)
