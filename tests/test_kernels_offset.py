"""The Pallas kernels under a query offset: a chunk of a sequence's queries over the whole sequence's keys.

For each entry point a full problem of length T is drawn; the kernel runs on the query rows
[off, off + TQ) with all the keys (or compressed tokens) and ``q_offset=off``, and is compared with
the float64 reference of the full problem (nsa_jax.kernels.reference) restricted to those rows: o,
the log-sum-exp, the block scores and the selected blocks of those rows; dq of those rows, and dk, dv
over all keys as the reference's gradient of those rows' loss (its cotangent is zero on the other rows).
The offset is a traced argument of one jitted function per entry point, run at OFFSETS: 0, one that is
no multiple of any tile, and the last chunk; TQ is no multiple of the row tiles (TQ * G = 42 rows in
tiles of 16, an odd count of positions for two-position programs). Kernels run interpreted off a GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import (
    compressed_visible,
    random_block_indices,
    reference_attention,
    reference_block_scores,
    reference_block_selection,
    reference_compressed_lse2,
    selection_visible,
    window_visible,
)

from nsa_jax.kernels import compressed_attention, window_attention
from nsa_jax.kernels.block_scores_pallas import (
    BlockSelectSizes,
    compressed_attention_scores_pallas,
    compressed_attention_select_pallas,
    select_blocks_pallas,
)
from nsa_jax.kernels.blocksparse_pallas import selection_attention_blocksparse_pallas
from nsa_jax.kernels.compressed_pallas import CompressedBlockSizes, compressed_attention_pallas, compressed_lse_pallas
from nsa_jax.kernels.flash_pallas import FlashBlockSizes, window_attention_pallas
from nsa_jax.kernels.selection_pallas import SelectionBlockSizes, selection_attention_pallas
from nsa_jax.kernels.selection_tpu import selection_attention_tpu

from helpers import as_f32, check_all, random_inputs

INTERPRET = jax.default_backend() not in ("gpu", "cuda")

T, TQ = 64, 21  # the full sequence, the query rows of a chunk
OFFSETS = (0, 13, T - TQ)
G, K, D = 2, 2, 16  # heads per KV head, KV heads, head dim
W = 23  # window
L, STRIDE, LP, N = 8, 4, 16, 3  # compression block and stride, selection block and count
TC, NB = (T - L) // STRIDE + 1, T // LP  # compressed tokens and selection blocks of the full sequence
TILES = FlashBlockSizes(16, 16, 16, 16)
SELECT_TILES = BlockSelectSizes(block_pos=16, block_blocks=16)


def rows(x, off):
    return x[:, off : off + TQ]


def run_chunks(fn, q, k, v, do, idx=None):
    """{off: (o, dq, dk, dv) fp32 numpy} of ``fn(q rows, k, v[, idx rows], q_offset=off)`` at OFFSETS, with its
    vjp for the rows of ``do``: one jitted function, the offset traced."""

    @jax.jit
    def run(q_rows, k, v, do_rows, extra, off):
        o, vjp = jax.vjp(lambda a, b, c: fn(a, b, c, *extra, q_offset=off), q_rows, k, v)
        return (o, *vjp(do_rows))

    extra = lambda off: [] if idx is None else [jnp.asarray(rows(idx, off))]  # noqa: E731
    return {off: as_f32(*run(rows(q, off), k, v, rows(do, off), extra(off), jnp.int32(off))) for off in OFFSETS}


def chunk_reference(q, k, v, do, visible, off):
    """The float64 reference of the full problem for the rows [off, off + TQ): (o, dq) of those rows and
    (dk, dv) over all keys of those rows' loss (a cotangent that is zero elsewhere)."""
    do_rows = np.zeros_like(do)
    do_rows[:, off : off + TQ] = do[:, off : off + TQ]
    o, dq, dk, dv = reference_attention(q, k, v, do_rows, visible, D**-0.5)
    return rows(o, off), rows(dq, off), dk, dv


def check_chunks(got, q, k, v, do, visible, dtype):
    for off, results in got.items():
        check_all(results, chunk_reference(*as_f32(q, k, v, do), visible, off), dtype)
        if off + TQ < k.shape[1]:  # keys after the chunk's last query: seen by none of its rows
            assert np.all(results[2][:, off + TQ :] == 0) and np.all(results[3][:, off + TQ :] == 0)


