"""The block scorers' own properties (nsa_jax/kernels/scorers.py), against numpy; the layer with each
scorer is held to the float64 per-token reference in test_nsa_layer.py, decode in test_inference.py,
context parallelism in test_context.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nsa_jax.kernels.scorers import bound_block_logits, key_bounds, minmax_block_scores, select_minmax_xla

B, T, K, G, D, LP = 2, 96, 2, 3, 8, 16


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
