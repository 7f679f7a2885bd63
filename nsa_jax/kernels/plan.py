"""The kernel plan: which implementation runs each NSA branch, decided in one place.

``plan_kernels`` makes a ``KernelPlan`` for one sequence length and backend from the config
(``attention_impl``, ``selection_kernel``, ``compressed_kernel``, ``lp``, ``n``) and the
branches the kernel guard moved to XLA; the layer takes it as ``NSAAttention.kernels``, the
train step makes one per schedule phase, env.json and the boot line print its ``describe()``.
No process-wide state: a compile for another card asks for that card's backend. The rules:

* ``xla``: every branch on XLA; ``pallas``: every branch on its Pallas kernel (interpreted off
  a GPU); ``auto``: Pallas on a GPU, XLA elsewhere, and XLA for selection when lp is not a
  power of two >= 16 and for any branch in ``fallback``.
* Selection: ``selection_kernel`` when it names one, else ``blocksparse`` for T <= 2 n lp and
  ``gather`` above (docs/PERFORMANCE.md has the figures behind the rule).
* Compressed: ``compressed_kernel`` when it names one; ``auto``: ``cudnn`` (kernels/cudnn.py, then
  a Pallas pass for the log-sum-exp and scoring) in a plan with a backward at T >= 8192 for a
  model that suits it (bf16, equal head dims), where an H200 ran the layer's fwd+bwd 1.10-1.35x
  faster; else ``pallas`` (the flash kernels: the faster forward); ``cmp-cudnn`` in ``fallback``:
  the flash kernels.
* The block scorer (``scorer``, kernels/scorers.py): ``cmp`` scores in the compressed branch's kernels;
  ``minmax`` and ``rescore``'s second stage on Pallas beside the compressed branch's Pallas or cuDNN
  kernels, else on XLA; ``mix`` on XLA.
* A TPU (``auto`` or ``pallas``): selection on the Pallas TPU kernels (kernels/selection_tpu.py) where lp is
  a power of two >= 16 and the guard passed them; the window branch (and dense attention) on jax's splash
  attention (kernels/splash_tpu.py), and the compressed branch too where its scorer needs no
  probabilities from it (not ``cmp``, ``mix`` or ``rescore``, which score in XLA's chunks), unless the
  guard failed them; under context parallelism too (splash's masks are static: one kernel per chunk
  offset, picked by the device's traced one).
* Context parallelism (a ``layout``, nsa/context.py): the same kernels, each device's queries
  at an offset into the whole padded sequence (``seq``: its length). The plan carries the
  layout to the layer; the compressed branch never runs through cuDNN there (no query offset).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

from nsa_jax.kernels.blocksparse_pallas import prefers_blocksparse
from nsa_jax.kernels.pallas_common import is_tile_size
from nsa_jax.kernels.scorers import CMP_SCORERS
from nsa_jax.kernels.selection_pallas import SelectionBlockSizes

BRANCHES = ("cmp", "slc", "win")
# The compressed branch's GPU paths a config may name (NSAConfig.compressed_kernel).
COMPRESSED_KERNELS = ("pallas", "cudnn")
# auto runs cuDNN from this T in a plan with a backward (H200, 2026-11-28, docs/PERFORMANCE.md:
# layer fwd+bwd 3.17 / 10.51 / 24.22 ms against the flash kernels' 3.50 / 14.14 / 30.31 at
# 8k / 32k / 64k; forward alone the flash kernels win, 1.33 against 1.82 ms at 8k).
CUDNN_CMP_MIN_SEQ = 8192
# What the kernel guard may find broken: a branch (it runs on XLA), or cuDNN's attention in the
# compressed branch (the branch runs its flash kernels instead).
CUDNN_CMP = "cmp-cudnn"
FALLBACKS = (*BRANCHES, CUDNN_CMP)
IMPLS = ("auto", "pallas", "xla")
GPU_BACKENDS = ("gpu", "cuda", "rocm")
TPU_BACKENDS = ("tpu",)
# The selection branch's Pallas TPU (Mosaic) kernels (kernels/selection_tpu.py): what a TPU plan runs.
TPU_SELECTION = "tpu"
# jax's splash attention (kernels/splash_tpu.py): a TPU plan's window branch, and its compressed one where
# the scorer reads no probabilities from it.
SPLASH = "splash"

# The selection kernels a config may name, with the tiles each runs (None: blocksparse's own).
# gather: one query position per program (its G heads padded to 16 rows) with one warp: the
# fastest gather tiling on an H200 for random selections (docs/PERFORMANCE.md).
SELECTION_KERNELS: dict[str, SelectionBlockSizes | None] = {
    "blocksparse": None,
    "gather": SelectionBlockSizes(positions=1, num_warps=1),
}


@runtime_checkable
class SequenceSplit(Protocol):
    """What the kernels read of a sequence split over devices (nsa/context.SeqLayout, which sits above
    the kernels, is one): the devices one sequence is split over (C), the tokens of one chunk (S; a
    device's queries are two chunks) and the padded length T' = 2 C S every device's query offsets
    and gathered keys span."""

    @property
    def context(self) -> int: ...

    @property
    def chunk(self) -> int: ...

    @property
    def seq_len(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """What each branch runs: cmp ``pallas``, ``cudnn``, ``splash`` (a TPU) or ``xla``; slc ``blocksparse``,
    ``gather``, ``tpu`` (the Pallas TPU kernels) or ``xla``; win ``pallas``, ``splash`` or ``xla``.

    ``interpret``: the Pallas kernels run in the Pallas interpreter (a backend without a GPU).
    ``layout``: under context parallelism, the sequence layout the layer reads its chunks
    through (nsa/context.SeqLayout); None: every device holds whole sequences.
    """

    cmp: str = "xla"
    slc: str = "xla"
    win: str = "xla"
    interpret: bool = False
    layout: SequenceSplit | None = None  # nsa/context.SeqLayout under context parallelism

    @property
    def context(self) -> int:
        """Devices one sequence is split over (parallel.context)."""
        return 1 if self.layout is None else self.layout.context

    def __post_init__(self):
        if self.layout is not None and not isinstance(self.layout, SequenceSplit):
            raise TypeError(f"KernelPlan.layout must be a sequence split (nsa/context.SeqLayout), got {self.layout!r}")
        for branch, allowed in (
            ("cmp", (*COMPRESSED_KERNELS, SPLASH, "xla")),
            ("slc", (*SELECTION_KERNELS, TPU_SELECTION, "xla")),
            ("win", ("pallas", SPLASH, "xla")),
        ):
            if getattr(self, branch) not in allowed:
                raise ValueError(
                    f"KernelPlan.{branch} must be one of {', '.join(allowed)}, got {getattr(self, branch)!r}"
                )

    def describe(self, scorer: str = "cmp") -> dict[str, str]:
        """Per branch, for env.json and the boot line: ``pallas-triton`` (selection:
        ``pallas-triton/gather``, ...), ``pallas-interpret`` or ``xla-chunked``; the compressed
        branch through cuDNN ``cudnn+pallas-triton`` (scoring on Pallas), ``xla-attention+pallas-interpret``
        off a GPU, where jax's fused attention runs on XLA. Under context parallelism a
        ``context`` entry says how the sequence is split and what crosses devices. A block scorer
        other than cmp's (model.nsa.scorer) adds ``score``: minmax fused with top-n, or rescore's second
        stage, on Pallas where the compressed branch runs its kernels (``pallas-triton/minmax``,
        ``pallas-triton/rescore``), else ``xla-chunked/<scorer>``."""
        pallas = "pallas-interpret" if self.interpret else "pallas-triton"
        slc = "xla-chunked" if self.slc == "xla" else f"{pallas}/{self.slc}"
        if self.slc == TPU_SELECTION:
            slc = "pallas-interpret/tpu" if self.interpret else "pallas-mosaic"
        splash = "pallas-interpret/splash" if self.interpret else "pallas-mosaic/splash"
        cmp = {"pallas": pallas, "xla": "xla-chunked", SPLASH: splash}.get(self.cmp)
        if self.cmp == "cudnn":
            cmp = f"{'xla-attention' if self.interpret else 'cudnn'}+{pallas}"
        out = {
            "cmp": cmp,
            "slc": slc,
            "win": {"pallas": pallas, SPLASH: splash}.get(self.win, "xla-chunked"),
        }
        if scorer != "cmp":  # the kernel BranchCalls.blocks runs
            fused = scorer in ("minmax", "rescore") and self.cmp in COMPRESSED_KERNELS
            out["score"] = f"{pallas}/{scorer}" if fused else f"xla-chunked/{scorer}"
        if self.context > 1:
            out["context"] = f"{self.context} devices per sequence (zig-zag chunks; K/V all-gathered over seq)"
        return out


def resolve_impl(impl: str, backend: str) -> str:
    """What `impl` (NSAConfig.attention_impl) stands for on `backend`: ``pallas`` or ``xla``."""
    if impl not in IMPLS:
        raise ValueError(f"attention_impl must be auto, pallas or xla, got {impl!r}")
    if impl != "auto":
        return impl
    return "pallas" if backend in GPU_BACKENDS else "xla"


def selection_kernel_fits(block_size: int) -> bool:
    """Whether the Pallas selection kernels take blocks of `block_size` (a power of two >= 16)."""
    return is_tile_size(block_size)


# cuDNN's fused attention takes head dims up to 128 on an A100 (256 from Hopper; jax's
# fused_attention_stablehlo checks it at lowering): the bound every card this project targets meets.
CUDNN_MAX_HEAD_DIM = 128


def cudnn_fits(model) -> bool:
    """Whether `model`'s (a ModelConfig) attention suits cuDNN's fused kernel: bf16, equal key and value
    head dims of at most CUDNN_MAX_HEAD_DIM, a multiple of 8 (Gemma's 256 does not)."""
    Dk = model.head_dim
    return model.dtype == "bfloat16" and Dk == model.v_head_dim and Dk <= CUDNN_MAX_HEAD_DIM and Dk % 8 == 0


def plan_kernels(
    nsa, seq: int, backend: str, fallback=frozenset(), layout=None, backward: bool = True, cudnn_ok: bool = False
) -> KernelPlan:
    """The plan of `nsa` (an NSAConfig) at sequence length `seq` on `backend` (see the module docstring).

    `fallback`: what the kernel guard found broken (``FALLBACKS``): branches, which ``auto``
    runs on XLA, and ``cmp-cudnn``, with which ``auto`` runs the compressed branch's flash
    kernels where the config names cudnn. `layout`: the sequence layout under context
    parallelism (nsa/context.SeqLayout; `seq` is then its padded length), kept in the plan.
    `backward`: whether the plan's calls are differentiated (False: evaluation and inference).
    `cudnn_ok`: the model suits cuDNN's fused attention (``cudnn_fits``); ``auto`` takes it only then.
    """
    unknown = set(fallback) - set(FALLBACKS)
    if unknown:
        raise ValueError(f"unknown NSA branches {sorted(unknown)}")
    choice = nsa.selection_kernel
    if choice != "auto" and choice not in SELECTION_KERNELS:
        raise ValueError(f"selection_kernel must be auto or one of {', '.join(SELECTION_KERNELS)}, got {choice!r}")
    cmp_choice = nsa.compressed_kernel
    if cmp_choice != "auto" and cmp_choice not in COMPRESSED_KERNELS:
        raise ValueError(
            f"compressed_kernel must be auto or one of {', '.join(COMPRESSED_KERNELS)}, got {cmp_choice!r}"
        )
    if backend in TPU_BACKENDS and nsa.attention_impl != "xla":
        return _tpu_plan(nsa, fallback, layout)
    chosen = resolve_impl(nsa.attention_impl, backend)
    auto = nsa.attention_impl == "auto"

    def impl(branch: str) -> str:
        return "xla" if auto and branch in fallback else chosen

    slc = impl("slc")
    if slc == "pallas":
        if auto and not selection_kernel_fits(nsa.lp):
            slc = "xla"
        elif choice != "auto":
            slc = choice
        else:
            slc = "blocksparse" if prefers_blocksparse(seq, nsa.n, nsa.lp) else "gather"
    cmp = impl("cmp")
    if cmp_choice == "auto":
        cmp_choice = "cudnn" if cudnn_ok and backward and seq >= CUDNN_CMP_MIN_SEQ else "pallas"
    if cmp == "pallas" and not (auto and CUDNN_CMP in fallback) and layout is None:
        cmp = cmp_choice
    return KernelPlan(cmp=cmp, slc=slc, win=impl("win"), interpret=backend not in GPU_BACKENDS, layout=layout)


def _tpu_plan(nsa, fallback, layout) -> KernelPlan:
    """A TPU's plan (the module docstring's rule)."""
    slc = "xla" if "slc" in fallback or not selection_kernel_fits(nsa.lp) else TPU_SELECTION
    win = SPLASH if "win" not in fallback else "xla"
    scored = "slc" in nsa.branches and nsa.scorer in CMP_SCORERS
    cmp = SPLASH if not scored and "cmp" not in fallback else "xla"
    return KernelPlan(cmp=cmp, slc=slc, win=win, layout=layout)


def substitutions(nsa, plans: list[KernelPlan], backend: str, fallback=frozenset()) -> list[str]:
    """What `nsa` (an NSAConfig) asks for that its `plans` (one per schedule phase) do not run on `backend`,
    each as `model.nsa.KEY=VALUE runs as WHAT (why)`; [] when every setting is honoured.

    `auto` settings ask for nothing in particular; a Pallas kernel named off a GPU runs in the
    interpreter, and XLA stands in where a kernel cannot run (attention_impl, the backend, lp, the
    kernel guard's `fallback`).
    """
    out: list[str] = []

    def on_xla(branch: str) -> str:
        if nsa.attention_impl == "xla":
            return "attention_impl=xla runs every branch on XLA"
        if backend not in GPU_BACKENDS and nsa.attention_impl == "auto":
            return f"attention_impl=auto runs XLA on a {backend} backend; the kernels need a GPU"
        if branch in fallback:
            return "the kernel guard found its kernel failing"
        return f"the selection kernels need lp a power of two >= 16, got {nsa.lp}"

    if backend in TPU_BACKENDS and nsa.attention_impl != "xla":
        if nsa.attention_impl == "pallas":
            out.append(
                "model.nsa.attention_impl=pallas runs as pallas-mosaic: the selection kernels and splash attention "
                "(the project's other Pallas kernels are Triton's: a GPU's)"
            )
        for branch, name in (("win", "window"), ("cmp", "compressed")):
            if branch in fallback and branch in nsa.branches:
                out.append(f"the {name} branch runs as xla-chunked (the kernel guard found splash attention failing)")
        for key in ("selection_kernel", "compressed_kernel"):
            if getattr(nsa, key) != "auto":
                out.append(f"model.nsa.{key}={getattr(nsa, key)} names a GPU kernel; a TPU runs its own")
        if any(p.slc == "xla" for p in plans):
            why = "the kernel guard found its kernel failing" if "slc" in fallback else on_xla("lp")
            out.append(f"the selection branch runs as xla-chunked ({why})")
        return out
    if nsa.attention_impl == "pallas" and any(p.interpret for p in plans):
        out.append(
            f"model.nsa.attention_impl=pallas runs as pallas-interpret (the Pallas interpreter on a {backend} "
            "backend: for tests, slow; compiled kernels need a GPU)"
        )
    if nsa.selection_kernel != "auto" and any(p.slc == "xla" for p in plans):
        out.append(f"model.nsa.selection_kernel={nsa.selection_kernel} runs as xla-chunked ({on_xla('slc')})")
    if nsa.compressed_kernel != "auto":
        cmp = {p.cmp for p in plans}
        asked = f"model.nsa.compressed_kernel={nsa.compressed_kernel}"
        if "xla" in cmp:
            out.append(f"{asked} runs as xla-chunked ({on_xla('cmp')})")
        elif nsa.compressed_kernel == "cudnn" and "pallas" in cmp:
            out.append(f"{asked} runs as the flash kernels (the kernel guard found cuDNN's attention failing)")
        elif nsa.compressed_kernel == "cudnn" and any(p.interpret for p in plans):
            out.append(f"{asked} runs as xla-attention (jax's fused attention runs on XLA on a {backend} backend)")
    return out
