"""The boot-time kernel guard (nsa_jax/kernels/guard.py): a kernel that fails to compile or
disagrees with XLA sends its branch to XLA with one warning line; CPU runs skip it.

The guard is forced on CPU, where the Pallas kernels run interpreted, and failures are
injected by replacing a kernel in the dispatch module.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import nsa_jax.kernels as K
import nsa_jax.kernels.block_scores_pallas as block_scores_module
import nsa_jax.kernels.plan as plan_module
from nsa_jax.config import load_config
from nsa_jax.evaluation.heldout import make_eval_fn
from nsa_jax.evaluation.scorer import make_score_fn
from nsa_jax.kernels.guard import guard_kernels
from nsa_jax.mesh import make_mesh
from nsa_jax.model import init_params
from nsa_jax.nsa.context import SeqLayout
from nsa_jax.seq_layout import chunk_len

# A small auto model: G = 2, lp = 16, n = 3, window 32; T = 64 runs the block-sparse selection kernel.
SEQ = 64


def _model_cfg():
    overrides = [
        "model.nsa.attention_impl=auto",
        "model.n_heads=4",
        "model.head_dim=16",
        "model.v_head_dim=16",
        "model.nsa.l=16",
        "model.nsa.d=8",
        "model.nsa.lp=16",
        "model.nsa.n=3",
        "model.nsa.w=32",
    ]
    return load_config("cpu_tiny", overrides).model


def test_guard_costs_nothing_on_cpu_unless_forced(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the guard ran a kernel on a CPU run")

    monkeypatch.setattr(K, "window_attention_pallas", boom)
    cfg = _model_cfg()
    assert guard_kernels(cfg, 1, SEQ, warn=boom) == {}
    pallas = dataclasses.replace(cfg, nsa=dataclasses.replace(cfg.nsa, attention_impl="pallas"))
    assert guard_kernels(pallas, 1, SEQ, force=True, warn=boom) == {}  # only `auto` is guarded


@pytest.mark.slow
def test_guard_falls_back_per_branch_on_compile_error_and_wrong_result(monkeypatch):
    real_select = K.selection_attention_blocksparse_pallas

    def no_compile(*a, **k):
        raise RuntimeError("RESOURCE_EXHAUSTED: Shared memory size limit exceeded: requested 999999")

    def off_by_half(*a, **k):
        return real_select(*a, **k) * 1.5

    monkeypatch.setattr(K, "window_attention_pallas", no_compile)
    monkeypatch.setattr(K, "selection_attention_blocksparse_pallas", off_by_half)
    lines = []
    failed = guard_kernels(_model_cfg(), 1, SEQ, force=True, warn=lines.append)

    assert set(failed) == {"win", "slc"}  # the compressed kernels are intact and stay on Pallas
    assert len(lines) == 2
    win = next(line for line in lines if "win branch" in line)
    slc = next(line for line in lines if "slc branch" in line)
    assert win.startswith("warning: kernel guard: flash_pallas (nsa_window_*) failed to compile")
    assert "RESOURCE_EXHAUSTED: Shared memory size limit exceeded" in win
    assert win.endswith("the win branch runs on XLA")
    assert slc.startswith("warning: kernel guard: blocksparse_pallas (nsa_selection_bsp_*) disagrees with XLA")
    assert "output differs from XLA" in slc
    # The run's plan takes the failed branches to XLA, as on a GPU the step would trace them.
    cfg = _model_cfg()
    desc = K.plan_kernels(cfg.nsa, SEQ, "gpu", fallback=set(failed)).describe()
    assert desc == {"cmp": "pallas-triton", "slc": "xla-chunked", "win": "xla-chunked"}
    pallas = dataclasses.replace(cfg.nsa, attention_impl="pallas")  # asked for explicitly: no fallback
    assert K.plan_kernels(pallas, SEQ, "gpu", fallback=set(failed)).win == "pallas"


@pytest.mark.slow
def test_guard_checks_the_compressed_branch_through_cudnn_when_the_config_names_it(monkeypatch):
    # compressed_kernel: cudnn is checked as it runs: the fused attention (XLA's here) with the Pallas
    # log-sum-exp pass and scoring agrees with XLA. When the fused attention fails (a card or cuDNN
    # without it), the branch runs its flash kernels, once they pass; XLA only when those fail too.
    cfg = _model_cfg()  # in bf16: cuDNN's attention takes 16-bit inputs (a GPU runs it)
    nsa = dataclasses.replace(cfg.nsa, compressed_kernel="cudnn", branches=("cmp",))
    cfg = dataclasses.replace(cfg, dtype="bfloat16", nsa=nsa)
    lines = []
    assert guard_kernels(cfg, 1, SEQ, force=True, warn=lines.append) == {} and lines == []

    def unsupported(*a, **k):
        raise RuntimeError("Unsupported compute capability for cuDNN flash attention")

    monkeypatch.setattr(block_scores_module, "compressed_attention_grouped", unsupported)
    failed = guard_kernels(cfg, 1, SEQ, force=True, warn=lines.append)
    assert set(failed) == {K.CUDNN_CMP} and len(lines) == 1
    assert lines[0] == (
        "warning: kernel guard: cuDNN fused attention + block_scores_pallas (nsa_cmp_lse, nsa_block_select) "
        "failed to compile: RuntimeError: Unsupported compute capability for cuDNN flash attention; "
        "the cmp branch runs its flash kernels"
    )
    assert K.plan_kernels(cfg.nsa, SEQ, "gpu", fallback=set(failed)).describe()["cmp"] == "pallas-triton"

    real_lse = block_scores_module.compressed_attention_lse_pallas

    def doubled(*a, **k):  # the flash kernels wrong as well: the branch goes to XLA
        o, lse, scale = real_lse(*a, **k)
        return o * 2, lse, scale

    monkeypatch.setattr(block_scores_module, "compressed_attention_lse_pallas", doubled)
    lines.clear()
    failed = guard_kernels(cfg, 1, SEQ, force=True, warn=lines.append)
    assert set(failed) == {K.CUDNN_CMP, "cmp"} and len(lines) == 2
    assert lines[1].startswith(
        "warning: kernel guard: compressed_pallas/block_scores_pallas (nsa_cmp_*, nsa_block_select)"
    )
    assert lines[1].endswith("the cmp branch runs on XLA")
    assert K.plan_kernels(cfg.nsa, SEQ, "gpu", fallback=set(failed)).cmp == "xla"


@pytest.mark.slow
def test_evaluation_runs_the_branches_the_guard_moved_to_xla_there_too(monkeypatch):
    """The held-out evaluation and the long-context scorer of a run honour its kernel guard's fallback."""
    model = _model_cfg()  # attention_impl auto: the guard's fallback applies to it
    cfg = dataclasses.replace(load_config("cpu_tiny"), model=model)
    params = init_params(model, jax.random.PRNGKey(0), SEQ)  # on the CPU: XLA

    def broken(*a, **k):
        raise RuntimeError("RESOURCE_EXHAUSTED: the kernel the guard rejected ran")

    # `auto` picks Pallas as on a GPU (interpreted here); the selection kernels are the broken ones.
    monkeypatch.setattr(plan_module, "resolve_impl", lambda impl, backend: "pallas")
    monkeypatch.setattr(K, "selection_attention_blocksparse_pallas", broken)
    monkeypatch.setattr(K, "selection_attention_pallas", broken)
    tokens = jnp.arange(2 * (SEQ + 1), dtype=jnp.int32).reshape(2, SEQ + 1) % model.vocab_size
    mesh = make_mesh(cfg, jax.devices()[:1])
    for fn in (make_eval_fn(cfg, mesh, frozenset({"slc"})), make_score_fn(model, frozenset({"slc"}))):
        jax.tree.map(lambda x: x.block_until_ready(), fn(params, tokens))  # the selection on XLA: no error
    for fn in (make_eval_fn(cfg, mesh), make_score_fn(model)):
        with pytest.raises(RuntimeError, match="the kernel the guard rejected ran"):
            fn(params, tokens)


