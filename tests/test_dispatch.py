"""Kernel dispatch: what `attention_impl` resolves to, and that each branch's entry point runs it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import compressed_visible, reference_attention, reference_group_probs

from nsa_jax.kernels import compressed_attention, describe_impl, resolve_impl, selection_kernel
from nsa_jax.kernels.xla import num_compressed


@pytest.mark.parametrize(
    "impl,backend,expected",
    [("auto", "gpu", "pallas"), ("auto", "cpu", "xla"), ("xla", "gpu", "xla"), ("pallas", "cpu", "pallas")],
)
def test_resolve_impl(impl, backend, expected):
    assert resolve_impl(impl, backend) == expected


def test_describe_impl_names_every_branch():
    assert describe_impl("auto", "gpu") == {"cmp": "pallas-triton", "slc": "pallas-triton", "win": "pallas-triton"}
    assert describe_impl("auto", "cpu") == {"cmp": "xla-chunked", "slc": "xla-chunked", "win": "xla-chunked"}
    assert describe_impl("pallas", "cpu")["slc"] == "pallas-interpret"


def test_auto_keeps_selection_on_xla_when_the_kernel_cannot_take_the_blocks():
    assert describe_impl("auto", "gpu", block_size=8)["slc"] == "xla-chunked"
    assert describe_impl("auto", "gpu", block_size=48)["slc"] == "xla-chunked"
    assert describe_impl("auto", "gpu", block_size=64) == describe_impl("auto", "gpu")
    # Asked for explicitly, pallas stays pallas (and its argument check names the problem).
    assert describe_impl("pallas", "gpu", block_size=8)["slc"] == "pallas-triton"


def test_describe_impl_names_the_selection_kernel_when_it_knows_the_length():
    # T <= 2 n lp: the block-sparse flash kernel; longer: the gather kernel; xla stays xla.
    assert describe_impl("auto", "gpu", block_size=64, seq=2048, slots=16)["slc"] == "pallas-triton/blocksparse"
    assert describe_impl("auto", "gpu", block_size=64, seq=2049, slots=16)["slc"] == "pallas-triton/gather"
    assert describe_impl("auto", "cpu", block_size=64, seq=2048, slots=16)["slc"] == "xla-chunked"


def test_selection_kernel_named_in_the_config_wins_at_every_length():
    for seq in (2048, 65536):
        for name in ("blocksparse", "gather"):
            assert selection_kernel("auto", seq, 16, 64, backend="gpu", choice=name) == name
            assert describe_impl("auto", "gpu", block_size=64, seq=seq, slots=16, choice=name)["slc"].endswith(name)
    # XLA stays XLA whatever is named; an unknown name is one error naming the choices.
    assert selection_kernel("auto", 65536, 16, 64, backend="cpu", choice="gather") == "xla"
    with pytest.raises(ValueError, match="blocksparse, gather"):
        selection_kernel("auto", 65536, 16, 64, backend="gpu", choice="sparse")


def test_unknown_impl_is_rejected():
    with pytest.raises(ValueError, match="attention_impl"):
        resolve_impl("cuda", "gpu")


def _cmp_inputs(T=40, G=2, K=2, D=16, l=16, d=8, seed=0):
    rng = np.random.default_rng(seed)
    tc = num_compressed(T, l, d)
    q = jnp.asarray(rng.standard_normal((1, T, G * K, D)), jnp.float32)
    kc = jnp.asarray(rng.standard_normal((1, tc, K, D)), jnp.float32)
    vc = jnp.asarray(rng.standard_normal((1, tc, K, D)), jnp.float32)
    return q, kc, vc


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_compressed_attention_dispatch_matches_reference(impl):
    # Both implementations behind kernels.compressed_attention: output against the float64
    # per-token reference, block scores against the reference probabilities summed per block.
    T, G, K, l, d, lp = 40, 2, 2, 16, 8, 16
    q, kc, vc = _cmp_inputs(T, G, K, l=l, d=d)
    tc = kc.shape[1]
    o, scores = jax.jit(lambda *a: compressed_attention(*a, l=l, d=d, lp=lp, impl=impl, query_chunk=16))(q, kc, vc)
    vis = compressed_visible(l, d, tc)
    o_ref = reference_attention(q, kc, vc, None, vis)[0]
    np.testing.assert_allclose(np.asarray(o), o_ref, atol=1e-5)
    p_BxKxTxTc = reference_group_probs(q, kc, vis)
    n_blocks = -(-T // lp)
    want = np.zeros((1, T, K, n_blocks))
    for j in range(n_blocks):
        for i in range(tc):
            if i * d < (j + 1) * lp and i * d + l > j * lp:  # token i's span overlaps block j
                want[:, :, :, j] += p_BxKxTxTc[:, :, :, i].transpose(0, 2, 1)
    assert scores.shape == want.shape
    np.testing.assert_allclose(np.asarray(scores), want, atol=1e-5)


def test_compressed_attention_without_tokens_is_zero():
    q, kc, vc = _cmp_inputs(T=10, l=16, d=8)
    assert kc.shape[1] == 0
    o, scores = compressed_attention(q, kc, vc, l=16, d=8, lp=16, impl="pallas")
    assert o.shape == q.shape and not np.any(np.asarray(o))
    assert scores.shape == (1, 10, 2, 1) and not np.any(np.asarray(scores))
