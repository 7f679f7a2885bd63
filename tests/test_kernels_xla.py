"""The XLA selection and window attention against per-token and dense references."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import (
    compressed_visible,
    dense_attention,
    random_block_indices,
    reference_attention,
    reference_block_scores,
    reference_block_selection,
    selection_mask,
    selection_visible,
    window_mask,
    window_visible,
)

from nsa_jax.kernels import compressed_attention
from nsa_jax.kernels.cudnn import compressed_attention_grouped, window_attention_cudnn
from nsa_jax.kernels.xla import num_compressed, select_blocks, selection_attention_xla, window_attention_xla

from helpers import rel_err


def _qkv(B, T, H, K, D, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (
        jax.random.normal(ks[0], (B, T, H, D)),
        jax.random.normal(ks[1], (B, T, K, D)),
        jax.random.normal(ks[2], (B, T, K, D)),
    )


@pytest.mark.parametrize(
    "G,K,T,lp,n,chunk,strategy",
    [
        (1, 2, 37, 8, 3, 16, "gather"),
        pytest.param(6, 1, 50, 8, 4, 512, "gather", marks=pytest.mark.slow),
        pytest.param(2, 2, 64, 16, 3, 20, "gather", marks=pytest.mark.slow),
        (1, 2, 37, 8, 3, 16, "masked"),
        pytest.param(6, 1, 50, 8, 4, 512, "masked", marks=pytest.mark.slow),
    ],
)
def test_selection_matches_per_token_and_dense_grads(G, K, T, lp, n, chunk, strategy):
    B, D = 2, 8
    q, k, v = _qkv(B, T, G * K, K, D)
    idx = random_block_indices(np.random.default_rng(0), B, T, K, n, lp)
    f = jax.jit(
        lambda q, k, v: selection_attention_xla(q, k, v, jnp.asarray(idx), lp, query_chunk=chunk, strategy=strategy)
    )
    out = f(q, k, v)

    assert rel_err(out, reference_attention(q, k, v, None, selection_visible(idx, lp, T))[0]) < 1e-5

    mask = selection_mask(idx, T, lp)
    cot = jax.random.normal(jax.random.PRNGKey(9), out.shape)
    grads = jax.grad(lambda *a: jnp.sum(f(*a) * cot), argnums=(0, 1, 2))(q, k, v)
    ref = jax.grad(lambda *a: jnp.sum(dense_attention(*a, mask)[0] * cot), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(grads, ref):
        assert rel_err(g, r) < 1e-5


@pytest.mark.parametrize(
    "G,K,T,w,chunk",
    [
        (1, 2, 45, 7, 16),
        pytest.param(6, 1, 40, 64, 512, marks=pytest.mark.slow),
        pytest.param(2, 1, 33, 16, 8, marks=pytest.mark.slow),
    ],
)
def test_window_matches_per_token_and_dense_grads(G, K, T, w, chunk):
    B, D = 2, 8
    q, k, v = _qkv(B, T, G * K, K, D, seed=1)
    f = jax.jit(lambda q, k, v: window_attention_xla(q, k, v, w, query_chunk=chunk))
    out = f(q, k, v)
    assert rel_err(out, reference_attention(q, k, v, None, window_visible(w))[0]) < 1e-5

    mask = window_mask(T, w)[None, None]
    cot = jax.random.normal(jax.random.PRNGKey(9), out.shape)
    grads = jax.grad(lambda *a: jnp.sum(f(*a) * cot), argnums=(0, 1, 2))(q, k, v)
    ref = jax.grad(lambda *a: jnp.sum(dense_attention(*a, mask)[0] * cot), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(grads, ref):
        assert rel_err(g, r) < 1e-5


@pytest.mark.slow
def test_selection_with_all_blocks_is_full_causal_attention():
    """n >= ceil(T/lp): selection (through select_blocks) equals causal attention."""
    B, G, K, T, D, lp = 1, 3, 2, 45, 8, 8
    n = math.ceil(T / lp)
    q, k, v = _qkv(B, T, G * K, K, D, seed=2)
    scores = jax.random.uniform(jax.random.PRNGKey(3), (B, T, K, n))
    idx = select_blocks(scores, lp, n)
    out = jax.jit(lambda *a: selection_attention_xla(*a, lp, query_chunk=16, strategy="gather"))(q, k, v, idx)
    causal = np.tril(np.ones((T, T), bool))[None, None]
    ref, _ = dense_attention(q, k, v, causal)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.slow
def test_window_covering_sequence_is_full_causal_attention():
    B, G, K, T, D = 1, 2, 2, 30, 8
    q, k, v = _qkv(B, T, G * K, K, D, seed=4)
    out = jax.jit(lambda *a: window_attention_xla(*a, T + 5, query_chunk=8))(q, k, v)
    ref, _ = dense_attention(q, k, v, np.tril(np.ones((T, T), bool))[None, None])
    assert rel_err(out, ref) < 1e-5


def test_select_blocks_prefers_high_scores_and_breaks_ties_low():
    lp, n, T = 4, 4, 24  # 6 blocks; at t=23 the current block is 5
    scores = np.zeros((1, T, 1, 6), np.float32)
    scores[0, 23, 0] = [0.0, 0.3, 0.1, 0.3, 0.0, 0.0]  # blocks 1 and 3 tie
    idx = np.asarray(select_blocks(jnp.asarray(scores), lp, n))
    assert sorted(idx[0, 23, 0]) == [0, 1, 4, 5]  # forced 0, 4, 5; the tie goes to block 1
    scores[0, 23, 0, 3] = 0.31
    idx = np.asarray(select_blocks(jnp.asarray(scores), lp, n))
    assert sorted(idx[0, 23, 0]) == [0, 3, 4, 5]
    # t = 5: candidates 0 and 1 only, so two slots stay unused.
    assert sorted(idx[0, 5, 0]) == [-1, -1, 0, 1]


def _check_against_reference(f, q, k, v, visible):
    """f's output and its q, k, v gradients against the float64 per-token reference."""
    o, vjp = jax.vjp(jax.jit(f), q, k, v)
    do = jax.random.normal(jax.random.PRNGKey(11), o.shape)
    ref = reference_attention(q, k, v, do, visible)
    for got, want in zip((o, *vjp(do)), ref):
        assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("G,K,T,l,d", [(6, 2, 77, 16, 8), (1, 1, 40, 8, 4), (2, 1, 20, 32, 16)])
