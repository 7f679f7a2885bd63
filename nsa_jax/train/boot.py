"""A training run before its first step: its parts built from the config, and the compile of its step.

`boot(cfg, out, ...)` builds, in this order, everything that can fail on bad input, so
a launcher can report it as one line: the mesh; on a resume from a checkpoint saved on
another device count, the same rows per step split anew into micro-batches
(resume.elastic_batch); the ShardingPlan; the kernel guard (`auto` on a GPU: a branch
whose Pallas kernel fails to compile or disagrees with XLA runs on XLA, agreed by every
process); the train step; the data stream; the Checkpointer and the newest checkpoint
that reads back; the run artifacts; the boot lines; the first batch under
data.loader_timeout (synthetic data instead when data.synthetic_on_fail allows). It
returns them as `RunParts`.

`compile_step` compiles the step ahead of time in one thread while another builds a
fresh state; the caller only waits, so a stop signal ends the wait at once.
`enable_compile_cache` points jax's persistent compilation cache at a directory first.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import threading
import time
from typing import Any, Callable

import jax
from jax.sharding import Mesh

from nsa_jax.agreement import agree_any
from nsa_jax.config import Config
from nsa_jax.data import BatchStream, first_batch_with_timeout, make_dataset, unused_data_settings
from nsa_jax.data.targets import batch_tokens
from nsa_jax.info import learning_options
from nsa_jax.kernels.guard import guard_kernels
from nsa_jax.kernels.plan import FALLBACKS, substitutions
from nsa_jax.mesh import DATA, make_mesh, process_rows
from nsa_jax.rundir import checkpoint as ckpt
from nsa_jax.rundir import resume
from nsa_jax.step import schedule
from nsa_jax.step.optimizer import learning_rate
from nsa_jax.step.state import TrainState
from nsa_jax.step.step import make_train_step
from nsa_jax.step.strategies import ShardingPlan, make_plan, whole_leaves
from nsa_jax.train.artifacts import RunArtifacts
from nsa_jax.train.progress import gpu_config_warning
from nsa_jax.words import count

Say = Callable[[str], None]


def enable_compile_cache(path: str | None) -> None:
    """jax's persistent compilation cache in `path` (None: off). A repeated or resumed run then
    loads the compiled step instead of compiling it; entries are keyed by program and flags."""
    if path is None:
        return
    jax.config.update("jax_compilation_cache_dir", str(path))
    # The train step and the evaluation take seconds to compile; small programs are not worth a file.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


@dataclasses.dataclass
class RunParts:
    """What `boot` builds for one run."""

    cfg: Config  # as the run uses it: the batch split anew on a resize, synthetic data after a loader timeout
    mesh: Mesh
    plan: ShardingPlan
    train_step: Callable
    tokens_per_step: int
    data: BatchStream
    ckpt: ckpt.Checkpointer
    art: RunArtifacts
    state: TrainState | None  # given or restored; None: a fresh one is built while the step compiles
    first: Any  # the first batch: tokens or data/targets.LabeledRows


def boot(
    cfg: Config,
    out: pathlib.Path,
    applied_env: dict[str, str] | None,
    resume_from: tuple[TrainState | None, dict | None],
    devices: list | None,
    eval_off: str | None,
    say: Say,
    doing: Callable[[str | None], None],
) -> RunParts:
    """The parts of a run of `cfg` into `out` (module docstring).

    `resume_from`: (train state, data position) given by the caller, or (None, None): the
    newest checkpoint in `out`, if any. `eval_off`: why the run evaluates nothing (None:
    it does); `say` prints a line, `doing` names what runs (the progress thread).
    """
    state, data_state = resume_from
    mesh = make_mesh(cfg, devices)
    # A checkpoint saved on another device count: the same rows per step, split anew into micro-batches.
    elastic = None
    if state is None and data_state is None:
        cfg, elastic = resume.elastic_batch(cfg, mesh.shape[DATA])
    # Strategy, shardings and the batch split, derived and checked once for the run.
    plan = make_plan(cfg, mesh)
    tokens_per_step = cfg.train.global_batch * cfg.train.accumulate * cfg.train.seq_len
    doing("boot: kernel guard (each branch's kernel compiled once)")
    fallback = _guard_kernels(plan, say)
    if fallback:  # the kernel plan of every phase runs the failed branches on XLA (cmp-cudnn: on its flash kernels)
        plan = dataclasses.replace(plan, kernel_fallback=frozenset(fallback))
    train_step = make_train_step(plan)
    # Opening the stream validates the data settings before any artifact is written.
    doing("boot: opening the data stream")
    data = make_dataset(cfg, "train", *process_rows(mesh))
    # Checkpoints in out_dir are resumed from, never trained over (nsa_jax/rundir/checkpoint.py).
    checkpointer = ckpt.Checkpointer(plan, out, warn=say)
    doing("boot: restoring the newest checkpoint")
    restored = checkpointer.restore_latest() if state is None and data_state is None else None
    doing(None)
    if restored is not None:
        state, data_state = restored.state, restored.train_data
    if data_state is not None:
        data.set_state(data_state)
    # The CSVs keep their rows up to the checkpoint; later steps are re-run and appended.
    kernel_plans = [(p.start, plan.kernels(p.model)) for p in schedule.phases(cfg)]
    art = RunArtifacts(cfg, out, mesh, applied_env, restored.step if restored else None, kernel_plans)
    if restored is not None:
        _say_resume(cfg, restored, art, say)
    say(
        f"boot: {count(jax.process_count(), 'process', 'processes')}, "
        f"{count(plan.n_devices, jax.default_backend() + ' device')} on the data axis{_context_words(plan)}, "
        f"per-device batch {cfg.train.global_batch // plan.n_devices} x accumulate {cfg.train.accumulate}, "
        f"{tokens_per_step:,} tokens/step, {_reduction_words(cfg, plan)} -> {out}"
        + (f" (resized on resume: {elastic})" if elastic else "")
    )
    _say_settings(cfg, int(state.step if state is not None else 0), eval_off, art, say)
    # What the config asks of the kernels that this backend runs otherwise (env.json has the whole plan).
    asked = substitutions(cfg.model.nsa, [k for _, k in kernel_plans], jax.default_backend(), plan.kernel_fallback)
    if asked:
        say("note: kernels: " + "; ".join(asked))
    if undivided := whole_leaves(plan):
        say(f"note: {undivided}")
    strategy, backend = cfg.parallel.strategy, jax.default_backend()
    if warning := host_collective_warning(strategy, backend, plan.n_devices, jax.__version__):
        say(f"warning: {warning}")
    p = cfg.parallel
    art.event(
        "boot", 0, "boot", devices=plan.n_devices, processes=jax.process_count(), tokens_per_step=tokens_per_step,
        strategy=p.strategy, grad_reduce_dtype=p.grad_reduce_dtype, bucket_mb=p.bucket_mb,
    )  # fmt: skip
    doing("boot: reading the first batch")
    cfg, data, first = _first_batch(cfg, data, art, say, process_rows(mesh))
    return RunParts(cfg, mesh, plan, train_step, tokens_per_step, data, checkpointer, art, state, first)


def _reduction_words(cfg, plan: ShardingPlan) -> str:
    """The boot line's words on the gradient reduction (the torch runbook's `[ddp] gradient compression
    enabled: bf16`): the strategy, the dtype on the wire and XLA's combine threshold."""
    p = cfg.parallel
    if plan.n_devices * (plan.layout.context if plan.layout is not None else 1) == 1:
        return f"strategy {p.strategy} (one device: no gradient reduction)"
    return f"strategy {p.strategy}, gradients reduced in {p.grad_reduce_dtype} (combine threshold {p.bucket_mb:g} MB)"


