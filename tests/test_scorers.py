"""The block scorers' own properties (nsa_jax/kernels/scorers.py), against numpy; the layer with each
scorer is held to the float64 per-token reference in test_nsa_layer.py, decode in test_inference.py,
context parallelism in test_context.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nsa_jax.kernels.scorers import bound_block_logits, key_bounds, minmax_block_scores, select_minmax_xla
from nsa_jax.kernels.xla import select_blocks

B, T, K, G, D, LP = 2, 96, 2, 3, 8, 16
INTERPRET = jax.default_backend() not in ("gpu", "cuda")


def _qk(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, K * G, D)).astype(np.float32)
    k = rng.standard_normal((B, T, K, D)).astype(np.float32)
    return q, k


@pytest.mark.parametrize("sub", [1, 4, 16])
def test_the_bound_holds_for_every_key_and_is_exact_at_one_key_per_sub_block(sub):
    q, k = _qk(1)
    kmin, kmax = key_bounds(jnp.asarray(k), LP, sub)
    logits = np.asarray(bound_block_logits(jnp.asarray(q).reshape(B, T, K, G, D), kmin, kmax, LP, sub, 1.0))
    exact = np.einsum("btkgd,bskd->btkgs", q.reshape(B, T, K, G, D).astype(np.float64), k.astype(np.float64))
    block_max = exact.reshape(*exact.shape[:-1], T // LP, LP).max(-1)
    assert np.all(logits >= block_max - 1e-4)  # an upper bound of every key's logit in the block
    if sub == 1:
        np.testing.assert_allclose(logits, block_max, rtol=1e-5, atol=1e-5)
    else:
        assert np.mean(logits > block_max + 1e-3) > 0.5  # and a loose one with several keys a sub-block


def test_scores_of_a_query_never_read_a_later_key():
    """Queries at t <= 40 score the same blocks to the bit whatever the keys after 40 are: the softmax
    runs over the blocks each query has complete."""
    q, k = _qk(2)
    t = 40
    k2 = k.copy()
    k2[:, t + 1 :] = 10.0 * np.random.default_rng(3).standard_normal(k2[:, t + 1 :].shape)
    t_T = jnp.arange(T, dtype=jnp.int32)

    def scores(keys):
        kmin, kmax = key_bounds(jnp.asarray(keys), LP, 4)
        return np.asarray(minmax_block_scores(jnp.asarray(q), kmin, kmax, t_T, lp=LP, sub=4, scale=D**-0.5))

    a, b = scores(k), scores(k2)
    np.testing.assert_array_equal(a[:, : t + 1], b[:, : t + 1])
    assert not np.allclose(a[:, t + 1 :], b[:, t + 1 :])
    # Each group's scores over a query's complete blocks sum to G (a softmax per head).
    done = (np.arange(T // LP)[None, :] + 1) * LP <= np.arange(T)[:, None] + 1
    np.testing.assert_allclose(a.sum(-1)[:, done.any(-1)], G, rtol=1e-5)


def test_selection_under_a_query_offset_equals_the_whole_sequence():
    """Queries T/2.. at q_offset T/2 against the whole sequence's keys: the rows of the whole selection."""
    q, k = _qk(4)
    kw = dict(lp=LP, n=4, sub=4, query_chunk=16)
    whole = np.asarray(select_minmax_xla(jnp.asarray(q), jnp.asarray(k), **kw))
    part = jax.jit(lambda o: select_minmax_xla(jnp.asarray(q[:, T // 2 :]), jnp.asarray(k), q_offset=o, **kw))
    np.testing.assert_array_equal(np.asarray(part(jnp.int32(T // 2))), whole[:, T // 2 :])


def _minmax_scores_f64(q, k, lp, sub, offset=0):
    """[B, T, K, Nb] float64 minmax scores written out in numpy (the module docstring of kernels/scorers.py)."""
    b, t, h, d = q.shape
    kvh = k.shape[2]
    nb = -(-k.shape[1] // lp)
    kk = np.zeros((b, nb * lp, kvh, d))
    kk[:, : k.shape[1]] = k
    kk = kk.reshape(b, nb * lp // sub, sub, kvh, d)
    kmin, kmax = kk.min(2), kk.max(2)
    qg = q.astype(np.float64).reshape(b, t, kvh, h // kvh, d)
    ub = np.einsum("btkgd,bukd->btkgu", np.maximum(qg, 0), kmax) + np.einsum(
        "btkgd,bukd->btkgu", np.minimum(qg, 0), kmin
    )
    logit = ub.reshape(*ub.shape[:-1], nb, lp // sub).max(-1) / np.sqrt(d)
    pos = np.arange(t) + offset
    done = ((np.arange(nb)[None, :] + 1) * lp <= pos[:, None] + 1)[None, :, None, None, :]
    e = np.where(done, np.exp(logit - np.where(done, logit, -np.inf).max(-1, keepdims=True)), 0.0)
    p = e / np.maximum(e.sum(-1, keepdims=True), 1e-300)
    return np.where(done.any(-1, keepdims=True), p, 0.0).sum(3)


@pytest.mark.parametrize(
    "t,g,kvh,dk,lp,n,sub,offset,dtype",
    [
        (150, 3, 2, 16, 16, 5, 4, 0, jnp.float32),
        (100, 6, 1, 24, 16, 4, 16, 37, jnp.float32),  # a traced query offset; dk padded to 32
        pytest.param(200, 2, 2, 32, 32, 5, 8, 0, jnp.bfloat16, marks=pytest.mark.slow),
    ],
)
def test_the_fused_minmax_kernel_matches_float64(t, g, kvh, dk, lp, n, sub, offset, dtype):
    """kernels/minmax_pallas.py (interpreted on a CPU, compiled through Triton on a GPU) against the
    float64 scores on every row without a near-tie at the cut, and against the XLA path on the same rows."""
    from nsa_jax.kernels.block_scores_pallas import BlockSelectSizes
    from nsa_jax.kernels.minmax_pallas import select_minmax_pallas
    from nsa_jax.kernels.reference import reference_block_selection

    rng = np.random.default_rng(t + g)
    keys = offset + t
    q = jnp.asarray(rng.standard_normal((1, t, g * kvh, dk)), jnp.float32).astype(dtype)
    k = jnp.asarray(rng.standard_normal((1, keys, kvh, dk)), jnp.float32).astype(dtype)
    kw = dict(lp=lp, n=n, sub=sub)
    off = jnp.int32(offset) if offset else 0
    got = np.asarray(
        jax.jit(
            lambda q, k, o: select_minmax_pallas(
                q, k, interpret=INTERPRET, select_sizes=BlockSelectSizes(16, 16), q_offset=o, **kw
            )
        )(q, k, off)  # fmt: skip
    )
    want = _minmax_scores_f64(np.asarray(q, np.float64), np.asarray(k, np.float64), lp, sub, offset)
    ref_idx, clear = reference_block_selection(want, lp, n, tol=1e-4 * g, offset=offset)
    assert clear.mean() > 0.9 and (ref_idx >= 0).sum(-1).max() == n
    np.testing.assert_array_equal(got[clear], ref_idx[clear])
    xla = np.asarray(select_minmax_xla(q, k, q_offset=off, **kw))
    np.testing.assert_array_equal(got[clear], xla[clear])


def _rescore_f64(q, k, cand, lp, offset):
    """[B, T, K, M] float64: rescore's second-stage mass of every candidate (the module docstring of
    kernels/scorers.py), per query row at position r + offset, loop by loop."""
    B, T, H, D = q.shape
    K = k.shape[2]
    G = H // K
    out = np.zeros(cand.shape)
    for b in range(B):
        for r in range(T):
            t = r + offset
            for kv in range(K):
                keys = [(m, p) for m, j in enumerate(cand[b, r, kv]) if j >= 0 for p in range(j * lp, (j + 1) * lp)]
                keys = [(m, p) for m, p in keys if p <= t and p < k.shape[1]]
                for g in range(G):
                    s = np.array([q[b, r, kv * G + g] @ k[b, p, kv] for _, p in keys]) / np.sqrt(D)
                    e = np.exp(s - s.max())
                    for (m, _), w in zip(keys, e / e.sum()):
                        out[b, r, kv, m] += w
    return out


@pytest.mark.parametrize(
    "t,g,kvh,dk,lp,n,m,offset,dtype",
    [
        (90, 3, 2, 16, 16, 4, 6, 0, jnp.float32),
        (70, 6, 1, 24, 16, 3, 5, 29, jnp.float32),  # a traced query offset; dk padded to 32; M not a power of 2
        pytest.param(120, 2, 2, 32, 32, 4, 8, 0, jnp.bfloat16, marks=pytest.mark.slow),
    ],
)
def test_the_rescore_kernel_matches_float64(t, g, kvh, dk, lp, n, m, offset, dtype):
    """kernels/rescore_pallas.py (interpreted on a CPU, compiled through Triton on a GPU) and the XLA path
    against the float64 masses on every row without a near-tie at the cut: the forced blocks first, then
    the candidates of most mass; unused candidates (-1) and rows with fewer valid than n give -1."""
    from nsa_jax.kernels.rescore_pallas import select_rescore_pallas
    from nsa_jax.kernels.scorers import select_rescore_xla

    rng = np.random.default_rng(t + g)
    keys = offset + t
    q = jnp.asarray(rng.standard_normal((1, t, g * kvh, dk)), jnp.float32).astype(dtype)
    k = jnp.asarray(rng.standard_normal((1, keys, kvh, dk)), jnp.float32).astype(dtype)
    scores = jnp.asarray(rng.random((1, t, kvh, -(-keys // lp))), jnp.float32)
    cand = np.array(select_blocks(scores, lp, m, offset + jnp.arange(t)))  # cmp's stand-in, forced first
    cand[0, ::7, :, -1] = -1  # some rows hand over a candidate fewer
    off = jnp.int32(offset) if offset else 0
    got = np.asarray(
        jax.jit(lambda q, k, c, o: select_rescore_pallas(q, k, c, lp=lp, n=n, interpret=INTERPRET, q_offset=o))(
            q, k, jnp.asarray(cand), off
        )
    )
    xla = np.asarray(select_rescore_xla(q, k, jnp.asarray(cand), lp=lp, n=n, q_offset=off))
    mass = _rescore_f64(np.asarray(q, np.float64), np.asarray(k, np.float64), cand, lp, offset)
    want = -np.ones(got.shape, np.int64)
    clear = np.ones(got.shape[:3], bool)
    for r in range(t):
        for kv in range(kvh):
            c = cand[0, r, kv]
            cur = (r + offset) // lp
            forced = [i for i, j in enumerate(c) if j >= 0 and j in (0, cur, cur - 1)]
            rest = sorted((i for i, j in enumerate(c) if j >= 0 and i not in forced), key=lambda i: -mass[0, r, kv, i])
            order = forced + rest
            want[0, r, kv, : min(n, len(order))] = c[order][:n]
            if len(rest) > n - len(forced) > 0:  # a cut among the free candidates: is it clear?
                cut = n - len(forced)
                clear[0, r, kv] = abs(mass[0, r, kv, rest[cut - 1]] - mass[0, r, kv, rest[cut]]) > 1e-4 * g
    assert clear.mean() > 0.9 and (want >= 0).sum(-1).max() == n and (want < 0).any()
    np.testing.assert_array_equal(np.sort(got[clear], -1), np.sort(want[clear], -1))
    np.testing.assert_array_equal(got[clear], xla[clear])
