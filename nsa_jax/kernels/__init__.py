"""Attention kernels for the NSA branches, and their dispatch.

One entry point per NSA branch (`compressed_attention`, `selection_attention`,
`window_attention`) runs the implementation it is given: `xla` (the reference and
CPU path, kernels/xla.py) or a Pallas kernel (Triton backend: compressed_pallas with
block_scores_pallas, or `cudnn`: cuDNN's fused attention with block_scores_pallas;
selection's `blocksparse` (blocksparse_pallas) or `gather` (selection_pallas);
flash_pallas for the window; on a TPU, selection_tpu's Mosaic kernels and jax's splash
attention (splash_tpu) for the window and compressed branches). Which one each branch runs is the
kernel plan's decision (kernels/plan.py, `plan_kernels`), made once from the config,
the backend and the kernel guard's findings and passed to the layer. `interpret`
says whether a Pallas kernel runs in the interpreter; None: when the default backend
is not a GPU.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from nsa_jax.config import NSAConfig
from nsa_jax.kernels.block_scores_pallas import (
    compressed_attention_only,
    compressed_attention_scores_pallas,
    compressed_attention_select_pallas,
)
from nsa_jax.kernels.blocksparse_pallas import selection_attention_blocksparse_pallas
from nsa_jax.kernels.flash_pallas import window_attention_pallas
from nsa_jax.kernels.minmax_pallas import select_minmax_pallas
from nsa_jax.kernels.plan import (
    COMPRESSED_KERNELS,
    CUDNN_CMP,
    SELECTION_KERNELS,
    SPLASH,
    TPU_SELECTION,
    KernelPlan,
    cudnn_fits,
    plan_kernels,
    resolve_impl,
    selection_kernel_fits,
)
from nsa_jax.kernels.rescore_pallas import select_rescore_pallas
from nsa_jax.kernels.scorers import (
    CMP_SCORERS,
    SCORERS,
    scorer_candidates,
    scorer_sub,
    select_minmax_xla,
    select_rescore_xla,
)
from nsa_jax.kernels.selection_pallas import selection_attention_pallas
from nsa_jax.kernels.selection_tpu import selection_attention_tpu
from nsa_jax.kernels.splash_tpu import compressed_attention_splash, window_attention_splash
from nsa_jax.kernels.xla import (
    compressed_attention_xla,
    select_blocks,
    selection_attention_xla,
    window_attention_xla,
)

__all__ = [
    "BranchCalls",
    "COMPRESSED_KERNELS",
    "CUDNN_CMP",
    "SCORERS",
    "SELECTION_KERNELS",
    "KernelPlan",
    "compressed_attention",
    "cudnn_fits",
    "interpret_pallas",
    "plan_kernels",
    "resolve_impl",
    "selection_attention",
    "selection_attention_blocksparse_pallas",
    "selection_attention_pallas",
    "selection_attention_tpu",
    "selection_attention_xla",
    "selection_kernel_fits",
    "window_attention",
]


def interpret_pallas() -> bool:
    """Whether Pallas kernels run in the interpreter by default: when jax's backend is not a GPU."""
    return jax.default_backend() not in ("gpu", "cuda")


def _interpret(interpret: bool | None) -> bool:
    return interpret_pallas() if interpret is None else bool(interpret)


def selection_attention(
    q, k, v, idx, block_size, scale=None, *, kernel="xla", interpret=None, query_chunk=512, q_offset=0, softcap=0.0
):
    """Selection attention through `kernel` (`blocksparse`, `gather`, `tpu` or `xla`; contract: docs/NSA.md).

    `q_offset` (int or traced int32, every entry point here): query row r stands at position
    r + q_offset of the keys, which cover the whole sequence (context parallelism, nsa/context.py).
    """
    if softcap and kernel != "xla":
        raise ValueError("selection attention with softcap runs in XLA only (kernel='xla')")
    if kernel == TPU_SELECTION:
        return selection_attention_tpu(
            q, k, v, idx, block_size, scale, interpret=_interpret(interpret), q_offset=q_offset
        )
    if kernel == "blocksparse":
        return selection_attention_blocksparse_pallas(
            q, k, v, idx, block_size, scale, interpret=_interpret(interpret), q_offset=q_offset
        )
    if kernel in SELECTION_KERNELS:
        return selection_attention_pallas(
            q,
            k,
            v,
            idx,
            block_size,
            scale,
            interpret=_interpret(interpret),
            block_sizes=SELECTION_KERNELS[kernel],
            q_offset=q_offset,
        )
    if kernel != "xla":
        raise ValueError(
            f"selection kernel must be one of {', '.join(SELECTION_KERNELS)}, {TPU_SELECTION} or xla, got {kernel!r}"
        )
    return selection_attention_xla(
        q, k, v, idx, block_size, scale, query_chunk=query_chunk, q_offset=q_offset, softcap=softcap
    )