def _context_words(plan: ShardingPlan) -> str:
    """The boot line's words on context parallelism ('' without): the seq axis and the padding."""
    layout = plan.layout
    if layout is None:
        return ""
    T, Tp = layout.real_len, layout.seq_len
    pad = f", padded to {Tp:,} ({(Tp - T) / Tp:.0%} padding)" if Tp > T else ""
    return (
        f" x {layout.context} on the seq axis (context parallelism: each sequence of {T:,} tokens{pad} in "
        f"{2 * layout.context} chunks of {layout.chunk:,}, two per device)"
    )


def _guard_kernels(plan: ShardingPlan, say: Say) -> set[str]:
    """`auto` on a GPU: the branches whose Pallas kernel fails to compile or disagrees with XLA (and
    `cmp-cudnn` where cuDNN's attention does in the compressed branch; kernels/plan.py FALLBACKS).

    Before the step is traced, so the fallback is in its program; every process takes the
    union of the failures, so all of them compile the same program.
    """
    cfg = plan.cfg
    rows = cfg.train.global_batch // plan.n_devices
    failed = set(guard_kernels(cfg.model, rows, cfg.train.seq_len, warn=say, layout=plan.layout))
    if jax.process_count() > 1 and cfg.model.nsa.attention_impl == "auto":
        failed = {b for b in FALLBACKS if agree_any(b in failed)}
    return failed


