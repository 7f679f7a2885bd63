"""The kernel guard: checks each branch's Pallas kernels before the first training step.

With `attention_impl: auto` on a GPU, `guard_kernels` takes each NSA branch the run
uses and

1. compiles its Pallas forward and backward at the run's shapes (per-device batch,
   sequence length, heads, dtype), which is where a kernel that does not fit the card
   (shared memory, an unsupported op) fails;
2. runs the Pallas and the XLA path (kernels/xla.py, the reference) on a small slice
   of random inputs and compares outputs and gradients.

A branch whose kernel fails either check is returned with one warning line; the run's
kernel plan (`plan_kernels(..., fallback=...)`) then runs it on XLA. Elsewhere, or with
`pallas` / `xla` asked for, it returns at once unless `force=True` (tests: interpreted
kernels). Selection is checked with the kernel the plan picks at its length; the compressed
branch with cuDNN's attention where the config names it, and its flash kernels where that fails.
On a TPU the guard runs by itself under `auto` and checks what a TPU plan runs on Pallas: the
selection kernels and splash attention (kernels/plan.py).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

# The dispatch module, called through its attributes: what a test monkeypatches is what runs.
from nsa_jax.kernels import (
    CUDNN_CMP,
    BranchCalls,
    cudnn_fits,
    plan_kernels,
    resolve_impl,
    selection_kernel_fits,
)
from nsa_jax.kernels.plan import SPLASH, TPU_BACKENDS, SequenceSplit
from nsa_jax.kernels.xla import num_compressed, select_blocks

# The slice the two paths are compared on: sequence length (clipped to the run's) and rows.
SLICE_SEQ = 256
SLICE_BATCH = 1
# Largest max |pallas - xla| relative to max |xla| per output, by input dtype.
TOLERANCE = {"float32": 2e-3, "bfloat16": 5e-2, "float16": 2e-2}
# Smallest share of selected block indices (cmp branch) on which the two paths agree;
# below 1 because near-ties in the block scores may round either way.
MIN_INDEX_AGREEMENT = 0.98


@dataclasses.dataclass(frozen=True)
class _SliceSplit:
    """The sequence split of check_branch's slice under context parallelism: its queries start at 0 or
    at `chunk` of `seq_len` keys (kernels/plan.SequenceSplit)."""

    chunk: int
    seq_len: int
    context: int = 1


_KERNELS = {
    "cmp": "compressed_pallas/block_scores_pallas (nsa_cmp_*, nsa_block_select)",
    "cmp-cudnn": "cuDNN fused attention + block_scores_pallas (nsa_cmp_lse, nsa_block_select)",
    "win": "flash_pallas (nsa_window_*)",
    "cmp-splash": "splash attention (splash_tpu, the compressed mask)",
    "win-splash": "splash attention (splash_tpu, the local mask)",
    "blocksparse": "blocksparse_pallas (nsa_selection_bsp_*)",
    "gather": "selection_pallas (nsa_selection_*)",
}


class KernelMismatch(Exception):
    """The Pallas path's result differs from the XLA path's beyond the tolerance."""


def _branch_fn(plan, nsa, branch: str, num_blocks: int | None = None) -> tuple[str, Callable]:
    """(kernel name, fn(impl, *inputs, q_offset) -> (differentiable output, index output or None)) of `plan`'s
    kernel.

    `impl` is "pallas" (the plan's kernel for the branch) or "xla" (the reference). `q_offset`: where
    the queries start among the keys (context parallelism; 0 otherwise); `num_blocks`: the selection
    blocks of the keys (the compressed branch, under an offset).
    """
    calls = BranchCalls(nsa, plan)
    reference = lambda impl: None if impl == "pallas" else impl  # noqa: E731 - "xla": the reference
    if branch == "cmp":
        name = _KERNELS[{"cudnn": "cmp-cudnn", SPLASH: "cmp-splash"}.get(plan.cmp, "cmp")]
        if nsa.scorer == "minmax":  # the attention alone, and the blocks from the selection keys k
            # (mix scores on XLA: its compressed scores come with the attention, checked as cmp's are)

            def cmp_minmax(impl, q, kc, vc, k, q_offset):
                o, _ = calls.compressed(q, kc, vc, q_offset=q_offset, num_blocks=num_blocks, impl=reference(impl))
                return o, calls.blocks(q, k, q_offset=q_offset, num_blocks=num_blocks, impl=reference(impl))

            fused = plan.cmp != SPLASH  # a TPU scores minmax on XLA (kernels/plan.py)
            return f"{name} + {'minmax_pallas (nsa_minmax_select)' if fused else 'minmax on xla'}", cmp_minmax
        if nsa.scorer == "rescore":  # cmp's candidates, and the second stage over the selection keys k

            def cmp_rescore(impl, q, kc, vc, k, q_offset):
                o, cand = calls.compressed(q, kc, vc, q_offset=q_offset, num_blocks=num_blocks, impl=reference(impl))
                return o, calls.blocks(
                    q, k, q_offset=q_offset, num_blocks=num_blocks, impl=reference(impl), cmp_scores=cand
                )

            return f"{name} + rescore_pallas (nsa_rescore_select)", cmp_rescore

        def cmp(impl, q, kc, vc, q_offset):
            return calls.compressed(q, kc, vc, q_offset=q_offset, num_blocks=num_blocks, impl=reference(impl))

        return name, cmp
    if branch == "win":

        def win(impl, q, k, v, q_offset):
            return calls.window(q, k, v, q_offset=q_offset, impl=reference(impl)), None

        return _KERNELS["win-splash" if plan.win == SPLASH else "win"], win

    def slc(impl, q, k, v, idx, q_offset):
        return calls.selection(q, k, v, idx, q_offset=q_offset, impl=reference(impl)), None

    return _KERNELS[plan.slc], slc


def _shapes(cfg, branch: str, batch: int, seq: int, rows: int) -> list[tuple[tuple[int, ...], jnp.dtype]]:
    """Shapes and dtypes of the branch's inputs (q first) as the layer calls it: `rows` queries over the
    keys of `seq` tokens (rows < seq: a context-parallel chunk)."""
    a, dt = cfg.nsa, jnp.dtype(cfg.dtype)
    H, K, Dk, Dv = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.v_head_dim
    q = ((batch, rows, H, Dk), dt)
    if branch == "cmp":
        tc = num_compressed(seq, a.l, a.d)
        minmax = [((batch, seq, K, Dk), dt)] if a.scorer in ("minmax", "rescore") else []  # its selection keys
        return [q, ((batch, tc, K, Dk), dt), ((batch, tc, K, Dv), dt), *minmax]
    kv = [((batch, seq, K, Dk), dt), ((batch, seq, K, Dv), dt)]
    return [q, *kv, ((batch, rows, K, a.n), jnp.int32)] if branch == "slc" else [q, *kv]


def _loss_and_grads(fn, impl: str, n_diff: int):
    """(*x, q_offset) -> ((out, idx), grads of sum(out * ct) wrt the first n_diff inputs); ct fixed per shape."""

    def loss(*xs):
        o, idx = fn(impl, *xs)
        ct = jnp.cos(jnp.arange(o.size, dtype=jnp.float32).reshape(o.shape))  # a fixed, non-uniform cotangent
        return jnp.sum(o.astype(jnp.float32) * ct), (o, idx)

    def run(*xs):
        (_, (o, idx)), grads = jax.value_and_grad(loss, argnums=tuple(range(n_diff)), has_aux=True)(*xs)
        return o, idx, grads

    return run


def _slice_inputs(cfg, branch: str, seq: int, rows: int, rng: np.random.Generator):
    """Random inputs of `rows` queries at the end of `seq` keys (all of them when rows = seq)."""
    xs = []
    for shape, dt in _shapes(cfg, branch, SLICE_BATCH, seq, rows):
        if dt == jnp.int32:  # selected blocks: select_blocks' rules over random scores
            a = cfg.nsa
            nb = -(-seq // a.lp)
            scores = jnp.asarray(rng.random((shape[0], rows, shape[2], nb)), jnp.float32)
            xs.append(select_blocks(scores, a.lp, a.n, seq - rows + jnp.arange(rows, dtype=jnp.int32)))
        else:
            xs.append(jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dt))
    return xs


def _compare(name: str, got, want, tol: float) -> None:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if not np.all(np.isfinite(got)):
        raise KernelMismatch(f"{name} has non-finite values")
    err, scale = float(np.max(np.abs(got - want), initial=0.0)), float(np.max(np.abs(want), initial=0.0))
    if err > tol * max(scale, 1e-6):
        raise KernelMismatch(f"{name} differs from XLA by {err:.3g} (max |XLA| {scale:.3g}, tolerance {tol:g})")


def check_branch(cfg, branch: str, batch: int, seq: int, plan, *, seed: int = 0, rows: int | None = None) -> str:
    """Compiles `branch`'s Pallas kernel of `plan` at [batch, seq] and compares it with XLA on a slice.

    `rows` (context parallelism): the queries of one call, a chunk at a traced offset into the
    `seq` keys, compiled so and compared on the second half of a slice's rows. Returns the
    kernel's name; raises what the compile raised, or KernelMismatch.
    """
    offset = rows is not None and rows < seq
    num_blocks = -(-seq // cfg.nsa.lp) if offset else None
    kernel, fn = _branch_fn(plan, cfg.nsa, branch, num_blocks)
    shapes = _shapes(cfg, branch, batch, seq, rows if offset else seq)
    n_diff = 3
    run = _loss_and_grads(fn, "pallas", n_diff)
    q_offset = jax.ShapeDtypeStruct((), jnp.int32) if offset else 0
    jax.jit(run, static_argnums=() if offset else (len(shapes),)).lower(
        *(jax.ShapeDtypeStruct(s, d) for s, d in shapes), q_offset
    ).compile()

    short = min(seq, SLICE_SEQ)
    part = short // 2 if offset else short
    xs = _slice_inputs(cfg, branch, short, part, np.random.default_rng(seed))
    q_offset = jnp.int32(short - part) if offset else 0
    if offset and plan.layout is not None:  # kernels of static offsets (splash) know the slice's: 0, short - part
        plan = dataclasses.replace(plan, layout=_SliceSplit(short - part, short))
        fn = _branch_fn(plan, cfg.nsa, branch, num_blocks)[1]
        run = _loss_and_grads(fn, "pallas", n_diff)
    static = () if offset else (len(xs),)
    o_p, idx_p, g_p = jax.jit(run, static_argnums=static)(*xs, q_offset)
    o_x, idx_x, g_x = jax.jit(_loss_and_grads(fn, "xla", n_diff), static_argnums=static)(*xs, q_offset)
    tol = TOLERANCE.get(jnp.dtype(cfg.dtype).name, 5e-2)
    _compare("output", o_p, o_x, tol)
    for name, gp, gx in zip(("dq", "dk", "dv"), g_p, g_x):
        _compare(name, gp, gx, tol)
    if idx_p is not None:
        agree = float(np.mean(np.asarray(idx_p) == np.asarray(idx_x)))
        if agree < MIN_INDEX_AGREEMENT:
            raise KernelMismatch(f"selected blocks agree with XLA on {agree:.1%} (needs {MIN_INDEX_AGREEMENT:.0%})")
    return kernel


def guard_kernels(
    cfg,
    batch: int,
    seq: int,
    *,
    force: bool = False,
    warn: Callable[[str], None] = print,
    layout: SequenceSplit | None = None,
) -> dict:
    """Checks the Pallas kernels of the branches `auto` runs on Pallas at length `seq`.

    `cfg`: the ModelConfig; `batch`: rows per device; `seq`: the training length; `layout`:
    the sequence layout under context parallelism (nsa/context.SeqLayout), whose kernels run a
    chunk of queries at a traced offset into the whole (padded) sequence's keys, and are checked so.
    Returns {branch: error line} of the branches whose kernel failed ({} when nothing
    was checked or everything passed), and `cmp-cudnn` when cuDNN's attention failed in
    the compressed branch (the flash kernels are then checked in its place): the run's
    kernel plan takes the keys as its `fallback`. Does nothing unless attention_impl is
    `auto` and the backend is a GPU or a TPU (its selection kernel), or `force`.
    """
    a = cfg.nsa
    backend = jax.default_backend()
    tpu = backend in TPU_BACKENDS
    if a.attention_impl != "auto" or not (force or tpu or resolve_impl("auto", backend) == "pallas"):
        return {}
    rows = None
    if layout is not None:  # one device's chunk of queries over the whole padded sequence
        rows, seq = layout.chunk, layout.seq_len
    # What `auto` runs on this backend's GPU path (forced on a CPU: the interpreted kernels).
    plan = plan_kernels(
        dataclasses.replace(a, attention_impl="pallas"), seq, backend, layout=layout, cudnn_ok=cudnn_fits(cfg)
    )
    failed = {}

    def broken(branch: str, plan) -> str | None:
        """Why `branch`'s kernel of `plan` cannot run (None: it passed)."""
        kernel = _branch_fn(plan, a, branch)[0]
        try:
            check_branch(cfg, branch, batch, seq, plan, rows=rows)
        except KernelMismatch as e:
            return f"{kernel} disagrees with XLA: {e}"
        except Exception as e:  # a compile error of any kind: the branch must not take the run down
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            return f"{kernel} failed to compile: {type(e).__name__}: {first}"
        return None

    for branch in a.branches:
        if (branch == "slc" and not selection_kernel_fits(a.lp)) or getattr(plan, branch) == "xla":
            continue  # auto already runs it on XLA (a TPU: every branch but selection)
        why = broken(branch, plan)
        if why and branch == "cmp" and plan.cmp == "cudnn":
            # cuDNN's attention (a card or cuDNN without it): the branch's own flash kernels, if they pass.
            warn(f"warning: kernel guard: {why}; the cmp branch runs its flash kernels")
            failed[CUDNN_CMP] = why
            why = broken(branch, dataclasses.replace(plan, cmp="pallas"))
        if why:
            failed[branch] = why
            warn(f"warning: kernel guard: {why}; the {branch} branch runs on XLA")
    return failed