def window_attention(
    q, k, v, window, scale=None, *, impl="xla", interpret=None, query_chunk=512, q_offset=0, offsets=None, softcap=0.0
):
    """Sliding-window attention through `impl` (`pallas`, `splash` or `xla`); `softcap` (Gemma 2's scores
    c * tanh(s / c)) runs in XLA only; `splash` at a traced `q_offset` runs one kernel per value in
    `offsets` (splash_tpu._at_offset), which the other kernels do not read."""
    if softcap and impl != "xla":
        raise ValueError("window attention with softcap runs in XLA only (impl='xla')")
    if impl == SPLASH:
        kw = dict(q_offset=q_offset, offsets=offsets, interpret=_interpret(interpret))
        return window_attention_splash(q, k, v, window, scale, **kw)
    if impl == "pallas":
        return window_attention_pallas(q, k, v, window, scale, interpret=_interpret(interpret), q_offset=q_offset)
    return window_attention_xla(q, k, v, window, scale, query_chunk=query_chunk, q_offset=q_offset, softcap=softcap)


def compressed_attention(
    q,
    kc,
    vc,
    *,
    l,
    d,
    lp,
    scale=None,
    impl="xla",
    interpret=None,
    query_chunk=512,
    select_n=None,
    t_T=None,
    q_offset=0,
    offsets=None,
    num_blocks=None,
    scores=True,
    softcap=0.0,
):
    """Compressed-branch attention and the selection-block scores (or blocks) through `impl` (`pallas`,
    `cudnn`, `splash` (the attention alone; at a traced `q_offset` one kernel per value in `offsets`) or `xla`).

    Query t sees compressed token i iff i*d + l - 1 <= t; a query that sees none
    gets 0. Returns o [B, T, H, Dv] in q's dtype and the group block scores
    [B, T, K, Nb] fp32 (probabilities summed over the G heads of each group, then
    over the compressed tokens overlapping each selection block of lp; no gradient).
    With `select_n`, the second output is instead the selected blocks
    [B, T, K, select_n] int32, select_blocks(scores, lp, select_n, t_T)'s contract:
    `xla` runs select_blocks over its own scores; `pallas` scores and selects in one
    kernel (block_scores_pallas), so no probability or block-score tensor exists; `cudnn`
    likewise, with the attention itself through cuDNN (block_scores_pallas' ``attention``).
    `q_offset`: query row r stands at position r + q_offset (cuDNN's causal attention
    takes none: the kernel plan never names `cudnn` under context parallelism);
    `num_blocks`: Nb, the selection blocks of the whole sequence (default ceil(T / lp)).
    `t_T` defaults to the rows' positions. `scores`: True (Eq. 9, the `cmp` scorer) or False (the
    attention alone: o and None, for a scorer that reads the selection keys, kernels/scorers.py).
    """
    if impl not in (*COMPRESSED_KERNELS, SPLASH, "xla"):
        raise ValueError(
            f"compressed branch impl must be one of {', '.join(COMPRESSED_KERNELS)}, {SPLASH} or xla, got {impl!r}"
        )
    if scores is not True and scores is not False:
        raise ValueError(f"compressed branch scores must be True or False, got {scores!r}")
    if softcap and impl != "xla":
        raise ValueError("the compressed branch with softcap runs in XLA only (impl='xla')")
    if impl == SPLASH:
        if scores:
            raise ValueError("splash attention forms no probabilities: the cmp scores run on xla (or a GPU's kernels)")
    pool = "sum" if scores else None
    B, T, H, Dk = q.shape
    Tc, K, Dv = kc.shape[1], kc.shape[2], vc.shape[3]
    n_blocks = -(-T // lp) if num_blocks is None else num_blocks
    scale = Dk**-0.5 if scale is None else scale
    if t_T is None and not (isinstance(q_offset, int) and q_offset == 0):
        t_T = q_offset + jnp.arange(T, dtype=jnp.int32)
    if Tc == 0:
        o, s = jnp.zeros((B, T, H, Dv), q.dtype), jnp.zeros((B, T, K, n_blocks), jnp.float32)
    elif impl == SPLASH:
        kw = dict(l=l, d=d, scale=scale, q_offset=q_offset, offsets=offsets, interpret=_interpret(interpret))
        return compressed_attention_splash(q, kc, vc, **kw), None
    elif impl in COMPRESSED_KERNELS:
        attention = "cudnn" if impl == "cudnn" else "flash"
        kw = dict(l=l, d=d, lp=lp, scale=scale, interpret=_interpret(interpret), attention=attention)
        kw.update(q_offset=q_offset, num_blocks=num_blocks)
        if pool is None:
            return compressed_attention_only(q, kc, vc, **kw), None
        if select_n is None:
            return compressed_attention_scores_pallas(q, kc, vc, **kw)
        return compressed_attention_select_pallas(q, kc, vc, n=select_n, t_T=t_T, **kw)
    else:
        o, s = compressed_attention_xla(
            q, kc, vc, l=l, d=d, lp=lp, scale=scale, query_chunk=query_chunk, q_offset=q_offset, num_blocks=num_blocks,
            pool=pool, softcap=softcap,
        )  # fmt: skip
    if pool is None:
        return o, None
    return o, (s if select_n is None else select_blocks(s, lp, select_n, t_T))


@dataclasses.dataclass(frozen=True)
class BranchCalls:
    """The three branches bound to a kernel plan and the NSA hyper-parameters: the one place their
    calls are spelled (the layer's paths, dense attention and the kernel guard all call these).

    Each takes `q_offset` (queries that start past position 0 over the whole sequence's keys) and
    an `impl` that overrides the plan's ("xla": the reference the guard compares against).
    """

    nsa: NSAConfig
    plan: KernelPlan
    # model.attn_softcap (Gemma 2): every branch's scores capped, on XLA (no Pallas kernel caps them).
    softcap: float = 0.0

    def _run(self) -> dict:
        return {"interpret": self.plan.interpret, "query_chunk": self.nsa.query_chunk}

    def _offsets(self) -> tuple[int, ...] | None:
        """The query offsets a device's pieces can start at under context parallelism (every chunk's first
        position), for the kernels whose masks are static (splash); None on whole sequences."""
        layout = self.plan.layout
        return None if layout is None else tuple(range(0, layout.seq_len, layout.chunk))

    def compressed(self, q, kc, vc, *, t_T=None, q_offset=0, num_blocks=None, impl=None):
        """(o [B, T, H, Dv], what the selection takes from the compressed branch: under `cmp` the
        selected blocks [B, T, K, n]; under `rescore` cmp's best scorer_candidates blocks for `blocks`;
        under `mix` cmp's block scores [B, T, K, Nb] for `blocks`; None under `minmax` or without a
        selection branch)."""
        a = self.nsa
        scored = "slc" in a.branches and a.scorer in CMP_SCORERS
        select_n = {"cmp": a.n, "rescore": scorer_candidates(a)}.get(a.scorer) if scored else None
        o, out = compressed_attention(
            q, kc, vc, l=a.l, d=a.d, lp=a.lp, select_n=select_n, t_T=t_T,
            impl="xla" if self.softcap else impl or self.plan.cmp, q_offset=q_offset, offsets=self._offsets(),
            num_blocks=num_blocks,
            scores=scored, softcap=self.softcap, **self._run(),
        )  # fmt: skip
        return o, out

    def blocks(self, q, k, *, q_offset=0, num_blocks=None, impl=None, cmp_scores=None):
        """The selected blocks [B, T, K, n] of a scorer that reads the selection keys (`minmax`, `mix`,
        `rescore`; the whole sequence's keys `k`; `cmp_scores`: what `compressed` gave, mix's other half
        or rescore's candidates): minmax's fused kernel and rescore's second stage on Pallas where the
        plan runs the compressed branch's kernels (minmax_pallas, rescore_pallas), else XLA one query
        chunk at a time (mix everywhere)."""
        a = self.nsa
        if a.scorer == "rescore" and cmp_scores is not None:
            if (impl or self.plan.cmp) in COMPRESSED_KERNELS:
                interpret = _interpret(self.plan.interpret)
                return select_rescore_pallas(q, k, cmp_scores, lp=a.lp, n=a.n, q_offset=q_offset, interpret=interpret)
            return select_rescore_xla(q, k, cmp_scores, lp=a.lp, n=a.n, query_chunk=a.query_chunk, q_offset=q_offset)
        if a.scorer not in ("minmax", "mix") or (a.scorer == "mix") != (cmp_scores is not None):
            raise ValueError(f"scorer {a.scorer!r}: blocks() takes minmax, or mix or rescore with cmp's output")
        kw = dict(lp=a.lp, n=a.n, sub=scorer_sub(a), q_offset=q_offset, num_blocks=num_blocks)
        # Capped scores rank as the raw ones (tanh is increasing): the minmax scorer needs no cap.
        if a.scorer == "minmax" and (impl or self.plan.cmp) in COMPRESSED_KERNELS:
            return select_minmax_pallas(q, k, interpret=_interpret(self.plan.interpret), **kw)
        return select_minmax_xla(q, k, query_chunk=a.query_chunk, plus_scores=cmp_scores, **kw)

    def selection(self, q, k, v, idx, *, q_offset=0, impl=None):
        kernel = "xla" if impl == "xla" or self.softcap else self.plan.slc
        return selection_attention(
            q, k, v, idx, self.nsa.lp, kernel=kernel, q_offset=q_offset, softcap=self.softcap, **self._run()
        )

    def window(self, q, k, v, *, window=None, q_offset=0, impl=None):
        """`window`: keys a query sees (default model.nsa.w; dense attention passes its own)."""
        w = self.nsa.w if window is None else window
        impl = "xla" if self.softcap else impl or self.plan.win
        kw = dict(impl=impl, q_offset=q_offset, offsets=self._offsets(), softcap=self.softcap)
        return window_attention(q, k, v, w, **kw, **self._run())
