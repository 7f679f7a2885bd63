"""Tests of the Pallas selection / window kernels.

The kernels run compiled through Triton on a GPU and in the Pallas interpreter
elsewhere (``INTERPRET``), and are checked, forward and backward (dq, dk, dv
through ``jax.vjp`` with a random cotangent), against an independent float64
numpy reference (nsa_jax.kernels.reference) that walks every query token and
builds its visible key set straight from the block indices or the window,
with the attention gradients written out by hand. A lowering test exports the
jitted forward and gradient for CUDA at the production shapes and checks that
they go through Triton kernels, without a GPU.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import (
    compressed_visible,
    random_block_indices,
    reference_attention,
    reference_compressed_lse2,
    selection_visible,
    window_visible,
)

from nsa_jax import kernels
from nsa_jax.kernels import flash_pallas, selection_pallas
from nsa_jax.kernels.compressed_pallas import (
    CompressedBlockSizes,
    compressed_attention_pallas,
    compressed_lse_pallas,
)
from nsa_jax.kernels.flash_pallas import FlashBlockSizes, window_attention_pallas
from nsa_jax.kernels.pallas_common import SMEM_BUDGET_BYTES
from nsa_jax.kernels.reverse_index import reverse_index, stable_positions
from nsa_jax.kernels.selection_pallas import SelectionBlockSizes, selection_attention_pallas
from nsa_jax.nsa.layer import NSAAttention
from nsa_jax.tools import aot

from helpers import as_f32, check_all, random_inputs, run_with_grads, tiny_model_cfg

# Compiled kernels on a GPU (JAX_PLATFORMS=cuda python -m pytest tests/test_kernels_pallas.py),
# the interpreter on CPU.
INTERPRET = jax.default_backend() not in ("gpu", "cuda")


# ---------------------------------------------------------------------------
# Selection
# ---------------------------------------------------------------------------

# (batch, T, G, KV heads, head dim, block size, n, dtype, block sizes)
SELECTION_CASES = [
    pytest.param(
        2,
        45,
        1,
        2,
        32,
        16,
        3,
        jnp.float32,
        SelectionBlockSizes(rows_dkv=16, dkv_segment=7),
        id="G1-d32-T45-f32-small-segments",
    ),
    pytest.param(1, 70, 6, 2, 64, 16, 4, jnp.float32, None, id="G6-d64-T70-f32"),
    pytest.param(
        1, 40, 16, 1, 128, 16, 3, jnp.float32, SelectionBlockSizes(rows_dkv=32, dkv_segment=16), id="G16-d128-T40-f32"
    ),
    pytest.param(2, 100, 6, 2, 64, 16, 5, jnp.bfloat16, None, id="G6-d64-T100-bf16"),
    pytest.param(1, 52, 16, 1, 32, 32, 2, jnp.bfloat16, None, id="G16-d32-T52-bs32-bf16"),
]


@pytest.mark.parametrize("b,t,g,kvh,d,bs,n,dtype,bsz", SELECTION_CASES)
def test_selection_matches_reference(b, t, g, kvh, d, bs, n, dtype, bsz):
    rng = np.random.default_rng(t * 131 + g)
    q, k, v, do = random_inputs(rng, b, t, g * kvh, kvh, d, dtype)
    idx = random_block_indices(rng, b, t, kvh, n, bs, shuffle=False)
    fn = lambda q, k, v: selection_attention_pallas(q, k, v, jnp.asarray(idx), bs, interpret=INTERPRET, block_sizes=bsz)
    results = run_with_grads(fn, q, k, v, do)
    reference = reference_attention(*as_f32(q, k, v, do), selection_visible(idx, bs, t), d**-0.5)
    check_all(results, reference, dtype)


def test_selection_unused_slots_anywhere_and_custom_scale():
    # -1 slots scattered among the used ones (not only at the end), a
    # non-default scale, and the first positions where few blocks exist.
    b, t, g, kvh, d, bs, n = 1, 50, 2, 2, 32, 16, 4
    rng = np.random.default_rng(7)
    q, k, v, do = random_inputs(rng, b, t, g * kvh, kvh, d, jnp.float32)
    idx = random_block_indices(rng, b, t, kvh, n, bs)
    assert (idx[:, :16] == -1).sum() > 0 and (idx[:, :, :, 0] == -1).any()
    fn = lambda q, k, v: selection_attention_pallas(q, k, v, jnp.asarray(idx), bs, 0.3, interpret=INTERPRET)
    results = run_with_grads(fn, q, k, v, do)
    reference = reference_attention(*as_f32(q, k, v, do), selection_visible(idx, bs, t), 0.3)
    check_all(results, reference, jnp.float32)


@pytest.mark.parametrize("bsz", [None, SelectionBlockSizes(positions=1, num_warps=1)], ids=["default", "one-position"])
def test_selection_fully_masked_rows_are_zero(bsz):
    b, t, g, kvh, d, bs, n = 1, 20, 1, 1, 32, 16, 3
    rng = np.random.default_rng(3)
    q, k, v, do = random_inputs(rng, b, t, g * kvh, kvh, d, jnp.float32)
    idx = random_block_indices(rng, b, t, kvh, n, bs, shuffle=False)
    idx[0, 5] = -1  # no slot used
    idx[0, 3] = [1, -1, -1]  # only a future block: masked by p <= t
    fn = lambda q, k, v: selection_attention_pallas(q, k, v, jnp.asarray(idx), bs, interpret=INTERPRET, block_sizes=bsz)
    o, dq, dk, dv = run_with_grads(fn, q, k, v, do)
    for x in (o, dq, dk, dv):
        assert np.all(np.isfinite(x))
    np.testing.assert_array_equal(o[0, 5], 0.0)
    np.testing.assert_array_equal(o[0, 3], 0.0)
    np.testing.assert_array_equal(dq[0, 5], 0.0)
    vis = selection_visible(idx, bs, t)
    reference = reference_attention(*as_f32(q, k, v, do), vis, d**-0.5)
    check_all((o, dq, dk, dv), reference, jnp.float32)


def test_selection_uneven_head_dims():
    # Dk != Dv, neither a power of two: padded inside, sliced on the way out.
    b, t, g, kvh, dk, dv, bs, n = 1, 36, 3, 1, 48, 24, 16, 3
    rng = np.random.default_rng(9)
    q, k, v, do = random_inputs(rng, b, t, g * kvh, kvh, dk, jnp.float32, dv)
    idx = random_block_indices(rng, b, t, kvh, n, bs, shuffle=False)
    fn = lambda q, k, v: selection_attention_pallas(q, k, v, jnp.asarray(idx), bs, interpret=INTERPRET)
    results = run_with_grads(fn, q, k, v, do)
    assert results[0].shape == (b, t, g * kvh, dv)
    reference = reference_attention(*as_f32(q, k, v, do), selection_visible(idx, bs, t), dk**-0.5)
    check_all(results, reference, jnp.float32)


@pytest.mark.parametrize("scan_elems", [1 << 22, 64], ids=["one-chunk", "many-chunks"])
@pytest.mark.parametrize("t,bs", [(37, 16), (203, 4)], ids=["one-digit", "two-digits"])
def test_reverse_index_segments_cover_every_entry(scan_elems, t, bs):
    # 3 blocks sort in one counting pass; 51 in two (digits of 15 and 4: stable_positions).
    rng = np.random.default_rng(11)
    b, kvh, n, seg = 2, 2, 4, 5
    idx = random_block_indices(rng, b, t, kvh, n, bs)
    # Off-contract rows too: a repeated block, ids past the last block, ids below -1.
    idx[0, 30, 0] = [1, 1, 7, -3]
    nb = -(-t // bs)
    rev = reverse_index(jnp.asarray(idx), nb, seg, scan_elems=scan_elems)
    qlist, seg_blk, seg_lo, seg_hi, first, count = map(np.asarray, rev)
    # The list is what a stable sort by block id (unused slots last) gives.
    flat = idx.transpose(0, 2, 1, 3).reshape(b, kvh, t * n)
    key = np.where((flat >= 0) & (flat < nb), flat, nb)
    np.testing.assert_array_equal(qlist, np.argsort(key, axis=-1, kind="stable") // n)
    for bi in range(b):
        for ki in range(kvh):
            for j in range(nb):
                want = sorted(ti for ti in range(t) for s in range(n) if idx[bi, ti, ki, s] == j)
                got = []
                for p in range(first[bi, ki, j], first[bi, ki, j] + count[bi, ki, j]):
                    assert seg_blk[bi, ki, p] == j
                    assert 0 < seg_hi[bi, ki, p] - seg_lo[bi, ki, p] <= seg
                    got.extend(qlist[bi, ki, seg_lo[bi, ki, p] : seg_hi[bi, ki, p]])
                assert got == want
            unused = seg_blk[bi, ki] == nb
            assert np.all(seg_lo[bi, ki][unused] == seg_hi[bi, ki][unused])


@pytest.mark.parametrize("n,num_keys", [(4, 51), (16, 2049)])
def teststable_positions_are_a_stable_sort_by_key(n, num_keys):
    # The two-digit counting sort against numpy's stable argsort, with chunked scans (scan_elems small).
    rng = np.random.default_rng(n * 7 + num_keys)
    b, kvh, t = 2, 2, 97
    key = rng.integers(0, num_keys, size=(b, kvh, t, n)).astype(np.int32)
    key[0, 0, :5] = num_keys - 1  # the largest key (unused slots) in runs
    pos = np.asarray(stable_positions(jnp.asarray(key), num_keys, 512))
    flat = key.reshape(b, kvh, t * n)
    order = np.argsort(flat, axis=-1, kind="stable")  # order[j]: the entry at sorted slot j
    want = np.empty_like(order)
    np.put_along_axis(want, order, np.arange(t * n)[None, None, :], axis=-1)
    np.testing.assert_array_equal(pos, want)


def _skewed_block_indices(rng, b, t, kvh, n, bs, never):
    """Selections where block 0 is chosen by every query, block ``never`` by none, some slots
    are -1 and some queries pick a block that starts after them (visible to no one)."""
    nb = -(-t // bs)
    idx = -np.ones((b, t, kvh, n), np.int32)
    for bi in range(b):
        for ti in range(t):
            for ki in range(kvh):
                others = [j for j in range(nb) if j not in (0, never)]
                rng.shuffle(others)
                row = [0] + others[: rng.integers(0, n)]
                row += [-1] * (n - len(row))
                rng.shuffle(row)
                idx[bi, ti, ki] = row
    return idx


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("g", [1, 6, 16])
def test_selection_dkv_skewed_blocks(g, dtype):
    # Ragged T (the last block is partial), block 0 in every row, block 1 in none, -1 slots,
    # future blocks: dK/dV through the counting-sort reverse index against the float64 reference.
    b, kvh, t, d, bs, n = 1, 2 if g < 16 else 1, 61, 32, 16, 3
    rng = np.random.default_rng(100 + g)
    q, k, v, do = random_inputs(rng, b, t, g * kvh, kvh, d, dtype)
    idx = _skewed_block_indices(rng, b, t, kvh, n, bs, never=1)
    assert (idx == -1).any() and not (idx == 1).any() and (idx == 0).any(axis=-1).all()
    bsz = SelectionBlockSizes(rows_dkv=16, dkv_segment=24)  # block 0 spans several segments
    fn = lambda q, k, v: selection_attention_pallas(q, k, v, jnp.asarray(idx), bs, interpret=INTERPRET, block_sizes=bsz)
    results = run_with_grads(fn, q, k, v, do)
    reference = reference_attention(*as_f32(q, k, v, do), selection_visible(idx, bs, t), d**-0.5)
    check_all(results, reference, dtype)
    _, _, dk, dv = results
    np.testing.assert_array_equal(dk[:, bs : 2 * bs], 0.0)  # chosen by no query
    np.testing.assert_array_equal(dv[:, bs : 2 * bs], 0.0)


# (G, positions per program, dtype, skewed selections)
MULTI_POSITION_CASES = [
    pytest.param(6, 2, jnp.float32, False, id="G6-P2-f32"),
    pytest.param(6, 2, jnp.bfloat16, True, id="G6-P2-bf16-skewed", marks=pytest.mark.slow),
    pytest.param(1, 4, jnp.float32, True, id="G1-P4-f32-skewed"),
    pytest.param(16, 2, jnp.bfloat16, False, id="G16-P2-bf16", marks=pytest.mark.slow),
    pytest.param(3, 8, jnp.float32, False, id="G3-P8-f32"),
]


@pytest.mark.parametrize("g,positions,dtype,skewed", MULTI_POSITION_CASES)
def test_selection_multi_position_programs(g, positions, dtype, skewed):
    # P consecutive positions x G heads per forward / dQ program over the union of their
    # blocks: ragged T (not a multiple of P nor of the block), -1 slots, n not a power of two.
    b, t, d, bs, n = 1, 61, 32, 16, 3
    kvh = 2 if g < 16 else 1
    rng = np.random.default_rng(200 + g * positions)
    q, k, v, do = random_inputs(rng, b, t, g * kvh, kvh, d, dtype)
    if skewed:
        idx = _skewed_block_indices(rng, b, t, kvh, n, bs, never=1)
    else:
        idx = random_block_indices(rng, b, t, kvh, n, bs)
    bsz = SelectionBlockSizes(positions=positions, rows_dkv=16, dkv_segment=24)
    fn = lambda q, k, v: selection_attention_pallas(q, k, v, jnp.asarray(idx), bs, interpret=INTERPRET, block_sizes=bsz)
    results = run_with_grads(fn, q, k, v, do)
    reference = reference_attention(*as_f32(q, k, v, do), selection_visible(idx, bs, t), d**-0.5)
    check_all(results, reference, dtype)


# ---------------------------------------------------------------------------
# Window
# ---------------------------------------------------------------------------

# (batch, T, G, KV heads, head dim, window, dtype, block sizes)
WINDOW_CASES = [
    pytest.param(2, 45, 1, 2, 32, 7, jnp.float32, FlashBlockSizes(16, 16, 16, 16), id="G1-d32-w7-f32"),
    pytest.param(1, 70, 6, 2, 64, 23, jnp.float32, FlashBlockSizes(16, 32, 16, 64), id="G6-d64-w23-f32"),
    pytest.param(1, 40, 16, 1, 128, 100, jnp.float32, None, id="G16-d128-w>T-f32"),
    pytest.param(1, 33, 2, 1, 32, 1, jnp.float32, FlashBlockSizes(16, 16, 16, 16), id="w1-f32"),
    pytest.param(1, 130, 6, 2, 64, 32, jnp.bfloat16, None, id="G6-d64-w32-bf16"),
    # A flash tiling timed as a candidate (benchmarks/bench_kernels.py --flash-variants): 128-row tiles.
    pytest.param(1, 150, 6, 2, 64, 70, jnp.bfloat16, FlashBlockSizes(block_rows=128, num_warps=8), id="G6-rows128"),
]


@pytest.mark.parametrize("b,t,g,kvh,d,w,dtype,bsz", WINDOW_CASES)
def test_window_matches_reference(b, t, g, kvh, d, w, dtype, bsz):
    rng = np.random.default_rng(t * 17 + w)
    q, k, v, do = random_inputs(rng, b, t, g * kvh, kvh, d, dtype)
    fn = lambda q, k, v: window_attention_pallas(q, k, v, w, interpret=INTERPRET, block_sizes=bsz)
    results = run_with_grads(fn, q, k, v, do)
    reference = reference_attention(*as_f32(q, k, v, do), window_visible(w), d**-0.5)
    check_all(results, reference, dtype)


def test_window_uneven_head_dims():
    b, t, g, kvh, dk, dv, w = 1, 36, 3, 1, 48, 24, 9
    rng = np.random.default_rng(10)
    q, k, v, do = random_inputs(rng, b, t, g * kvh, kvh, dk, jnp.float32, dv)
    fn = lambda q, k, v: window_attention_pallas(
        q, k, v, w, interpret=INTERPRET, block_sizes=FlashBlockSizes(16, 16, 16, 16)
    )
    results = run_with_grads(fn, q, k, v, do)
    reference = reference_attention(*as_f32(q, k, v, do), window_visible(w), dk**-0.5)
    check_all(results, reference, jnp.float32)


# ---------------------------------------------------------------------------
# Compressed branch
# ---------------------------------------------------------------------------


# (batch, T, G, KV heads, head dim, l, d, dtype, block sizes)
COMPRESSED_CASES = [
    pytest.param(2, 77, 6, 2, 32, 8, 4, jnp.float32, None, id="G6-d32-T77-l8-d4-f32"),
    pytest.param(
        1,
        130,
        1,
        2,
        64,
        32,
        16,
        jnp.float32,
        CompressedBlockSizes(FlashBlockSizes(16, 16, 16, 16)),
        id="G1-d64-T130-l32-d16-f32-small-tiles",
    ),
    pytest.param(1, 96, 16, 1, 16, 16, 16, jnp.float32, None, id="G16-d16-T96-l16-d16-f32"),
    pytest.param(1, 150, 6, 2, 64, 16, 8, jnp.bfloat16, None, id="G6-d64-T150-l16-d8-bf16"),
    pytest.param(
        1,
        150,
        6,
        2,
        64,
        16,
        8,
        jnp.bfloat16,
        CompressedBlockSizes(FlashBlockSizes(block_rows=128, num_warps=8)),
        id="G6-d64-T150-rows128-bf16",
    ),
]


def compressed_inputs(seed, b, t, g, kvh, d, l, stride, dtype):
    """(q, kc, vc, do) in `dtype`, standard normal: the Tc = (T - l) // stride + 1 compressed tokens."""
    rng = np.random.default_rng(seed)
    tc = (t - l) // stride + 1
    shapes = ((b, t, g * kvh, d), (b, tc, kvh, d), (b, tc, kvh, d), (b, t, g * kvh, d))
    return tuple(jnp.asarray(rng.standard_normal(s), jnp.float32).astype(dtype) for s in shapes)