def _say_resume(cfg: Config, restored: ckpt.Restored, art: RunArtifacts, say: Say) -> None:
    how = "" if restored.train_data is not None else " (data stream restarted: checkpoint.restore_data=false)"
    say(f"resume: step {restored.step} from {restored.path}{how}")
    art.event("resume", restored.step, str(restored.path))
    lr_note = _lr_change(cfg, restored)
    if lr_note:
        say(lr_note)


def _lr_change(cfg: Config, restored: ckpt.Restored) -> str | None:
    """The line on the LR schedule when train.steps (or another LR setting) changed since the checkpoint."""
    try:
        saved = resume.saved_config(restored.path)["train"]
    except (OSError, ValueError, KeyError, TypeError):
        return None

    def lr_at(step: int, train) -> float:
        return float(learning_rate(step, train))

    return schedule.lr_change_on_resume(saved, cfg.train, restored.step, lr_at)


def _say_settings(cfg: Config, step: int, eval_off: str | None, art: RunArtifacts, say: Say) -> None:
    """The boot warnings and notes: a GPU config on a CPU, no evaluation, learning options, dense selection."""
    gpu_warning = gpu_config_warning(cfg, jax.default_backend())
    if gpu_warning:
        say(gpu_warning)
    if eval_off:
        say(f"warning: {eval_off}")
        art.event("eval_off", 0, eval_off)
    if learning_options(cfg):
        say(f"nsa learning options: {learning_options(cfg)}")
    unused = unused_data_settings(cfg.data)
    if unused:
        say(f"note: {unused}")
    t = cfg.train
    if t.init_from and t.warmup > t.steps and step < t.steps:
        # A continuation from a model folder keeps the folder's 2,000-step warm-up unless told otherwise:
        # a short one would train at a tiny fraction of train.lr without a word.
        top = t.lr * t.steps / t.warmup
        say(
            f"note: train.warmup {t.warmup:,} is longer than train.steps {t.steps:,}: the run ends inside its "
            f"warm-up, the learning rate rising to {top:.3g} at most (train.lr {t.lr:g}); "
            f"set train.warmup below {t.steps:,} to reach it"
        )
    dense_until = schedule.dense_selection_steps(cfg)
    if step < dense_until:
        n = cfg.model.nsa.n
        say(f"selection: every block for steps 1-{dense_until}, then top-{n} (evaluation: top-{n})")