DTYPES = [
    pytest.param(jnp.float32, id="f32"),
    pytest.param(jnp.bfloat16, id="bf16", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("dtype", DTYPES)
def test_window_chunks_match_reference(dtype):
    q, k, v, do = random_inputs(np.random.default_rng(1), 1, T, G * K, K, D, dtype)

    def fn(q, k, v, q_offset):
        return window_attention_pallas(q, k, v, W, interpret=INTERPRET, block_sizes=TILES, q_offset=q_offset)

    check_chunks(run_chunks(fn, q, k, v, do), q, k, v, do, window_visible(W), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_compressed_chunks_match_reference(dtype):
    q, _, _, do = random_inputs(np.random.default_rng(2), 1, T, G * K, K, D, dtype)
    _, kc, vc, _ = random_inputs(np.random.default_rng(3), 1, TC, G * K, K, D, dtype)
    bsz = CompressedBlockSizes(TILES)

    def fn(q, kc, vc, q_offset):
        return compressed_attention_pallas(
            q, kc, vc, l=L, d=STRIDE, interpret=INTERPRET, block_sizes=bsz, q_offset=q_offset
        )

    check_chunks(run_chunks(fn, q, kc, vc, do), q, kc, vc, do, compressed_visible(L, STRIDE, TC), dtype)


def test_compressed_chunk_scores_selection_and_lse_match_reference():
    # The block scores, the selected blocks (num_blocks of the full sequence, the rules at the rows'
    # positions) and the log-sum-exp pass of each chunk, with the attention output of both fused calls.
    q, _, _, do = random_inputs(np.random.default_rng(4), 1, T, G * K, K, D, jnp.float32)
    _, kc, vc, _ = random_inputs(np.random.default_rng(5), 1, TC, G * K, K, D, jnp.float32)
    kw = dict(l=L, d=STRIDE, interpret=INTERPRET, block_sizes=CompressedBlockSizes(TILES))
    sel = dict(lp=LP, num_blocks=NB, select_sizes=SELECT_TILES)

    @jax.jit
    def run(q_rows, kc, vc, off):
        o_sel, idx = compressed_attention_select_pallas(q_rows, kc, vc, n=N, q_offset=off, **sel, **kw)
        o_sc, scores = compressed_attention_scores_pallas(q_rows, kc, vc, q_offset=off, **sel, **kw)
        lse, _ = compressed_lse_pallas(q_rows, kc, q_offset=off, **kw)
        return o_sel, idx, o_sc, scores, lse

    qf, kcf, vcf, dof = as_f32(q, kc, vc, do)
    want_scores = reference_block_scores(qf, kcf, L, STRIDE, LP)
    want_idx, clear = reference_block_selection(want_scores, LP, N, tol=1e-4 * G)
    want_lse = reference_compressed_lse2(qf, kcf, L, STRIDE, D**-0.5)
    want_o = reference_attention(qf, kcf, vcf, None, compressed_visible(L, STRIDE, TC))[0]
    for off in OFFSETS:
        o_sel, idx, o_sc, scores, lse = (np.asarray(x) for x in run(rows(q, off), kc, vc, jnp.int32(off)))
        np.testing.assert_allclose(scores, rows(want_scores, off), atol=2e-5 * G)
        clear_rows = rows(clear, off)
        assert idx.shape == (1, TQ, K, N) and clear_rows.mean() > 0.8
        np.testing.assert_array_equal(idx[clear_rows], rows(want_idx, off)[clear_rows])
        np.testing.assert_allclose(lse[:, :, : TQ * G], want_lse[:, :, off * G : (off + TQ) * G], atol=1e-4, rtol=1e-5)
        for o in (o_sel, o_sc):
            np.testing.assert_allclose(o, rows(want_o, off), atol=1e-5, rtol=1e-5)


def test_select_blocks_at_chunk_positions():
    # Without t_T the rules see the rows' positions q_offset + r; exact ties go to the lower block.
    rng = np.random.default_rng(6)
    scores = jnp.asarray(rng.integers(0, 3, (1, TQ, K, NB)).astype(np.float32))
    run = jax.jit(lambda s, off: select_blocks_pallas(s, LP, N, interpret=INTERPRET, q_offset=off))
    for off in OFFSETS:
        want, _ = reference_block_selection(np.asarray(scores, np.float64), LP, N, offset=off)
        np.testing.assert_array_equal(np.asarray(run(scores, jnp.int32(off))), want)


GATHER_TILINGS = [
    pytest.param(SelectionBlockSizes(positions=1, num_warps=1, rows_dkv=16, dkv_segment=8), id="one-position"),
    pytest.param(SelectionBlockSizes(positions=2, rows_dkv=16, dkv_segment=8), id="two-positions"),
]


@pytest.mark.parametrize("bsz", GATHER_TILINGS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_selection_chunks_match_reference(dtype, bsz):
    rng = np.random.default_rng(7)
    q, k, v, do = random_inputs(rng, 1, T, G * K, K, D, dtype)
    idx = random_block_indices(rng, 1, T, K, N, LP)  # the full sequence's selections, -1 slots anywhere

    def fn(q, k, v, idx, q_offset):
        return selection_attention_pallas(q, k, v, idx, LP, interpret=INTERPRET, block_sizes=bsz, q_offset=q_offset)

    check_chunks(run_chunks(fn, q, k, v, do, idx), q, k, v, do, selection_visible(idx, LP, T), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_blocksparse_selection_chunks_match_reference(dtype):
    rng = np.random.default_rng(8)
    q, k, v, do = random_inputs(rng, 1, T, G * K, K, D, dtype)
    idx = random_block_indices(rng, 1, T, K, N, LP)

    def fn(q, k, v, idx, q_offset):
        return selection_attention_blocksparse_pallas(
            q, k, v, idx, LP, interpret=INTERPRET, block_sizes=TILES, q_offset=q_offset
        )

    check_chunks(run_chunks(fn, q, k, v, do, idx), q, k, v, do, selection_visible(idx, LP, T), dtype)


def test_offsets_out_of_range_or_of_the_wrong_kind_are_refused():
    q, k = jnp.zeros((1, TQ, G * K, D)), jnp.zeros((1, T, K, D))
    idx = jnp.zeros((1, TQ, K, N), jnp.int32)
    for bad in (T - TQ + 1, -1, jnp.zeros((2,), jnp.int32), jnp.float32(3)):
        with pytest.raises(ValueError, match="q_offset"):
            window_attention_pallas(q, k, k, W, interpret=INTERPRET, q_offset=bad)
    with pytest.raises(ValueError, match="past the"):
        selection_attention_pallas(q, k[:, : TQ - 1], k[:, : TQ - 1], idx, LP, interpret=INTERPRET)
    with pytest.raises(ValueError, match="past the"):
        selection_attention_blocksparse_pallas(q, k, k, idx, LP, interpret=INTERPRET, q_offset=T - TQ + 1)
    kc = jnp.zeros((1, TC, K, D))
    with pytest.raises(ValueError, match="cudnn takes no query offset"):
        compressed_attention_select_pallas(
            q, kc, kc, l=L, d=STRIDE, lp=LP, n=N, attention="cudnn", interpret=INTERPRET, q_offset=jnp.int32(5)
        )
    with pytest.raises(ValueError, match="num_blocks=0"):
        compressed_attention_scores_pallas(q, kc, kc, l=L, d=STRIDE, lp=LP, interpret=INTERPRET, num_blocks=0)


def test_tpu_selection_chunks_match_reference():
    # The Pallas TPU kernels (interpreted here): a chunk's rows at a traced offset, -1 slots anywhere.
    rng = np.random.default_rng(9)
    q, k, v, do = random_inputs(rng, 1, T, G * K, K, D, jnp.float32)
    idx = random_block_indices(rng, 1, T, K, N, LP)

    def fn(q, k, v, idx, q_offset):
        return selection_attention_tpu(q, k, v, idx, LP, interpret=True, positions=4, segment=8, q_offset=q_offset)

    check_chunks(run_chunks(fn, q, k, v, do, idx), q, k, v, do, selection_visible(idx, LP, T), jnp.float32)


def test_splash_window_and_compressed_chunks_match_reference():
    # Splash's masks are static: at a traced offset it switches among one kernel per listed offset.
    q, k, v, do = random_inputs(np.random.default_rng(9), 1, T, G * K, K, D, jnp.float32)
    win = lambda q, k, v, q_offset: window_attention(
        q, k, v, W, impl="splash", interpret=True, q_offset=q_offset, offsets=OFFSETS
    )  # noqa: E501, E731
    check_chunks(run_chunks(win, q, k, v, do), q, k, v, do, window_visible(W), jnp.float32)
    # An offset the list lacks gets NaNs (the step stops at them), not another offset's mask.
    o_unlisted = jax.jit(win)(rows(q, 7), k, v, jnp.int32(7))
    assert 7 not in OFFSETS and np.isnan(np.asarray(o_unlisted)).all()
    _, kc, vc, _ = random_inputs(np.random.default_rng(10), 1, TC, G * K, K, D, jnp.float32)

    def cmp(q, kc, vc, q_offset):
        kw = dict(l=L, d=STRIDE, lp=LP, impl="splash", scores=False, interpret=True)
        return compressed_attention(q, kc, vc, q_offset=q_offset, offsets=OFFSETS, **kw)[0]

    check_chunks(run_chunks(cmp, q, kc, vc, do), q, kc, vc, do, compressed_visible(L, STRIDE, TC), jnp.float32)
    with pytest.raises(ValueError, match="needs the offsets it can take"):
        window_attention(q, k, v, W, impl="splash", interpret=True, q_offset=jnp.int32(0))
