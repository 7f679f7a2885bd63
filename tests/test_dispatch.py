"""The kernel plan (what `attention_impl`, `selection_kernel` and `compressed_kernel` resolve to) and each
branch's entry point."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import compressed_visible, reference_attention, reference_group_probs

from nsa_jax.config import NSAConfig, load_config
from nsa_jax.kernels import KernelPlan, compressed_attention, cudnn_fits, plan_kernels, resolve_impl
from nsa_jax.kernels.plan import substitutions
from nsa_jax.kernels.xla import num_compressed
from nsa_jax.nsa.context import SeqLayout

from helpers import assert_close


@pytest.mark.parametrize(
    "impl,backend,expected",
    [("auto", "gpu", "pallas"), ("auto", "cuda", "pallas"), ("auto", "cpu", "xla"), ("pallas", "cpu", "pallas")],
)
def test_resolve_impl(impl, backend, expected):
    assert resolve_impl(impl, backend) == expected


def _plan(seq=4096, backend="gpu", fallback=(), backward=True, layout=None, cudnn_ok=True, **nsa):
    nsa = NSAConfig(**{"n": 16, "lp": 64, **nsa})
    return plan_kernels(nsa, seq, backend, set(fallback), layout, backward=backward, cudnn_ok=cudnn_ok)


def test_plan_names_every_branch():
    assert _plan().describe() == {"cmp": "pallas-triton", "slc": "pallas-triton/gather", "win": "pallas-triton"}
    assert _plan(backend="cpu").describe() == {"cmp": "xla-chunked", "slc": "xla-chunked", "win": "xla-chunked"}
    assert _plan(backend="cpu", attention_impl="pallas").describe()["slc"] == "pallas-interpret/gather"
    assert _plan(backend="cpu", attention_impl="pallas").interpret and not _plan().interpret
    # The block scorer's kernel is named where it is not cmp's own (kernels.BranchCalls.blocks).
    assert "score" not in _plan().describe("cmp")
    assert _plan().describe("minmax")["score"] == "pallas-triton/minmax"
    assert _plan().describe("mix")["score"] == "xla-chunked/mix"
    assert _plan(backend="cpu").describe("minmax")["score"] == "xla-chunked/minmax"


def test_auto_keeps_selection_on_xla_when_the_kernel_cannot_take_the_blocks():
    assert _plan(lp=8).slc == "xla"
    assert _plan(lp=48).slc == "xla"
    assert _plan(lp=64).slc == "gather"
    # Asked for explicitly, pallas stays pallas (and the kernel's argument check names the problem).
    assert _plan(lp=8, attention_impl="pallas").slc == "gather"


def test_plan_picks_the_selection_kernel_by_length():
    # T <= 2 n lp: the block-sparse flash kernel; longer: the gather kernel; xla stays xla.
    assert _plan(seq=2048).slc == "blocksparse"
    assert _plan(seq=2049).slc == "gather"
    assert _plan(seq=2048, backend="cpu").slc == "xla"


def test_selection_kernel_named_in_the_config_wins_at_every_length():
    for seq in (2048, 65536):
        for name in ("blocksparse", "gather"):
            assert _plan(seq=seq, selection_kernel=name).slc == name
            assert _plan(seq=seq, selection_kernel=name).describe()["slc"].endswith(name)
    # XLA stays XLA whatever is named; an unknown name is one error naming the choices.
    assert _plan(backend="cpu", selection_kernel="gather").slc == "xla"
    with pytest.raises(ValueError, match="blocksparse, gather"):
        _plan(selection_kernel="sparse")


def test_compressed_kernel_named_in_the_config_runs_where_pallas_would():
    # cudnn: the attention through cuDNN, scoring on Pallas; only where the branch would run Pallas.
    assert _plan().cmp == _plan(compressed_kernel="pallas").cmp == "pallas"
    assert _plan(compressed_kernel="cudnn").cmp == "cudnn"
    assert _plan(compressed_kernel="cudnn").describe()["cmp"] == "cudnn+pallas-triton"
    assert _plan(backend="cpu", compressed_kernel="cudnn").cmp == "xla"
    # Off a GPU, asked for with pallas: jax's fused attention runs on XLA and the scoring interpreted.
    off_gpu = _plan(backend="cpu", attention_impl="pallas", compressed_kernel="cudnn")
    assert off_gpu.cmp == "cudnn" and off_gpu.describe()["cmp"] == "xla-attention+pallas-interpret"
    # The guard's findings: cuDNN's attention broken -> the flash kernels (under auto only); the branch -> XLA.
    assert _plan(fallback=["cmp-cudnn"], compressed_kernel="cudnn").cmp == "pallas"
    assert _plan(fallback=["cmp-cudnn"], compressed_kernel="cudnn", attention_impl="pallas").cmp == "cudnn"
    assert _plan(fallback=["cmp-cudnn", "cmp"], compressed_kernel="cudnn").describe()["cmp"] == "xla-chunked"
    with pytest.raises(ValueError, match="compressed_kernel must be auto or one of pallas, cudnn"):
        _plan(compressed_kernel="flash")
    with pytest.raises(ValueError, match="KernelPlan.cmp must be one of pallas, cudnn, splash, xla"):
        KernelPlan(cmp="cudnn-v9")


def test_auto_runs_the_compressed_branch_through_cudnn_in_training_from_8k():
    # The rule the H200 figures set (kernels/plan.py): fwd+bwd from T = 8192 through cuDNN, the
    # forward alone and shorter T on the flash kernels; never under a layout (a query offset), never
    # where the guard found cuDNN failing, never off the GPU path.
    assert _plan(seq=8191).cmp == "pallas" and _plan(seq=8192).cmp == "cudnn"
    assert _plan(seq=65536).describe()["cmp"] == "cudnn+pallas-triton"
    assert _plan(seq=65536, backward=False).cmp == "pallas"
    assert _plan(seq=65536, compressed_kernel="pallas").cmp == "pallas"
    assert _plan(seq=2048, compressed_kernel="cudnn", backward=False).cmp == "cudnn"  # named: always
    assert _plan(seq=65536, fallback=["cmp-cudnn"]).cmp == "pallas"
    assert _plan(seq=65536, backend="cpu").cmp == "xla"
    assert _plan(seq=65536, layout=SeqLayout(context=2, chunk=16384, real_len=65536)).cmp == "pallas"
    with pytest.raises(TypeError, match="sequence split"):
        KernelPlan(layout=object())
    assert _plan(seq=65536, cudnn_ok=False).cmp == "pallas"  # fp32, or key and value head dims that differ
    model = load_config("a100_pcie").model
    assert cudnn_fits(model)
    assert not cudnn_fits(dataclasses.replace(model, dtype="float32"))
    assert not cudnn_fits(dataclasses.replace(model, v_head_dim=32))
    # An A100's cuDNN takes head dims up to 128 (Gemma's 256 fails at lowering): auto keeps the flash kernels.
    assert not cudnn_fits(dataclasses.replace(model, head_dim=256, v_head_dim=256))
    assert cudnn_fits(dataclasses.replace(model, head_dim=128, v_head_dim=128))


def test_fallback_moves_only_auto_branches_to_xla():
    assert _plan(fallback=["win"]).describe() == {
        "cmp": "pallas-triton",
        "slc": "pallas-triton/gather",
        "win": "xla-chunked",
    }
    assert _plan(fallback=["win"], attention_impl="pallas").win == "pallas"
    with pytest.raises(ValueError, match="unknown NSA branches"):
        _plan(fallback=["mlp"])


def _asked(backend="gpu", fallback=(), seq=4096, **nsa):
    cfg = NSAConfig(**{"n": 16, "lp": 64, **nsa})
    return substitutions(cfg, [plan_kernels(cfg, seq, backend, fallback=set(fallback))], backend, set(fallback))


def test_what_a_config_asks_and_the_backend_runs_instead_is_named():
    # Honoured, or asked for nothing in particular: nothing to say.
    assert _asked() == _asked(backend="cpu") == _asked(compressed_kernel="cudnn") == []
    assert _asked(backend="cpu", attention_impl="xla") == []
    assert _asked(selection_kernel="blocksparse") == []
    # The GPU kernels named on a CPU.
    assert _asked(backend="cpu", compressed_kernel="cudnn") == [
        "model.nsa.compressed_kernel=cudnn runs as xla-chunked (attention_impl=auto runs XLA on a cpu backend; "
        "the kernels need a GPU)"
    ]
    assert _asked(backend="cpu", selection_kernel="gather") == [
        "model.nsa.selection_kernel=gather runs as xla-chunked (attention_impl=auto runs XLA on a cpu backend; "
        "the kernels need a GPU)"
    ]
    assert _asked(backend="cpu", attention_impl="pallas") == [
        "model.nsa.attention_impl=pallas runs as pallas-interpret (the Pallas interpreter on a cpu backend: for "
        "tests, slow; compiled kernels need a GPU)"
    ]
    pallas_cudnn = _asked(backend="cpu", attention_impl="pallas", compressed_kernel="cudnn")
    assert pallas_cudnn[1] == (
        "model.nsa.compressed_kernel=cudnn runs as xla-attention (jax's fused attention runs on XLA on a cpu backend)"
    )
    # On a GPU: a selection block the kernels cannot take, and what the kernel guard moved.
    assert _asked(selection_kernel="gather", lp=40, d=8) == [
        "model.nsa.selection_kernel=gather runs as xla-chunked (the selection kernels need lp a power of two >= 16, "
        "got 40)"
    ]
    assert _asked(fallback=["slc"], selection_kernel="gather") == [
        "model.nsa.selection_kernel=gather runs as xla-chunked (the kernel guard found its kernel failing)"
    ]
    assert _asked(fallback=["cmp-cudnn"], compressed_kernel="cudnn") == [
        "model.nsa.compressed_kernel=cudnn runs as the flash kernels (the kernel guard found cuDNN's attention failing)"
    ]
    assert _asked(backend="cpu", attention_impl="xla", compressed_kernel="pallas") == [
        "model.nsa.compressed_kernel=pallas runs as xla-chunked (attention_impl=xla runs every branch on XLA)"
    ]


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


@pytest.mark.parametrize("impl", ["xla", "pallas", "cudnn"])
def test_compressed_attention_dispatch_matches_reference(impl):
    # Each implementation behind kernels.compressed_attention (cudnn: jax's fused attention, on XLA
    # off a GPU, with the Pallas log-sum-exp pass and scoring): output against the float64
    # per-token reference, block scores against the reference probabilities summed per block.
    T, G, K, l, d, lp = 40, 2, 2, 16, 8, 16
    q, kc, vc = _cmp_inputs(T, G, K, l=l, d=d)
    if impl == "cudnn":  # cuDNN's attention takes 16-bit inputs; the references see the rounded values
        q, kc, vc = (x.astype(jnp.bfloat16) for x in (q, kc, vc))
    tc = kc.shape[1]
    o, scores = jax.jit(lambda *a: compressed_attention(*a, l=l, d=d, lp=lp, impl=impl, query_chunk=16))(q, kc, vc)
    q, kc, vc = (x.astype(jnp.float32) for x in (q, kc, vc))
    vis = compressed_visible(l, d, tc)
    o_ref = reference_attention(q, kc, vc, None, vis)[0]
    assert_close(np.asarray(o, np.float32), o_ref, 1e-5 if impl != "cudnn" else 2e-2)
    p_BxKxTxTc = reference_group_probs(q, kc, vis)
    n_blocks = -(-T // lp)
    want = np.zeros((1, T, K, n_blocks))
    for j in range(n_blocks):
        for i in range(tc):
            if i * d < (j + 1) * lp and i * d + l > j * lp:  # token i's span overlaps block j
                want[:, :, :, j] += p_BxKxTxTc[:, :, :, i].transpose(0, 2, 1)
    assert scores.shape == want.shape
    assert_close(scores, want, 1e-5 if impl != "cudnn" else 1e-4)


def test_compressed_attention_without_tokens_is_zero():
    q, kc, vc = _cmp_inputs(T=10, l=16, d=8)
    assert kc.shape[1] == 0
    o, scores = compressed_attention(q, kc, vc, l=16, d=8, lp=16, impl="pallas")
    assert o.shape == q.shape and not np.any(np.asarray(o))
    assert scores.shape == (1, 10, 2, 1) and not np.any(np.asarray(scores))