def _first_batch(
    cfg: Config, data: BatchStream, art: RunArtifacts, say: Say, rows: tuple[int, int]
) -> tuple[Config, BatchStream, Any]:
    """(cfg, data stream, the first batch) under data.loader_timeout; synthetic data instead when allowed
    (`rows`: this process's row group, mesh.process_rows)."""
    art.event("loader_start", 0, f"dataset {cfg.data.dataset}")
    try:
        first = first_batch_with_timeout(data, cfg.data.loader_timeout)
    except TimeoutError as e:
        art.event("loader_timeout", 0, str(e))
        if not cfg.data.synthetic_on_fail:
            raise
        say(f"warning: {e}; continuing on synthetic data (data.synthetic_on_fail)")
        data.close()
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, dataset="synthetic"))
        data = make_dataset(cfg, "train", *rows)
        first = next(data)
    art.event("loader_ready", 0, f"first batch {tuple(batch_tokens(first).shape)}")
    return cfg, data, first


def compile_step(
    train_step, abstract: Any, batch: Any, init: Callable[[], TrainState] | None, stopped: Callable[[], bool]
) -> tuple[Any, float, TrainState | None] | None:
    """(compiled step, compile seconds, the state `init` built, or None without `init`); None once `stopped()`.

    The step is lowered against `abstract` (the state's shapes), so XLA compiles it in
    one worker thread while another builds (compiles and runs) the init. The init starts
    once the step is lowered: two threads tracing flax modules at once can race in
    flax's class machinery (seen: "dictionary changed size during iteration" inside
    dataclasses.fields), while XLA's compile, the long part, runs beside the init safely.
    The caller only waits, so a stop signal (SIGINT, SIGTERM) ends the wait at once: None
    then, and the threads (daemons, named nsa-compile and nsa-init-state) are left behind.
    """
    box: dict[str, Any] = {}
    compiled_done, state_done, lowered_done = threading.Event(), threading.Event(), threading.Event()

    def timed_compile():
        try:
            try:
                lowered = train_step.lower(abstract, batch)
            finally:
                lowered_done.set()
            t0 = time.perf_counter()
            box["compiled"] = lowered.compile()
            box["seconds"] = time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001 - raised in the main thread
            box["error"] = e
        compiled_done.set()

    def init_state():
        try:
            while not lowered_done.wait(0.25):  # no trace beside the step's (above)
                if stopped():
                    return
            box["state"] = init()
        except BaseException as e:  # noqa: BLE001 - raised in the main thread
            box.setdefault("error", e)
        state_done.set()

    threading.Thread(target=timed_compile, name="nsa-compile", daemon=True).start()
    if init is not None:
        threading.Thread(target=init_state, name="nsa-init-state", daemon=True).start()
    else:
        state_done.set()
    for done in (state_done, compiled_done):
        while not done.wait(0.25):
            if stopped():
                return None
    if stopped():
        return None
    if "error" in box:
        raise box["error"]
    return box["compiled"], box["seconds"], box.get("state")


def host_collective_warning(strategy: str, backend: str, n_devices: int, jax_version: str) -> str | None:
    """A warning for a zero1 / fsdp run over several CPU host devices under jax older than 0.12, whose CPU
    backend returned wrong gradients, different from call to call, for some of their steps (SmolLM2-135M
    fine-tuned on 2 host devices: one [30, 1536, 576] kernel's gradient 20% off, jax 0.10.2; exact with
    jax 0.12.0.1 and under dp; docs/STUDY.md). None otherwise."""
    version = tuple(int(x) for x in re.findall(r"\d+", jax_version)[:2])
    if backend != "cpu" or n_devices < 2 or strategy not in ("zero1", "fsdp") or version >= (0, 12):
        return None
    return (
        f"jax {jax_version}'s CPU backend has returned wrong gradients, different from call to call, for "
        f"parallel.strategy={strategy} steps over host devices (docs/STUDY.md); on a CPU use dp, or jax >= 0.12 "
        "(Python 3.12)"
    )