@pytest.mark.parametrize("b,t,g,kvh,d,l,stride,dtype,bsz", COMPRESSED_CASES)
def test_compressed_matches_reference(b, t, g, kvh, d, l, stride, dtype, bsz):
    q, kc, vc, do = compressed_inputs(t * 7 + g, b, t, g, kvh, d, l, stride, dtype)
    tc = kc.shape[1]

    def fn(q, kc, vc):
        return compressed_attention_pallas(q, kc, vc, l=l, d=stride, interpret=INTERPRET, block_sizes=bsz)

    results = run_with_grads(fn, q, kc, vc, do)
    visible = compressed_visible(l, stride, tc)
    reference = reference_attention(*as_f32(q, kc, vc, do), visible, d**-0.5)
    check_all(results, reference, dtype)
    # Queries before the first complete block see nothing: output exactly 0.
    assert np.all(results[0][:, : l - 1] == 0)


@pytest.mark.parametrize("b,t,g,kvh,d,l,stride,dtype,bsz", COMPRESSED_CASES)
def test_compressed_lse_pass_matches_float64_reference(b, t, g, kvh, d, l, stride, dtype, bsz):
    # The log-sum-exp alone (one q k^T pass, no values), which block scoring reads when the
    # compressed attention runs elsewhere: per row against the float64 sum over the visible tokens;
    # queries before the first complete block see none (0); padding rows past T*G are not compared.
    q, kc, _, _ = compressed_inputs(t * 5 + g, b, t, g, kvh, d, l, stride, dtype)
    scale = 0.7 * d**-0.5
    lse, used = compressed_lse_pallas(q, kc, l=l, d=stride, scale=scale, interpret=INTERPRET, block_sizes=bsz)
    assert used == pytest.approx(scale) and lse.dtype == jnp.float32
    want = reference_compressed_lse2(q.astype(jnp.float32), kc.astype(jnp.float32), l, stride, scale)
    got = np.asarray(lse)[:, :, : t * g]
    assert got.shape == want.shape and np.asarray(lse).shape[-1] >= t * g
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-5)
    assert np.all(got[:, :, : (l - 1) * g] == 0)


