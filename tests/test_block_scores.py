"""Block scoring and top-n selection kernels (kernels/block_scores_pallas.py).

* The top-n kernel over a given score tensor against select_blocks, bitwise:
  exact ties, all-equal rows, fewer candidates than n, T not a multiple of lp,
  shifted positions, several tilings.
* The fused kernels against the float64 per-token reference written from the spec
  (reference.reference_block_scores: each head's softmax over its visible
  compressed tokens, the group sum, the tokens overlapping each block): block scores within tolerance, and identical
  block indices on every row whose reference ranking has no near-tie within the
  selected slots; on constructed exact ties (repeating compressed keys, equal
  probabilities) identical indices on every row, and the same as the XLA path.
* CUDA lowering at the production shape: Triton kernels, no per-query score tensor.

Kernels run interpreted off-GPU.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import reference_block_scores, reference_block_selection

from nsa_jax.kernels import compressed_attention
from nsa_jax.kernels.block_scores_pallas import (
    BlockSelectSizes,
    compressed_attention_scores_pallas,
    compressed_attention_select_pallas,
    select_blocks_pallas,
)
from nsa_jax.kernels.xla import select_blocks
from nsa_jax.tools import aot

INTERPRET = jax.default_backend() not in ("gpu", "cuda")
SMALL = BlockSelectSizes(block_pos=16, block_blocks=16)


def random_qkv(rng, b, t, g, kvh, dk, l, d, dtype):
    tc = (t - l) // d + 1
    draw = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32).astype(dtype)  # noqa: E731
    return draw(b, t, g * kvh, dk), draw(b, tc, kvh, dk), draw(b, tc, kvh, dk)


# ---------------------------------------------------------------------------
# top-n over a given score tensor: bitwise select_blocks


def score_patterns(rng, t, kvh, nb):
    """[P, T, K, Nb] fp32: exact ties of several kinds, all-equal rows, distinct values, zeros."""
    shape = (t, kvh, nb)
    return np.stack(
        [
            rng.integers(0, 3, shape).astype(np.float32),  # many exact ties
            np.full(shape, 0.25, np.float32),  # every row one tie
            np.zeros(shape, np.float32),  # nothing visible yet
            rng.random(shape).astype(np.float32),  # no ties
            np.round(rng.random(shape) * 8).astype(np.float32) / 8,  # ties among fractions
            np.broadcast_to(np.arange(nb, dtype=np.float32) % 4, shape).copy(),  # periodic: ties far apart
            -rng.random(shape).astype(np.float32),  # negative scores stay above the -1e9 of non-candidates
        ]
    )


@pytest.mark.parametrize(
    "t,kvh,lp,n,sizes,offset",
    [
        pytest.param(77, 2, 4, 5, SMALL, 0, id="T77-lp4-n5-tiles16"),  # T not a multiple of lp, 2 block tiles
        pytest.param(64, 1, 16, 16, SMALL, 0, id="T64-lp16-n16-fewer-candidates"),  # Nb=4 < n
        pytest.param(200, 1, 8, 3, BlockSelectSizes(32, 16), 0, id="T200-lp8-n3"),
        pytest.param(50, 2, 4, 6, SMALL, 37, id="T50-lp4-n6-shifted-positions"),  # current block past Nb
        pytest.param(40, 1, 4, 1, SMALL, 0, id="T40-lp4-n1"),
    ],
)
def test_select_from_scores_equals_select_blocks(t, kvh, lp, n, sizes, offset):
    rng = np.random.default_rng(t + n)
    nb = math.ceil(t / lp)
    scores = jnp.asarray(score_patterns(rng, t, kvh, nb))
    t_T = jnp.arange(t, dtype=jnp.int32) + offset
    got = select_blocks_pallas(scores, lp, n, t_T, interpret=INTERPRET, select_sizes=sizes)
    want = select_blocks(scores, lp, n, t_T)
    assert got.shape == want.shape == (scores.shape[0], t, kvh, n) and got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # The float64 rules agree too (ties to the lower block, -1 for unused slots).
    ref, _ = reference_block_selection(np.asarray(scores, np.float64), lp, n, offset=offset)
    np.testing.assert_array_equal(np.asarray(got), ref)


# ---------------------------------------------------------------------------
# fused scoring against the float64 reference

# (batch, T, G, KV heads, head dim, l, d, lp, n, dtype, tiles)
FUSED_CASES = [
    pytest.param(1, 150, 6, 2, 32, 16, 8, 16, 4, jnp.float32, SMALL, id="G6-T150-l16-d8-lp16-f32"),
    pytest.param(2, 70, 1, 2, 16, 8, 4, 8, 3, jnp.float32, SMALL, id="G1-T70-l8-d4-lp8-f32", marks=pytest.mark.slow),
    pytest.param(1, 96, 16, 1, 16, 16, 16, 16, 3, jnp.float32, None, id="G16-T96-l16-d16-lp16-f32"),
    pytest.param(
        1, 200, 6, 1, 64, 32, 16, 32, 4, jnp.bfloat16, SMALL, id="G6-T200-l32-d16-lp32-bf16", marks=pytest.mark.slow
    ),
    pytest.param(
        1, 100, 16, 1, 32, 8, 4, 12, 5, jnp.bfloat16, SMALL, id="G16-T100-l8-d4-lp12-bf16", marks=pytest.mark.slow
    ),
]


# The attention output through cuDNN's fused kernel (XLA's attention off a GPU) and the scores from
# the separate log-sum-exp pass, in bf16 (cuDNN takes 16-bit inputs): G = 6, 16 and 1.
CUDNN_CASES = [c for c in FUSED_CASES if c.id in ("G6-T200-l32-d16-lp32-bf16", "G16-T100-l8-d4-lp12-bf16")] + [
    pytest.param(2, 70, 1, 2, 16, 8, 4, 8, 3, jnp.bfloat16, SMALL, id="G1-T70-l8-d4-lp8-bf16"),
]


@pytest.mark.parametrize(
    "b,t,g,kvh,dk,l,d,lp,n,dtype,sizes,attention",
    [pytest.param(*c.values, "flash", id=c.id, marks=c.marks) for c in FUSED_CASES]
    # cuDNN's G = 6 case runs in the fast tier (its flash twin in the slow one), the G = 16 in the slow.
    + [
        pytest.param(*c.values, "cudnn", id=f"{c.id}-cudnn", marks=c.marks if c.id.startswith("G16") else ())
        for c in CUDNN_CASES
    ],
)
def test_fused_scores_and_selection_match_float64_reference(b, t, g, kvh, dk, l, d, lp, n, dtype, sizes, attention):
    rng = np.random.default_rng(t * 3 + g)
    q, kc, vc = random_qkv(rng, b, t, g, kvh, dk, l, d, dtype)
    want = reference_block_scores(q.astype(jnp.float32), kc.astype(jnp.float32), l, d, lp)

    o_s, scores = jax.jit(
        lambda q, kc, vc: compressed_attention_scores_pallas(
            q, kc, vc, l=l, d=d, lp=lp, interpret=INTERPRET, select_sizes=sizes, attention=attention
        )
    )(q, kc, vc)
    assert scores.shape == want.shape and scores.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(scores), want, atol=2e-5 * g)

    o, idx = jax.jit(
        lambda q, kc, vc: compressed_attention_select_pallas(
            q, kc, vc, l=l, d=d, lp=lp, n=n, interpret=INTERPRET, select_sizes=sizes, attention=attention
        )
    )(q, kc, vc)
    ref_idx, clear = reference_block_selection(want, lp, n, tol=1e-4 * g)
    assert idx.shape == ref_idx.shape and idx.dtype == jnp.int32
    got = np.asarray(idx)
    assert clear.mean() > 0.9  # random inputs: near-ties are rare
    np.testing.assert_array_equal(got[clear], ref_idx[clear])
    # The XLA path (softmax probabilities, select_blocks) picks the same blocks on those rows.
    o_x, xla_idx = compressed_attention(q, kc, vc, l=l, d=d, lp=lp, impl="xla", select_n=n)
    np.testing.assert_array_equal(got[clear], np.asarray(xla_idx)[clear])
    # Attention output: the same computation whether the blocks or the scores are asked for.
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_s))
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_x, np.float32), atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "t,g,l,d,lp,n,groups,dtype",
    [
        pytest.param(150, 6, 16, 8, 16, 5, 1, jnp.float32, id="G6-one-tie-group-f32"),
        pytest.param(150, 1, 16, 8, 16, 6, 2, jnp.float32, id="G1-two-tie-groups-f32"),
        pytest.param(120, 16, 8, 4, 8, 4, 2, jnp.bfloat16, id="G16-two-tie-groups-bf16", marks=pytest.mark.slow),
    ],
)
def test_fused_selection_exact_ties(t, g, l, d, lp, n, groups, dtype):
    """Compressed keys repeating every groups * lp/d tokens: blocks whose windows hold the same keys tie exactly.

    groups=1: every full block holds the same keys (one tie group); groups=2: even and odd
    blocks form two tie groups. Every row must then match the reference, whose sums of
    equal terms in a fixed order tie exactly too, and the XLA path.
    """
    rng = np.random.default_rng(groups * 11 + g)
    kvh, dk = 1, 16
    tc = (t - l) // d + 1
    base = rng.standard_normal((groups * lp // d, kvh, dk))
    kc = jnp.asarray(base[np.arange(tc) % base.shape[0]][None], jnp.float32).astype(dtype)
    q = jnp.asarray(rng.standard_normal((1, t, g * kvh, dk)), jnp.float32).astype(dtype)
    vc = jnp.ones_like(kc)
    _, idx = compressed_attention_select_pallas(
        q, kc, vc, l=l, d=d, lp=lp, n=n, interpret=INTERPRET, select_sizes=SMALL
    )
    want = reference_block_scores(q.astype(jnp.float32), kc.astype(jnp.float32), l, d, lp)
    ref_idx, _ = reference_block_selection(want, lp, n)
    np.testing.assert_array_equal(np.asarray(idx), ref_idx)
    _, xla_idx = compressed_attention(q, kc, vc, l=l, d=d, lp=lp, impl="xla", select_n=n)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(xla_idx))
    # The test means something: late rows rank several exactly tied candidates.
    row = want[0, -1, 0]
    cands = row[1 : (t - 1) // lp - 1]
    assert cands.size >= 3 and np.unique(cands).size < cands.size


def test_fused_selection_with_positions_and_no_visible_token():
    """t_T as select_blocks' positions; T < l (no compressed token) gives the XLA path's forced blocks."""
    rng = np.random.default_rng(3)
    b, t, g, kvh, dk, l, d, lp, n = 1, 60, 2, 2, 16, 8, 4, 8, 4
    q, kc, vc = random_qkv(rng, b, t, g, kvh, dk, l, d, jnp.float32)
    t_T = jnp.arange(t, dtype=jnp.int32) + 5
    _, idx = compressed_attention_select_pallas(
        q, kc, vc, l=l, d=d, lp=lp, n=n, t_T=t_T, interpret=INTERPRET, select_sizes=SMALL
    )
    want = reference_block_scores(q, kc, l, d, lp)
    ref, clear = reference_block_selection(want, lp, n, tol=1e-4, offset=5)
    assert clear.mean() > 0.9
    np.testing.assert_array_equal(np.asarray(idx)[clear], ref[clear])
    # Without select_n the Pallas path returns the block scores (from the same kernel body).
    _, scores = compressed_attention(q, kc, vc, l=l, d=d, lp=lp, impl="pallas")
    np.testing.assert_allclose(np.asarray(scores), want, atol=1e-5 * g)

    short = q[:, : l - 1]
    o, idx = compressed_attention(short, kc[:, :0], vc[:, :0], l=l, d=d, lp=lp, impl="pallas", select_n=n)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(select_blocks(jnp.zeros((1, l - 1, kvh, 1)), lp, n)))
    assert np.all(np.asarray(o) == 0)


def test_rejects_bad_arguments():
    q, kc = jnp.zeros((1, 32, 4, 16)), jnp.zeros((1, 3, 2, 16))
    with pytest.raises(ValueError, match="must divide"):
        compressed_attention_select_pallas(q, kc, kc, l=8, d=3, lp=9, n=2, interpret=INTERPRET)
    with pytest.raises(ValueError, match="n=0"):
        compressed_attention_select_pallas(q, kc, kc, l=8, d=4, lp=8, n=0, interpret=INTERPRET)
    with pytest.raises(ValueError, match="block_blocks"):
        select_blocks_pallas(jnp.zeros((1, 32, 2, 4)), 8, 2, select_sizes=BlockSelectSizes(16, 24))
    with pytest.raises(ValueError, match="t_T"):
        select_blocks_pallas(jnp.zeros((1, 32, 2, 4)), 8, 2, jnp.arange(5))


# ---------------------------------------------------------------------------
# CUDA lowering at the production shape (no GPU needed)


def test_select_lowers_to_triton_for_cuda_at_production_shape():
    b, t, h, kvh, dk, l, d, lp, n = 1, 65536, 12, 2, 64, 32, 16, 64, 16
    tc = (t - l) // d + 1
    sds = jax.ShapeDtypeStruct
    args = [sds((b, t, h, dk), jnp.bfloat16), sds((b, tc, kvh, dk), jnp.bfloat16), sds((b, tc, kvh, dk), jnp.bfloat16)]

    def both(q, kc, vc):
        return compressed_attention_select_pallas(q, kc, vc, l=l, d=d, lp=lp, n=n)

    def loss(q, kc, vc):
        o, idx = both(q, kc, vc)
        return o.astype(jnp.float32).sum(), idx

    grad = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)
    for fn, kernels in ((both, 2), (grad, 4)):  # attention + selection; + the attention's dq and dk/dv
        text = aot.export_for_cuda(fn, *args).mlir_module()
        assert text.count(aot.TRITON_TARGET) == kernels
        # No per-query probability or score tensor: nothing with a T axis and a T_cmp or T/lp axis.
        assert not re.search(rf"\b{t}x({tc}|{tc + 1}|{t // lp})x", text)
        assert f"{b}x{t}x{kvh}x{n}xi32" in text or f"{b}x{kvh}x{t}x{n}xi32" in text


def test_scoring_tiles_fit_the_a100_budget_or_say_so():
    from nsa_jax.kernels.block_scores_pallas import BlockSelectSizes, fit_select_sizes, select_smem_estimates
    from nsa_jax.kernels.pallas_common import SMEM_BUDGET_BYTES

    default = BlockSelectSizes()
    # fp32 with a 512-wide head: the default tiles are over budget, so they shrink until they fit.
    assert select_smem_estimates(default, 512, 4)["nsa_block_scores"] > SMEM_BUDGET_BYTES
    fitted = fit_select_sizes(None, 512, 4)
    assert select_smem_estimates(fitted, 512, 4)["nsa_block_scores"] <= SMEM_BUDGET_BYTES
    assert fitted.block_blocks < default.block_blocks
    assert fit_select_sizes(None, 64, 2) == default  # the production case keeps the default
    # An explicit tiling over budget is refused at trace time, naming the kernel and the knobs.
    q = jnp.zeros((1, 64, 2, 64), jnp.float32)
    kc = jnp.zeros((1, 7, 1, 64), jnp.float32)
    with pytest.raises(ValueError, match=r"nsa_block_scores.*A100.*block_pos / block_blocks"):
        compressed_attention_select_pallas(
            q, kc, kc, l=16, d=8, lp=16, n=2, interpret=True, select_sizes=BlockSelectSizes(512, 512)
        )