@pytest.mark.slow
def test_guard_under_context_parallelism_checks_the_kernels_at_a_query_offset(monkeypatch):
    """parallel.context=2: each branch compiled for one device's chunk of queries over the whole padded
    sequence, compared at an offset; a kernel that ignores the offset is caught and moved to XLA."""
    cfg = _model_cfg()
    layout = SeqLayout(2, chunk_len(2 * SEQ, 2, cfg.nsa.l, cfg.nsa.lp), 2 * SEQ)
    lines = []
    assert guard_kernels(cfg, 1, 2 * SEQ, force=True, warn=lines.append, layout=layout) == {} and lines == []

    real_window = K.window_attention_pallas

    def offset_ignored(*a, q_offset=0, **k):
        return real_window(*a, **k) if isinstance(q_offset, int) else real_window(*a, **k, q_offset=0)

    def sliced_keys(q, k, v, *a, q_offset=0, **kw):  # the keys of the rows' own positions, as if unsplit
        return offset_ignored(q, k[:, : q.shape[1]], v[:, : q.shape[1]], *a, q_offset=q_offset, **kw)

    monkeypatch.setattr(K, "window_attention_pallas", sliced_keys)
    failed = guard_kernels(cfg, 1, 2 * SEQ, force=True, warn=lines.append, layout=layout)
    assert set(failed) == {"win"}
    assert lines[0].startswith("warning: kernel guard: flash_pallas (nsa_window_*) disagrees with XLA")


@pytest.mark.slow
@pytest.mark.parametrize(
    "scorer,kernel",
    [("minmax", "minmax_pallas (nsa_minmax_select)"), ("rescore", "rescore_pallas (nsa_rescore_select)")],
)
def test_guard_checks_the_key_scoring_kernel_with_the_compressed_branch(monkeypatch, scorer, kernel):
    """scorer=minmax (rescore): the compressed branch's check covers the fused minmax kernel's (the
    second stage's) blocks too, and a kernel that picks other blocks sends the branch (its attention
    and its scoring) to XLA."""
    cfg = _model_cfg()
    cfg = dataclasses.replace(cfg, nsa=dataclasses.replace(cfg.nsa, scorer=scorer, n=4, scorer_candidates=0))
    assert guard_kernels(cfg, 1, SEQ, force=True, warn=pytest.fail) == {}
    name = f"select_{scorer}_pallas"
    real = getattr(K, name)
    monkeypatch.setattr(K, name, lambda *a, **k: jnp.flip(real(*a, **k), axis=1))
    lines = []
    failed = guard_kernels(cfg, 1, SEQ, force=True, warn=lines.append)
    assert set(failed) == {"cmp"}, failed
    assert (
        lines == [f"warning: kernel guard: {failed['cmp']}; the cmp branch runs on XLA"]
        and f"{kernel} disagrees with XLA: selected blocks agree" in lines[0]
    ), lines