def test_compressed_branch_as_grouped_causal_attention(G, K, T, l, d):
    # The regrouping kernels/cudnn.py hands to cuDNN, run here by XLA's attention: the last group
    # partly padded (T=77), queries before l - 1 seeing nothing, and no compressed token at all (T < l).
    B, D = 2, 8
    Tc = num_compressed(T, l, d)
    q, kv, vv = _qkv(B, T, G * K, K, D, seed=6)
    kc, vc = kv[:, :Tc], vv[:, :Tc]
    f = lambda q, kc, vc: compressed_attention_grouped(q, kc, vc, l=l, d=d, implementation="xla")
    _check_against_reference(f, q, kc, vc, compressed_visible(l, d, Tc))


def test_window_as_fused_attention_with_a_left_window():
    q, k, v = _qkv(2, 45, 6, 2, 8, seed=7)
    f = lambda q, k, v: window_attention_cudnn(q, k, v, 7, implementation="xla")
    _check_against_reference(f, q, k, v, window_visible(7))


def _shifted(visible, off: int):
    """visible() of query rows that stand at positions off, off + 1, ...: row t sees what position t + off sees."""
    return lambda b, t, kv: visible(b, t + off, kv)


@pytest.mark.parametrize("off,Tq,chunk", [(13, 24, 16), pytest.param(40, 17, 512, marks=pytest.mark.slow)])
def test_selection_and_window_with_a_query_offset(off, Tq, chunk):
    """Context parallelism's queries: rows [off, off + Tq) of a length-57 problem against all 57 keys."""
    B, G, K, T, D, lp, n, w = 2, 3, 2, 57, 8, 8, 3, 11
    q, k, v = _qkv(B, T, G * K, K, D, seed=12)
    idx = random_block_indices(np.random.default_rng(3), B, T, K, n, lp)
    q_part, idx_part = q[:, off : off + Tq], jnp.asarray(idx[:, off : off + Tq])
    for strategy in ("gather", "masked"):
        # q_offset traced (an argument of the jitted function), as under shard_map.
        f = lambda q, k, v, o: selection_attention_xla(  # noqa: E731
            q, k, v, idx_part, lp, query_chunk=chunk, strategy=strategy, q_offset=o
        )
        _check_against_reference(
            lambda q, k, v: f(q, k, v, jnp.int32(off)), q_part, k, v, _shifted(selection_visible(idx, lp, T), off)
        )
    f = lambda q, k, v: window_attention_xla(q, k, v, w, query_chunk=chunk, q_offset=jnp.int32(off))  # noqa: E731
    _check_against_reference(f, q_part, k, v, _shifted(window_visible(w), off))


@pytest.mark.parametrize("off,Tq", [pytest.param(0, 30, marks=pytest.mark.slow), (21, 19)])
def test_compressed_with_a_query_offset_scores_the_whole_sequence(off, Tq):
    """Rows [off, off + Tq) of a length-50 problem: attention, gradients and the selected blocks."""
    B, G, K, T, D, l, d, lp, n = 1, 2, 2, 50, 8, 8, 4, 8, 3
    Tc = num_compressed(T, l, d)
    q, kv, vv = _qkv(B, T, G * K, K, D, seed=13)
    kc, vc = kv[:, :Tc], vv[:, :Tc]
    q_part = q[:, off : off + Tq]
    kw = dict(l=l, d=d, lp=lp, num_blocks=-(-T // lp))
    f = lambda q, kc, vc: compressed_attention(q, kc, vc, q_offset=jnp.int32(off), **kw)[0]  # noqa: E731
    _check_against_reference(f, q_part, kc, vc, _shifted(compressed_visible(l, d, Tc), off))
    # The blocks chosen for the offset rows: the float64 scores of the whole problem, those rows, the spec's rules.
    scores = reference_block_scores(q, kc, l, d, lp)[:, off : off + Tq]
    want, clear = reference_block_selection(scores, lp, n, tol=1e-5, offset=off)
    _, idx = jax.jit(lambda o: compressed_attention(q_part, kc, vc, select_n=n, q_offset=o, **kw))(off)
    assert clear.mean() > 0.9
    np.testing.assert_array_equal(np.asarray(idx)[clear], want[clear])
