"""Tests of the block-sparse selection kernels (nsa_jax.kernels.blocksparse_pallas) and their dispatch.

Forward and backward (dq, dk, dv through ``jax.vjp`` with a random cotangent)
against the independent float64 per-token reference (nsa_jax.kernels.reference),
which builds each query's visible keys straight from its block indices. The
kernels run in the Pallas interpreter on CPU (``INTERPRET``) and compiled on a
GPU; the lowering tests export them for CUDA at the production shapes without one.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import random_block_indices, reference_attention, selection_visible, window_visible

from nsa_jax import kernels
from nsa_jax.config import NSAConfig
from nsa_jax.kernels import blocksparse_pallas, flash_pallas
from nsa_jax.kernels.blocksparse_pallas import (
    BLOCKSPARSE_MAX_SEQ_RATIO,
    prefers_blocksparse,
    selection_attention_blocksparse_pallas,
)
from nsa_jax.kernels.flash_pallas import FlashBlockSizes
from nsa_jax.kernels.pallas_common import SMEM_BUDGET_BYTES
from nsa_jax.tools import aot

from helpers import as_f32, check_all, random_inputs, run_with_grads

INTERPRET = jax.default_backend() not in ("gpu", "cuda")


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def skewed_block_indices(rng, b, t, kvh, n, lp, *, always=0, never=1):
    """Selections where block ``always`` is in every row, block ``never`` in none, other slots
    random distinct blocks (past or future ones) or -1, in random slot order."""
    nb = -(-t // lp)
    idx = -np.ones((b, t, kvh, n), np.int32)
    others = [j for j in range(nb) if j not in (always, never)]
    for bi in range(b):
        for ti in range(t):
            for ki in range(kvh):
                rng.shuffle(others)
                row = [always] + others[: rng.integers(0, n)]
                row += [-1] * (n - len(row))
                rng.shuffle(row)
                idx[bi, ti, ki] = row
    return idx


def check_against_reference(b, t, g, kvh, d, lp, n, dtype, idx, *, bsz=None, scale=None, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v, do = random_inputs(rng, b, t, g * kvh, kvh, d, dtype)

    def fn(q, k, v):
        return selection_attention_blocksparse_pallas(
            q, k, v, jnp.asarray(idx), lp, scale, interpret=INTERPRET, block_sizes=bsz
        )

    results = run_with_grads(fn, q, k, v, do)
    reference = reference_attention(*as_f32(q, k, v, do), selection_visible(idx, lp, t), scale or d**-0.5)
    check_all(results, reference, dtype)
    return results


# ---------------------------------------------------------------------------
# Parity with the float64 reference
# ---------------------------------------------------------------------------

# (batch, T, G, KV heads, head dim, lp, n, dtype, tiles)
CASES = [
    pytest.param(2, 45, 1, 2, 32, 16, 3, jnp.float32, FlashBlockSizes(16, 16, 16, 16), id="G1-d32-T45-f32"),
    pytest.param(1, 70, 6, 2, 64, 16, 4, jnp.float32, None, id="G6-d64-T70-f32-default-tiles"),
    pytest.param(1, 40, 16, 1, 32, 16, 3, jnp.float32, FlashBlockSizes(32, 16, 16, 64), id="G16-d32-T40-f32"),
    pytest.param(1, 100, 6, 2, 64, 16, 5, jnp.bfloat16, None, id="G6-d64-T100-bf16", marks=pytest.mark.slow),
    # Key tiles of 16 in blocks of 32: two tiles per block, both masked by the same block id.
    pytest.param(
        1,
        75,
        16,
        1,
        32,
        32,
        2,
        jnp.bfloat16,
        FlashBlockSizes(16, 16, 16, 16),
        id="G16-d32-lp32-tile16-bf16",
        marks=pytest.mark.slow,
    ),
    pytest.param(1, 53, 1, 2, 64, 32, 2, jnp.bfloat16, FlashBlockSizes(64, 32, 32, 16), id="G1-d64-lp32-bf16"),
    pytest.param(1, 9, 6, 1, 32, 16, 2, jnp.float32, None, id="G6-T9-shorter-than-a-block-f32"),
]


@pytest.mark.parametrize("b,t,g,kvh,d,lp,n,dtype,bsz", CASES)
def test_blocksparse_matches_reference(b, t, g, kvh, d, lp, n, dtype, bsz):
    # Ragged T (not a multiple of lp nor of the row tiles), -1 slots anywhere, n not a power of two.
    rng = np.random.default_rng(t * 131 + g)
    idx = random_block_indices(rng, b, t, kvh, n, lp)
    assert (idx == -1).any()  # T = 9: one block, the other slot unused
    check_against_reference(b, t, g, kvh, d, lp, n, dtype, idx, bsz=bsz, seed=t + g)


@pytest.mark.parametrize(
    "dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)], ids=["f32", "bf16"]
)
@pytest.mark.parametrize("g", [1, 6, 16])
def test_blocksparse_block_chosen_by_every_query_and_by_none(g, dtype):
    # Block 0 in every row, block 1 in none, -1 slots, future blocks (selected, never visible).
    b, t, d, lp, n = 1, 61, 32, 16, 3
    kvh = 2 if g < 16 else 1
    rng = np.random.default_rng(100 + g)
    idx = skewed_block_indices(rng, b, t, kvh, n, lp)
    assert (idx == -1).any() and not (idx == 1).any() and (idx == 0).any(axis=-1).all()
    _, _, dk, dv = check_against_reference(
        b, t, g, kvh, d, lp, n, dtype, idx, bsz=FlashBlockSizes(16, 16, 16, 16), seed=g
    )
    np.testing.assert_array_equal(dk[:, lp : 2 * lp], 0.0)  # chosen by no query
    np.testing.assert_array_equal(dv[:, lp : 2 * lp], 0.0)


def test_blocksparse_custom_scale_and_rows_that_see_nothing():
    b, t, g, kvh, d, lp, n = 1, 40, 2, 1, 32, 16, 3
    rng = np.random.default_rng(3)
    idx = random_block_indices(rng, b, t, kvh, n, lp)
    idx[0, 5] = -1  # no slot used
    idx[0, 3] = [1, -1, -1]  # only a future block: masked by p <= t
    idx[0, 30] = [7, -1, 2]  # an id past the last block sees nothing
    o, dq, _, _ = check_against_reference(b, t, g, kvh, d, lp, n, jnp.float32, idx, scale=0.3, seed=4)
    for row in (3, 5):
        np.testing.assert_array_equal(o[0, row], 0.0)
        np.testing.assert_array_equal(dq[0, row], 0.0)


def test_tiles_no_row_selected_are_never_loaded():
    # NaN keys and values in a block that no query selects (and in one that only earlier
    # queries select, as a future block): a tile that were loaded and masked would still
    # turn the products NaN (0 * NaN), so finite results show every kernel skips them.
    b, t, g, kvh, d, lp, n = 1, 64, 6, 1, 32, 16, 2
    rng = np.random.default_rng(8)
    q, k, v, do = random_inputs(rng, b, t, g * kvh, kvh, d, jnp.float32)
    idx = np.zeros((b, t, kvh, n), np.int32)
    idx[..., 1] = -1
    idx[0, :16, 0, 1] = 2  # block 2 (positions 32..47) only as a future block of queries 0..15
    idx[0, 48:, 0, 1] = 3  # block 3: the current block of queries 48..63
    poisoned = np.zeros((b, t, kvh, d), bool)
    poisoned[:, 16:48] = True  # block 1 (no query) and block 2 (no query that can see it)
    k = jnp.where(poisoned, jnp.nan, k)
    v = jnp.where(poisoned, jnp.nan, v)
    bsz = FlashBlockSizes(16, 16, 16, 16)
    fn = lambda q, k, v: selection_attention_blocksparse_pallas(  # noqa: E731
        q, k, v, jnp.asarray(idx), lp, interpret=INTERPRET, block_sizes=bsz
    )
    results = run_with_grads(fn, q, k, v, do)
    for x in results:
        assert np.all(np.isfinite(x))
    k_ref, v_ref = (jnp.where(poisoned, 0.0, x) for x in (k, v))
    reference = reference_attention(*as_f32(q, k_ref, v_ref, do), selection_visible(idx, lp, t), d**-0.5)
    check_all(results, reference, jnp.float32)


@pytest.mark.parametrize(
    "g,splits,dtype",
    [(6, 1, jnp.float32), (6, 4, jnp.float32), (1, 3, jnp.bfloat16), (16, None, jnp.float32)],
    ids=["G6-one-program", "G6-4-splits", "G1-3-splits-bf16", "G16-default-splits"],
)
def test_dkv_splits_match_the_reference(g, splits, dtype):
    # dK/dV programs per key tile: one (in place), several (fp32 parts summed afterwards; runs of
    # row tiles that do not divide evenly, and empty runs for the last key tiles), the default (G).
    b, t, d, lp, n = 1, 50, 32, 16, 2
    kvh = 2 if g < 16 else 1
    rng = np.random.default_rng(300 + g)
    idx = random_block_indices(rng, b, t, kvh, n, lp)
    bsz = FlashBlockSizes(16, 16, 16, 16, dkv_splits=splits)
    check_against_reference(b, t, g, kvh, d, lp, n, dtype, idx, bsz=bsz, seed=g)


def test_window_takes_dkv_splits_too():
    # The layout-only engine (window branch) with split dK/dV programs: same contract.
    b, t, g, kvh, d, w = 1, 45, 3, 1, 32, 9
    rng = np.random.default_rng(12)
    q, k, v, do = random_inputs(rng, b, t, g * kvh, kvh, d, jnp.float32)
    bsz = FlashBlockSizes(16, 16, 16, 16, dkv_splits=3)
    fn = lambda q, k, v: flash_pallas.window_attention_pallas(  # noqa: E731
        q, k, v, w, interpret=INTERPRET, block_sizes=bsz
    )
    results = run_with_grads(fn, q, k, v, do)
    reference = reference_attention(*as_f32(q, k, v, do), window_visible(w), d**-0.5)
    check_all(results, reference, jnp.float32)


# ---------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------


def test_threshold_is_twice_the_selected_keys():
    assert BLOCKSPARSE_MAX_SEQ_RATIO == 2
    assert prefers_blocksparse(2048, 16, 64) and not prefers_blocksparse(2049, 16, 64)

    def slc(impl, seq, lp, backend):
        return kernels.plan_kernels(NSAConfig(attention_impl=impl, n=16, lp=lp), seq, backend).slc

    assert slc("pallas", 2048, 64, "cpu") == "blocksparse"
    assert slc("auto", 2048, 64, "gpu") == "blocksparse"
    assert slc("auto", 4096, 64, "gpu") == "gather"
    assert slc("auto", 2048, 64, "cpu") == "xla"
    assert slc("xla", 64, 64, "gpu") == "xla"
    # auto keeps a block length the Pallas kernels cannot take on XLA, at any T.
    assert slc("auto", 64, 8, "gpu") == "xla"


@pytest.mark.parametrize("t,expected", [(64, "blocksparse"), (65, "gather")])
def test_selection_attention_dispatches_on_length(monkeypatch, t, expected):
    # n = 2 blocks of 16: T = 64 = 2 n lp takes the block-sparse kernel, T = 65 the gather kernel.
    b, g, kvh, d, lp, n = 1, 2, 1, 32, 16, 2
    rng = np.random.default_rng(t)
    q, k, v, do = random_inputs(rng, b, t, g * kvh, kvh, d, jnp.float32)
    idx = random_block_indices(rng, b, t, kvh, n, lp)
    calls = []

    def spy(name, fn):
        def wrapped(*a, **kw):
            calls.append(name)
            return fn(*a, **kw)

        return wrapped

    monkeypatch.setattr(
        kernels,
        "selection_attention_blocksparse_pallas",
        spy("blocksparse", kernels.selection_attention_blocksparse_pallas),
    )
    monkeypatch.setattr(kernels, "selection_attention_pallas", spy("gather", kernels.selection_attention_pallas))
    kernel = kernels.plan_kernels(NSAConfig(attention_impl="pallas", n=n, lp=lp), t, "cpu").slc
    fn = lambda q, k, v: kernels.selection_attention(q, k, v, jnp.asarray(idx), lp, kernel=kernel)  # noqa: E731
    results = run_with_grads(fn, q, k, v, do)
    assert kernel == expected and set(calls) == {expected}
    reference = reference_attention(*as_f32(q, k, v, do), selection_visible(idx, lp, t), d**-0.5)
    check_all(results, reference, jnp.float32)


# ---------------------------------------------------------------------------
# GPU lowering (no GPU needed)
# ---------------------------------------------------------------------------

# configs/a100_pcie.yaml: 12 heads, 2 KV heads, head dim 64, lp = 64, n = 16, T = 2048, bf16.
PROD = dict(b=1, t=2048, h=12, kvh=2, d=64, lp=64, n=16)


def _export_text(fn, *args):
    """StableHLO of `fn` exported for CUDA, the Pallas kernels lowered for a card (no GPU needed here)."""
    return aot.export_for_cuda(fn, *args).mlir_module()


def _prod_args(t=PROD["t"], lp=PROD["lp"]):
    p, sds = PROD, jax.ShapeDtypeStruct
    return [
        sds((p["b"], t, p["h"], p["d"]), jnp.bfloat16),
        sds((p["b"], t, p["kvh"], p["d"]), jnp.bfloat16),
        sds((p["b"], t, p["kvh"], p["d"]), jnp.bfloat16),
        sds((p["b"], t, p["kvh"], p["n"]), jnp.int32),
    ]


def _grad(fwd):
    return jax.grad(lambda q, k, v, i: fwd(q, k, v, i).astype(jnp.float32).sum(), argnums=(0, 1, 2))


def test_blocksparse_lowers_to_triton_for_cuda_at_production_shapes():
    lp = PROD["lp"]
    fwd = lambda q, k, v, i: selection_attention_blocksparse_pallas(q, k, v, i, lp)  # noqa: E731
    fwd_text = _export_text(fwd, *_prod_args())
    grad_text = _export_text(_grad(fwd), *_prod_args())
    # forward: 1 kernel; gradient: forward + dq + dk/dv, and no reverse index (no sort, no scatter).
    assert fwd_text.count(aot.TRITON_TARGET) == 1
    assert grad_text.count(aot.TRITON_TARGET) == 3
    for text in (fwd_text, grad_text):
        assert not re.search(r"\b2048x2048x", text)  # no T x T tensor
        assert "stablehlo.sort" not in text and "stablehlo.scatter" not in text
    # Key tiles shorter than the block (lp = 128 with the default tiles of 64) lower too.
    fwd128 = lambda q, k, v, i: selection_attention_blocksparse_pallas(q, k, v, i, 128)  # noqa: E731
    assert _export_text(_grad(fwd128), *_prod_args()).count(aot.TRITON_TARGET) == 3


@pytest.mark.parametrize(
    "t,h,kvh,d,n,lp,dtype",
    [(300, 2, 2, 32, 1, 16, jnp.float32), (100, 16, 1, 48, 3, 32, jnp.float32), (999, 6, 1, 128, 5, 16, jnp.bfloat16)],
    ids=["G1-n1-f32", "G16-d48-f32", "G6-d128-ragged-bf16"],
)
def test_blocksparse_lowers_at_other_shapes(t, h, kvh, d, n, lp, dtype):
    # One slot (an [R, 1] id tile), a head dim padded to 64, ragged T, tiles shrunk for d = 128.
    sds = jax.ShapeDtypeStruct
    args = [sds((1, t, h, d), dtype), sds((1, t, kvh, d), dtype), sds((1, t, kvh, d), dtype)]
    args.append(sds((1, t, kvh, n), jnp.int32))
    fwd = lambda q, k, v, i: selection_attention_blocksparse_pallas(q, k, v, i, lp)  # noqa: E731
    assert _export_text(_grad(fwd), *args).count(aot.TRITON_TARGET) == 3


@pytest.mark.parametrize("t,kernel_name", [(2048, "nsa_selection_bsp"), (4096, "nsa_selection_dkv")])
def test_dispatch_lowers_the_chosen_kernel(t, kernel_name):
    lp = PROD["lp"]
    plan = kernels.plan_kernels(NSAConfig(attention_impl="pallas", n=PROD["n"], lp=lp), t, "gpu")
    # The plan of a GPU: the Triton lowering, not the interpreter.
    fwd = lambda q, k, v, i: kernels.selection_attention(q, k, v, i, lp, kernel=plan.slc, interpret=plan.interpret)  # noqa: E731
    text = _export_text(_grad(fwd), *_prod_args(t))
    assert kernel_name in text
    other = "nsa_selection_dkv" if kernel_name == "nsa_selection_bsp" else "nsa_selection_bsp"
    assert other not in text


# ---------------------------------------------------------------------------
# Tiles and the shared-memory budget (A100)
# ---------------------------------------------------------------------------


def test_oversized_or_misfit_tiles_are_refused_with_a_clear_message():
    q = jnp.zeros((1, 32, 2, 128), jnp.bfloat16)
    k = jnp.zeros((1, 32, 1, 128), jnp.bfloat16)
    idx = jnp.zeros((1, 32, 1, 2), jnp.int32)
    big = FlashBlockSizes(256, 256, 256, 256)
    with pytest.raises(ValueError, match=r"flash (fwd|dq|dkv): .* KiB of shared memory, over the 163 KiB .*A100"):
        selection_attention_blocksparse_pallas(q, k, k, idx, 256, interpret=INTERPRET, block_sizes=big)
    with pytest.raises(ValueError, match=r"block_keys=32 is larger than the selection block lp=16"):
        selection_attention_blocksparse_pallas(
            q, k, k, idx, 16, interpret=INTERPRET, block_sizes=FlashBlockSizes(16, 32, 16, 16)
        )
    with pytest.raises(ValueError, match=r"block_size=24 must be a power of two"):
        selection_attention_blocksparse_pallas(q, k, k, idx, 24, interpret=INTERPRET)
    with pytest.raises(ValueError, match=r"dkv_splits=0 must be >= 1"):
        selection_attention_blocksparse_pallas(
            q, k, k, idx, 16, interpret=INTERPRET, block_sizes=FlashBlockSizes(dkv_splits=0)
        )
    with pytest.raises(ValueError, match=r"block indices"):
        selection_attention_blocksparse_pallas(q, k, k, idx[:, :16], 16, interpret=INTERPRET)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("d,lp", [(64, 64), (128, 16), (128, 256), (256, 64)])
def test_default_tiles_fit_the_budget_and_the_block(d, lp, dtype):
    itemsize = jnp.dtype(dtype).itemsize
    fitted = flash_pallas.fit_block_sizes(FlashBlockSizes(), d, d, itemsize, max_keys=lp)
    assert fitted.block_keys <= lp and fitted.block_keys_dkv <= lp
    assert max(flash_pallas.smem_estimates(fitted, d, d, itemsize).values()) <= SMEM_BUDGET_BYTES


def test_production_tiles_are_full_size():
    # bf16, head dim 64, lp = 64: tiles of 64 rows and 64 keys (one key tile per block).
    assert flash_pallas.fit_block_sizes(FlashBlockSizes(), 64, 64, 2, max_keys=64) == FlashBlockSizes(64, 64, 64, 64)
    assert blocksparse_pallas.prefers_blocksparse(PROD["t"], PROD["n"], PROD["lp"])
