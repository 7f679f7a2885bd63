"""The Pallas TPU (Mosaic) kernels, interpreted on this CPU, and the TPU kernel plan.

kernels/selection_tpu.py against the float64 reference (nsa_jax.kernels.reference): output and
(dq, dk, dv) over G from 1 to 16 (rows padded to the sublane tile or not), bf16, -1 slots anywhere,
rows that see no key, and calls cut into several prefetch chunks; the sorting reverse index equal to
the counting one; the window and compressed branches on splash attention (kernels/splash_tpu.py)
against the same reference; the plan a TPU gets, and the NSA layer running it equal to the reference
layer.
What compiles for a TPU (v5e, v6e) is the `tpu` tier's: tests/test_tpu_aot.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import (
    compressed_visible,
    nsa_layer_ref,
    random_block_indices,
    reference_attention,
    selection_visible,
    window_visible,
)

from nsa_jax.kernels import BranchCalls, KernelPlan, compressed_attention, plan_kernels, window_attention
from nsa_jax.kernels import selection_tpu as tpu
from nsa_jax.kernels.plan import substitutions
from nsa_jax.kernels.reverse_index import reverse_index, reverse_index_sorted
from nsa_jax.nsa.context import SeqLayout
from nsa_jax.nsa.layer import NSAAttention

from helpers import as_f32, check_all, random_inputs, rel_err, run_with_grads, tiny_model_cfg

# (batch, T, G, KV heads, head dim, block size, n, dtype, shuffled slots, positions, segment)
CASES = [
    pytest.param(2, 45, 1, 2, 32, 16, 3, jnp.float32, True, 2, 8, id="G1-d32-T45-f32-shuffled"),
    pytest.param(1, 70, 6, 2, 64, 16, 4, jnp.float32, False, 8, 16, id="G6-d64-T70-f32"),
    pytest.param(1, 40, 16, 1, 32, 16, 3, jnp.float32, True, 4, 8, id="G16-d32-T40-f32"),
    pytest.param(1, 100, 4, 2, 64, 32, 3, jnp.bfloat16, True, 8, 64, id="G4-d64-T100-bs32-bf16"),
]


def run_tpu(q, k, v, do, idx, bs, **kw):
    fn = lambda q, k, v: tpu.selection_attention_tpu(q, k, v, jnp.asarray(idx), bs, interpret=True, **kw)
    return run_with_grads(fn, q, k, v, do)


@pytest.mark.parametrize("b,t,g,kvh,d,bs,n,dtype,shuffle,positions,segment", CASES)
def test_tpu_selection_matches_reference(b, t, g, kvh, d, bs, n, dtype, shuffle, positions, segment):
    rng = np.random.default_rng(t * 7 + g)
    q, k, v, do = random_inputs(rng, b, t, g * kvh, kvh, d, dtype)
    idx = random_block_indices(rng, b, t, kvh, n, bs, shuffle=shuffle)
    got = run_tpu(q, k, v, do, idx, bs, positions=positions, segment=segment)
    check_all(got, reference_attention(*as_f32(q, k, v, do), selection_visible(idx, bs, t), d**-0.5), dtype)


def test_tpu_selection_empty_rows_custom_scale_and_prefetch_chunks(monkeypatch):
    # Rows whose slots are all -1 give 0 and no gradient; a small SMEM budget cuts the forward, dQ and
    # dK/dV calls into several prefetch chunks each, which must not change a value.
    b, t, g, kvh, d, bs, n = 1, 60, 2, 2, 32, 16, 3
    rng = np.random.default_rng(11)
    q, k, v, do = random_inputs(rng, b, t, g * kvh, kvh, d, jnp.float32)
    idx = random_block_indices(rng, b, t, kvh, n, bs)
    idx[:, 5:9] = -1
    idx[:, 40, 1] = -1
    want = reference_attention(*as_f32(q, k, v, do), selection_visible(idx, bs, t), 0.3)
    calls = []
    real_call = tpu.pl.pallas_call
    monkeypatch.setattr(tpu, "PREFETCH_WORDS", 200)
    monkeypatch.setattr(tpu.pl, "pallas_call", lambda *a, **kw: calls.append(kw["name"]) or real_call(*a, **kw))
    got = run_tpu(q, k, v, do, idx, bs, scale=0.3, positions=4, segment=8)
    check_all(got, want, jnp.float32)
    assert np.all(got[0][:, 5:9] == 0) and np.all(got[1][:, 5:9] == 0)
    assert calls.count("fwd_kernel") == 1 and calls.count("dkv_kernel") == 1  # one call built per kind ...
    d_ = tpu._Dims(q, k, v, idx, bs, 4)
    assert d_.tq_pad // d_.chunk > 1  # ... and run over several chunks


def test_sorted_reverse_index_equals_the_counting_one():
    rng = np.random.default_rng(3)
    for t, n, bs, segment in ((300, 5, 16, 7), (1000, 8, 32, 64)):
        idx = jnp.asarray(random_block_indices(rng, 2, t, 3, n, bs))
        counting, sorting = reverse_index(idx, -(-t // bs), segment), reverse_index_sorted(idx, -(-t // bs), segment)
        for field in counting._fields:
            np.testing.assert_array_equal(getattr(sorting, field), getattr(counting, field), err_msg=field)


def test_tpu_selection_refuses_what_it_cannot_run():
    q, k, v, _ = random_inputs(np.random.default_rng(0), 1, 32, 2, 1, 16, jnp.float32)
    idx = jnp.zeros((1, 32, 1, 2), jnp.int32)
    with pytest.raises(ValueError, match="block_size=8: the TPU selection kernel takes a power of two >= 16"):
        tpu.selection_attention_tpu(q, k, v, idx, 8, interpret=True)
    with pytest.raises(ValueError, match="positions=3 must be a power of two dividing segment=256"):
        tpu.selection_attention_tpu(q, k, v, idx, 16, interpret=True, positions=3)
    wide = jnp.zeros((1, 32, 1, tpu.PREFETCH_WORDS // 4), jnp.int32)  # n so large one call's ids overflow SMEM
    with pytest.raises(ValueError, match="over SMEM's 65536: split the batch"):
        tpu.selection_attention_tpu(q, k, v, wide, 16, interpret=True)


# (batch, T, G, KV heads, head dim, window, dtype): one tile rounded up to 128 rows, a causal window,
# and several 512-row tiles of which the local mask skips the far ones.
WINDOW_CASES = [
    pytest.param(2, 150, 2, 2, 32, 40, jnp.float32, id="T150-w40-K2-f32"),
    pytest.param(1, 70, 3, 1, 64, 1 << 30, jnp.float32, id="T70-causal-f32"),
    pytest.param(1, 600, 2, 1, 64, 100, jnp.bfloat16, id="T600-w100-bf16"),
]


@pytest.mark.parametrize("b,t,g,kvh,d,w,dtype", WINDOW_CASES)
def test_splash_window_matches_reference(b, t, g, kvh, d, w, dtype):
    rng = np.random.default_rng(t + w % 97)
    q, k, v, do = random_inputs(rng, b, t, g * kvh, kvh, d, dtype)
    got = run_with_grads(lambda q, k, v: window_attention(q, k, v, w, impl="splash", interpret=True), q, k, v, do)
    check_all(got, reference_attention(*as_f32(q, k, v, do), window_visible(w), d**-0.5), dtype)


@pytest.mark.parametrize(
    "t,g,kvh,l,d,dtype",
    [(90, 2, 2, 8, 4, jnp.float32), (700, 3, 1, 32, 16, jnp.bfloat16)],
    ids=["T90-f32", "T700-bf16"],
)
def test_splash_compressed_matches_reference(t, g, kvh, l, d, dtype):
    # Rows before the first compressed token ends (t < l - 1) see none and give 0 with no gradient.
    rng = np.random.default_rng(t)
    tc = (t - l) // d + 1
    q, _, _, do = random_inputs(rng, 1, t, g * kvh, kvh, 32, dtype)
    _, kc, vc, _ = random_inputs(rng, 1, tc, g * kvh, kvh, 32, dtype)

    def fn(q, kc, vc):
        return compressed_attention(q, kc, vc, l=l, d=d, lp=16, impl="splash", scores=False, interpret=True)[0]

    got = run_with_grads(fn, q, kc, vc, do)
    check_all(got, reference_attention(*as_f32(q, kc, vc, do), compressed_visible(l, d, tc), 32**-0.5), dtype)


def test_splash_refuses_what_it_cannot_run():
    q, k, v, _ = random_inputs(np.random.default_rng(0), 1, 32, 2, 1, 16, jnp.float32)
    with pytest.raises(ValueError, match="splash attention at a traced query offset needs the offsets it can take"):
        window_attention(q, k, v, 8, impl="splash", interpret=True, q_offset=jnp.int32(0))
    with pytest.raises(ValueError, match="window attention with softcap runs in XLA only"):
        window_attention(q, k, v, 8, impl="splash", interpret=True, softcap=30.0)
    with pytest.raises(ValueError, match="splash attention forms no probabilities"):
        compressed_attention(q, k, v, l=8, d=4, lp=16, impl="splash", interpret=True)


def test_a_tpu_plans_its_kernels():
    nsa = tiny_model_cfg(lp=16).nsa
    plan = plan_kernels(nsa, 8192, "tpu")
    # cmp's scores need the compressed branch's probabilities: it stays on XLA; the window runs splash.
    assert (plan.cmp, plan.slc, plan.win, plan.interpret) == ("xla", "tpu", "splash", False)
    assert plan.describe()["slc"] == "pallas-mosaic"
    assert plan.describe()["win"] == "pallas-mosaic/splash"
    minmax = plan_kernels(dataclasses.replace(nsa, scorer="minmax"), 8192, "tpu")
    assert (minmax.cmp, minmax.win) == ("splash", "splash")
    assert plan_kernels(dataclasses.replace(nsa, scorer="minmax"), 8192, "tpu", fallback={"cmp", "win"}).cmp == "xla"
    assert plan_kernels(nsa, 8192, "tpu", fallback={"win"}).win == "xla"
    assert "the window branch runs as xla-chunked (the kernel guard found splash" in " ".join(
        substitutions(nsa, [plan_kernels(nsa, 8192, "tpu", fallback={"win"})], "tpu", fallback={"win"})
    )
    # Under context parallelism too: one splash kernel per chunk offset, the device's traced one picks.
    split = plan_kernels(dataclasses.replace(nsa, scorer="minmax"), 8192, "tpu", layout=SeqLayout(2, 2048, 8192))
    assert (split.cmp, split.slc, split.win) == ("splash", "tpu", "splash")
    assert BranchCalls(dataclasses.replace(nsa, scorer="minmax"), split)._offsets() == (0, 2048, 4096, 6144)
    assert plan_kernels(nsa, 8192, "tpu", fallback={"slc"}).slc == "xla"
    assert plan_kernels(dataclasses.replace(nsa, lp=24), 8192, "tpu").slc == "xla"
    assert plan_kernels(dataclasses.replace(nsa, attention_impl="xla"), 8192, "tpu").slc == "xla"
    assert plan_kernels(nsa, 8192, "cpu").slc == "xla"  # and nothing else changes off a TPU
    named = dataclasses.replace(nsa, attention_impl="pallas", selection_kernel="gather")
    said = substitutions(named, [plan_kernels(named, 8192, "tpu")], "tpu")
    assert any("attention_impl=pallas runs as pallas-mosaic" in s for s in said)
    assert any("selection_kernel=gather names a GPU kernel" in s for s in said)
    assert substitutions(nsa, [plan], "tpu") == []


def test_nsa_layer_on_the_tpu_plan_matches_the_reference():
    # The whole layer with every branch on the TPU's kernels (interpreted; the minmax scorer, so the
    # compressed branch runs splash too): the reference layer's output, and the gradient of the input
    # equal to the XLA plan's.
    cfg = tiny_model_cfg(G=2, K=2, l=16, d=8, lp=16, n=3, w=16, scorer="minmax")
    T = 48
    x = jax.random.normal(jax.random.PRNGKey(5), (1, T, cfg.d_model), jnp.float32)
    plan = plan_kernels(cfg.nsa, T, "tpu")
    assert (plan.cmp, plan.slc, plan.win) == ("splash", "tpu", "splash")
    on_tpu = NSAAttention(cfg, kernels=dataclasses.replace(plan, interpret=True))
    params = jax.jit(on_tpu.init)(jax.random.PRNGKey(6), x)["params"]
    out = jax.jit(on_tpu.apply)({"params": params}, x)
    ref, _ = nsa_layer_ref(params, x, cfg)
    assert rel_err(out, ref) < 1e-5
    cot = jax.random.normal(jax.random.PRNGKey(7), out.shape)
    grad = lambda m: jax.jit(jax.grad(lambda xx: jnp.sum(m.apply({"params": params}, xx) * cot)))(x)
    assert rel_err(grad(on_tpu), grad(NSAAttention(cfg, kernels=KernelPlan()))) < 1e-5


def test_tpu_benchmark_refuses_an_unknown_slice(capsys):
    from benchmarks import tpu_aot

    assert tpu_aot.main(["--targets", "v9-8"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown target 'v9-8'; GPU cards:")


def test_a_step_libtpu_refuses_for_hbm_reads_as_not_fitting(monkeypatch):
    # libtpu refuses a program over a chip's HBM at compile time: the fit check reads the refusal's
    # stated temporaries as a step that does not fit, and lets any other compile error through.
    from nsa_jax.tools import aot

    refusal = (
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
        "(89.15G) exceeds available HBM (15.75G)."
    )

    def refused(*args):
        raise jax.errors.JaxRuntimeError(refusal)

    monkeypatch.setattr(aot, "compile_train_step", refused)
    mem = aot.step_memory(None, "v5e-4", 4)
    assert (
        mem["refused"] and mem["temp"] == int(89.15 * 2**30) and mem["total"] > aot.get_target("v5e-4").usable_bytes()
    )

    def broken(*args):
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")

    monkeypatch.setattr(aot, "compile_train_step", broken)
    with pytest.raises(jax.errors.JaxRuntimeError, match="something else"):
        aot.step_memory(None, "v5e-4", 4)


@pytest.mark.slow
def test_nsa_layer_on_the_tpu_plan_under_context_parallelism_equals_one_device():
    # A sequence over 2 devices of the `seq` axis with every branch on the TPU's kernels (interpreted;
    # splash at each device's traced chunk offsets): the output and the input's gradient of the whole
    # sequence on one device's XLA plan.
    from jax.sharding import Mesh, PartitionSpec

    from nsa_jax.mesh import SEQ
    from nsa_jax.nsa.context import _permute_chunks
    from nsa_jax.seq_layout import chunk_len, natural_slots

    cfg = tiny_model_cfg(G=2, K=2, l=16, d=8, lp=16, n=3, w=16, scorer="minmax")
    T, C = 64, 2
    layout = SeqLayout(C, chunk_len(T, C, 16, 16), T)
    x = jax.random.normal(jax.random.PRNGKey(5), (1, T, cfg.d_model), jnp.float32)
    plan = dataclasses.replace(plan_kernels(cfg.nsa, layout.seq_len, "tpu", layout=layout), interpret=True)
    assert (plan.cmp, plan.slc, plan.win) == ("splash", "tpu", "splash")
    one = NSAAttention(cfg, kernels=KernelPlan())
    params = jax.jit(one.init)(jax.random.PRNGKey(6), x)["params"]
    split = NSAAttention(cfg, kernels=plan)
    mesh = Mesh(np.asarray(jax.devices()[:C]), (SEQ,))
    spec = PartitionSpec(None, SEQ)
    on_seq = jax.shard_map(
        lambda p, xs: split.apply({"params": p}, xs),
        mesh=mesh,
        in_specs=(PartitionSpec(), spec),
        out_specs=spec,
        check_vma=False,
    )

    def run_split(xx):  # whole sequence in, whole sequence out (device order inside)
        y = on_seq(params, layout.lay_out(xx, 1))
        return _permute_chunks(y, 1, 2 * C, natural_slots(C))[:, :T]

    cot = jax.random.normal(jax.random.PRNGKey(7), x.shape)
    want, grad_want = jax.value_and_grad(lambda xx: jnp.sum(one.apply({"params": params}, xx) * cot))(x)
    got, grad_got = jax.jit(jax.value_and_grad(lambda xx: jnp.sum(run_split(xx) * cot)))(x)
    assert abs(float(got - want)) <= 1e-5 * abs(float(want))
    assert rel_err(grad_got, grad_want) < 1e-5


@pytest.mark.slow
def test_the_guard_checks_splash_at_a_chunk_offset_the_slice_holds():
    # Under context parallelism the guard compiles splash at the run's chunk over the padded sequence,
    # then compares it with XLA on a slice whose queries start at an offset the run's chunks never take
    # (128 of 256; the run's chunks start at multiples of 80): the slice's kernels switch on its own.
    from nsa_jax.kernels.guard import check_branch

    cfg = tiny_model_cfg(G=2, K=2, l=16, d=8, lp=16, n=3, w=16, scorer="minmax")
    layout = SeqLayout(2, 80, 320)
    plan = dataclasses.replace(plan_kernels(cfg.nsa, layout.seq_len, "tpu", layout=layout), interpret=True)
    for branch in ("win", "cmp"):
        assert "splash" in check_branch(cfg, branch, 1, layout.seq_len, plan, rows=layout.chunk)