def _primitive_names(jaxpr) -> set[str]:
    """Names of every primitive in `jaxpr` and the jaxprs its equations hold (jit, custom_vjp, scan)."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    names |= _primitive_names(inner)
    return names


def test_an_unused_lse_pass_is_dropped_with_its_kernel():
    # jax < 0.12 never drops an unused pallas_call; flax's scan (>= 0.12.10) checks its body's
    # invariants by dropping what nothing reads and refused to init a scanned model whose lse pass
    # (called outside a custom_vjp) stayed: seen on an H200 with jax 0.11.2. The pass must go
    # whole when its result is unused, and stay when it is read.
    from jax._src.interpreters import partial_eval as pe  # dce_jaxpr has no public name

    q, kc, _, _ = compressed_inputs(3, 1, 40, 2, 1, 16, 8, 4, jnp.float32)

    def lse_of(q, kc):
        return compressed_lse_pallas(q, kc, l=8, d=4, interpret=INTERPRET)[0]

    def unused(q, kc):
        lse_of(q, kc)
        return jnp.sum(q)

    for fn, kept in ((unused, False), (lambda q, kc: jnp.sum(lse_of(q, kc)), True)):
        jaxpr = jax.make_jaxpr(fn)(q, kc).jaxpr
        dced, used_inputs = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
        assert ("pallas_call" in _primitive_names(dced)) == kept
        assert used_inputs == [True, kept]


# ---------------------------------------------------------------------------
# Agreement with the plain-XLA path (when the project provides it)
# ---------------------------------------------------------------------------


def _xla_module():
    xla = pytest.importorskip("nsa_jax.kernels.xla")
    for name in ("selection_attention_xla", "window_attention_xla"):
        if not hasattr(xla, name):
            pytest.skip(f"nsa_jax.kernels.xla has no {name} yet")
    return xla


def test_selection_matches_xla_path():
    xla = _xla_module()
    b, t, g, kvh, d, bs, n = 1, 60, 6, 2, 32, 16, 3
    rng = np.random.default_rng(5)
    q, k, v, do = random_inputs(rng, b, t, g * kvh, kvh, d, jnp.float32)
    idx = jnp.asarray(random_block_indices(rng, b, t, kvh, n, bs, shuffle=False))
    got = run_with_grads(lambda q, k, v: selection_attention_pallas(q, k, v, idx, bs, interpret=INTERPRET), q, k, v, do)
    want = run_with_grads(lambda q, k, v: xla.selection_attention_xla(q, k, v, idx, bs), q, k, v, do)
    check_all(got, want, jnp.float32)


def test_window_matches_xla_path():
    xla = _xla_module()
    b, t, g, kvh, d, w = 1, 60, 6, 2, 32, 19
    rng = np.random.default_rng(6)
    q, k, v, do = random_inputs(rng, b, t, g * kvh, kvh, d, jnp.float32)
    got = run_with_grads(lambda q, k, v: window_attention_pallas(q, k, v, w, interpret=INTERPRET), q, k, v, do)
    want = run_with_grads(lambda q, k, v: xla.window_attention_xla(q, k, v, w), q, k, v, do)
    check_all(got, want, jnp.float32)


# ---------------------------------------------------------------------------
# GPU lowering (no GPU needed)
# ---------------------------------------------------------------------------

PROD = dict(b=1, t=2048, h=12, kvh=2, d=64, bs=64, n=16, w=512)


def _export_text(fn, *args):
    """StableHLO of `fn` exported for CUDA, the Pallas kernels lowered for a card (no GPU needed here)."""
    return aot.export_for_cuda(fn, *args).mlir_module()


def _prod_args(with_idx):
    p = PROD
    sds = jax.ShapeDtypeStruct
    args = [
        sds((p["b"], p["t"], p["h"], p["d"]), jnp.bfloat16),
        sds((p["b"], p["t"], p["kvh"], p["d"]), jnp.bfloat16),
        sds((p["b"], p["t"], p["kvh"], p["d"]), jnp.bfloat16),
    ]
    if with_idx:
        args.append(sds((p["b"], p["t"], p["kvh"], p["n"]), jnp.int32))
    return args


def _assert_triton_without_txt(text, min_kernels):
    assert text.count(aot.TRITON_TARGET) >= min_kernels
    # No production path may hold a T x T tensor.
    t = PROD["t"]
    assert not re.search(rf"\b{t}x{t}x", text)


def test_selection_lowers_to_triton_for_cuda():
    bs = PROD["bs"]
    fwd = lambda q, k, v, i: selection_attention_pallas(q, k, v, i, bs)
    grad = jax.grad(lambda q, k, v, i: fwd(q, k, v, i).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    # forward: 1 kernel; gradient: forward + dq + dk/dv + segment reduction.
    _assert_triton_without_txt(_export_text(fwd, *_prod_args(True)), 1)
    grad_text = _export_text(grad, *_prod_args(True))
    _assert_triton_without_txt(grad_text, 4)
    # The reverse index of the backward is a counting sort, not a comparison sort.
    assert "stablehlo.sort" not in grad_text
    # Several positions per program (the union walk, with its lax.cond) lower to Triton too.
    bsz = SelectionBlockSizes(positions=2)
    multi = lambda q, k, v, i: selection_attention_pallas(q, k, v, i, bs, block_sizes=bsz)
    multi_grad = jax.grad(lambda q, k, v, i: multi(q, k, v, i).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    _assert_triton_without_txt(_export_text(multi_grad, *_prod_args(True)), 4)


def test_nsa_layer_gradient_has_no_sort():
    # The whole NSA layer with Pallas kernels, forward and backward, exported for CUDA at a
    # production-like shape: no sort at all. The reverse index of the selection backward is a
    # counting sort, and block selection is the fused scoring + top-n kernel (on the XLA path
    # lax.top_k lowers to a sort on CUDA).
    cfg = tiny_model_cfg(G=6, K=2, l=32, d=16, lp=64, n=16, w=512)
    nsa = dataclasses.replace(cfg.nsa, attention_impl="pallas")
    cfg = dataclasses.replace(cfg, head_dim=64, v_head_dim=64, d_model=256, nsa=nsa)
    t = 2048
    plan = kernels.plan_kernels(nsa, t, "gpu")  # a GPU's plan: the Triton lowering, not the interpreter
    params = jax.eval_shape(lambda: NSAAttention(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, t, cfg.d_model))))
    x = jax.ShapeDtypeStruct((1, t, cfg.d_model), jnp.bfloat16)
    loss = lambda p, xx: NSAAttention(cfg, kernels=plan).apply(p, xx).astype(jnp.float32).sum()
    text = _export_text(jax.grad(loss, argnums=(0, 1)), params, x)
    assert text.count(aot.TRITON_TARGET) >= 10  # three branches, forward and backward
    functions = text.split("func.func ")
    sorting = [f.split("(", 1)[0] for f in functions if "stablehlo.sort" in f]
    assert not sorting, sorting


def test_window_lowers_to_triton_for_cuda():
    w = PROD["w"]
    fwd = lambda q, k, v: window_attention_pallas(q, k, v, w)
    grad = jax.grad(lambda q, k, v: fwd(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    _assert_triton_without_txt(_export_text(fwd, *_prod_args(False)), 1)
    _assert_triton_without_txt(_export_text(grad, *_prod_args(False)), 3)


def test_compressed_lowers_to_triton_for_cuda():
    p = PROD
    l, d = 32, 16
    tc = (p["t"] - l) // d + 1
    sds = jax.ShapeDtypeStruct
    args = [
        sds((p["b"], p["t"], p["h"], p["d"]), jnp.bfloat16),
        sds((p["b"], tc, p["kvh"], p["d"]), jnp.bfloat16),
        sds((p["b"], tc, p["kvh"], p["d"]), jnp.bfloat16),
    ]
    fwd = lambda q, kc, vc: compressed_attention_pallas(q, kc, vc, l=l, d=d)
    grad = jax.grad(lambda q, kc, vc: fwd(q, kc, vc).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    # forward: attention; gradient: forward + dq + dk/dv.
    _assert_triton_without_txt(_export_text(fwd, *args), 1)
    _assert_triton_without_txt(_export_text(grad, *args), 3)


def test_rejects_bad_arguments():
    q = jnp.zeros((1, 32, 4, 32))
    k = jnp.zeros((1, 32, 2, 32))
    idx = jnp.zeros((1, 32, 2, 3), jnp.int32)
    with pytest.raises(ValueError):
        selection_attention_pallas(q, k, k, idx, 24, interpret=INTERPRET)
    with pytest.raises(ValueError):
        selection_attention_pallas(q, k, k, idx[:, :, :1], 16, interpret=INTERPRET)
    with pytest.raises(ValueError):
        window_attention_pallas(q, k, k, 0, interpret=INTERPRET)
    with pytest.raises(ValueError):
        window_attention_pallas(q, jnp.zeros((1, 32, 3, 32)), jnp.zeros((1, 32, 3, 32)), 4, interpret=INTERPRET)


# ---------------------------------------------------------------------------
# Shared-memory budget (A100)
# ---------------------------------------------------------------------------


def test_oversized_tiles_are_refused_with_a_clear_message():
    q = jnp.zeros((1, 32, 2, 128), jnp.bfloat16)
    k = jnp.zeros((1, 32, 1, 128), jnp.bfloat16)
    big = FlashBlockSizes(256, 256, 256, 256)
    with pytest.raises(ValueError, match=r"flash (fwd|dq|dkv): .* KiB of shared memory, over the 163 KiB .*A100"):
        window_attention_pallas(q, k, k, 8, interpret=INTERPRET, block_sizes=big)
    with pytest.raises(ValueError, match=r"shared memory.*A100.*block_rows"):
        compressed_attention_pallas(q, k, k, l=16, d=8, interpret=INTERPRET, block_sizes=CompressedBlockSizes(big))
    # lp = 512 at head dim 128: two pipelined 512 x 128 K and V tiles alone are 512 KiB.
    idx = jnp.zeros((1, 32, 1, 2), jnp.int32)
    with pytest.raises(ValueError, match=r"nsa_selection_\w+: .*shared memory.*A100.*lp"):
        selection_attention_pallas(q, k, k, idx, 512, interpret=INTERPRET)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_default_tiles_fit_the_budget(d, dtype):
    itemsize = jnp.dtype(dtype).itemsize
    fitted = flash_pallas.fit_block_sizes(FlashBlockSizes(), d, d, itemsize)
    assert all(getattr(fitted, n) is not None for n in ("block_rows", "block_keys", "block_keys_dkv", "block_rows_dkv"))
    assert max(flash_pallas.smem_estimates(fitted, d, d, itemsize).values()) <= SMEM_BUDGET_BYTES
    if d <= 128:  # selection blocks of 64 with G = 6 heads per group
        q = jnp.zeros((1, 64, 6, d), dtype)
        k = jnp.zeros((1, 64, 1, d), dtype)
        sel = selection_pallas.fit_block_sizes(SelectionBlockSizes(), q, k, k, 64)
        assert max(selection_pallas.smem_estimates(sel, 6, d, d, 64, itemsize).values()) <= SMEM_BUDGET_BYTES


def test_production_tiles_keep_their_size():
    # bf16, head dim 64, lp = 64: the default tiles (64) fit with room to spare.
    fitted = flash_pallas.fit_block_sizes(FlashBlockSizes(), 64, 64, 2)
    assert fitted == FlashBlockSizes(64, 64, 64, 64)
    q, k = jnp.zeros((1, 64, 12, 64), jnp.bfloat16), jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
    assert selection_pallas.fit_block_sizes(SelectionBlockSizes(), q, k, k, 64).rows_dkv == 64


def test_selection_estimate_counts_the_rows_of_multi_position_programs():
    one = selection_pallas.smem_estimates(SelectionBlockSizes(rows_dkv=64), 6, 64, 64, 64, 2)
    two = selection_pallas.smem_estimates(SelectionBlockSizes(rows_dkv=64, positions=2), 6, 64, 64, 64, 2)
    eight = selection_pallas.smem_estimates(SelectionBlockSizes(rows_dkv=64, positions=8), 6, 64, 64, 64, 2)
    assert two["nsa_selection_fwd"] == one["nsa_selection_fwd"]  # 12 rows pad to 16 like 6 do
    # 48 rows pad to 64: q (64 x 64) and P (64 x 64) tiles instead of 16-row ones, bf16.
    assert eight["nsa_selection_fwd"] - one["nsa_selection_fwd"] == 2 * (48 * 64 + 48 * 64)
    assert eight["nsa_selection_dkv"] == one["nsa_selection_dkv"]
    with pytest.raises(ValueError, match="positions=3 must be a power of two"):
        q, k = jnp.zeros((1, 32, 2, 32)), jnp.zeros((1, 32, 1, 32))
        selection_attention_pallas(
            q, k, k, jnp.zeros((1, 32, 1, 2), jnp.int32), 16, block_sizes=SelectionBlockSizes(positions=3)
        )
