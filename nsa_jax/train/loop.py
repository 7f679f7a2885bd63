"""The training loop: boot -> data -> state -> compile -> steps. The only place with I/O.

`Trainer(cfg, ...)` does everything that can fail on bad input (mesh, batch split,
dataset, first batch) so a launcher can report it as one line; `Trainer.run()`
compiles the step ahead of time (printing compile time and the compiled program's
memory) and trains.

The loop never waits on the device without need: it dispatches step t, and only
then reads step t-1's metrics (which blocks until t-1 is done while t is already
queued). The host therefore prepares batch t+1 and writes t-1's logs while the
device runs t. Step time is the interval between consecutive completions, and it is
the step's own: at a step that evaluates or saves, the loop first waits for that step
(its time ends there), then evaluates (timed as `eval_s`) or starts the save (timed as
`save_s` in the `checkpoint_start` event), and the next step's time starts after that.

Checkpoint saves run in the background; `Checkpointer.poll` says at the next step
(the next save or the end at the latest, with several processes) whether a save
committed (then the `checkpoint` event is written) or failed (then a
`checkpoint_failed` event, the run stops with summary["halted"] = "checkpoint_failed"
and the error in summary["error"]; launch.train exits 74).

Steps of LONG_STEP_S or more run one at a time: step t+1 is dispatched once t is
recorded (the host's share is milliseconds against seconds), so a stop waits for the
step in flight only, not for a second one queued behind it.

Stops: SIGINT (Ctrl-C) and SIGTERM, from before the compile on, are a flag
(checkpoint.PreemptionGuard): the loop stops after the step in flight, saves a
checkpoint, and returns with summary["halted"] "sigint" / "sigterm" (launch.train
exits 130 / 0). A helper thread sees the signals while the main thread waits on the
device: it announces the stop within a second and ends the process at a second
signal. During the compile (threads of their own) the run returns at once.

Progress: a step line (loss, lr, tokens/s, ETA) at the first step, every
train.log_every steps, and whenever QUIET_S passed without one; while a compile, a
step, an evaluation or the last save runs longer than QUIET_S without a line, the
progress thread says what runs and for how long. On a CPU, a config with GPU settings
(`gpu_settings`) is warned about at boot, and after the first step a run projected
past CPU_PROJECTION_WARN_S (or any GPU config) gets one line with the projected time.

Before the first step the compiled program's memory is compared with what the device
has (nsa_jax/ops/memory.py `check_fits`): a step that cannot fit stops with
WontFitError instead of dying in the allocator.

Checkpoint seam: `Trainer(..., state=TrainState, data_state=dict)` resumes from a
restored train state and data position; `trainer.state` / `trainer.data.get_state()`
are what a checkpoint saves.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import sys
import threading
import time
from typing import Any, Callable

import jax
import numpy as np

from nsa_jax import checkpoint as ckpt
from nsa_jax import resume
from nsa_jax.config import Config
from nsa_jax.data import first_batch_with_timeout, make_dataset
from nsa_jax.evaluation.heldout import format_eval
from nsa_jax.evaluation.training import RunEvaluation
from nsa_jax.info import learning_options
from nsa_jax.kernels.guard import guard_kernels
from nsa_jax.ops.health import Health, agree_any, write_halt
from nsa_jax.ops.memory import check_fits, compiled_memory, describe
from nsa_jax.runfiles import BRANCHES, CMP_SCALE_WARN, HALT_FILE, SCALE_COLUMNS
from nsa_jax.train import optimizer as O
from nsa_jax.train import schedule
from nsa_jax.train import step as S
from nsa_jax.train.artifacts import RunArtifacts
from nsa_jax.train.state import TrainState
from nsa_jax.train.strategies import make_plan

# Steps at least this long run one at a time: the next step is dispatched once the one in
# flight is recorded, so a stop (SIGINT, SIGTERM, .HALT) waits for one step, not two. The
# host's share of such a step (a batch, a log row) is milliseconds.
LONG_STEP_S = 2.0
# While the run works, a line at least this often (a long compile, step or evaluation says
# what it is doing); also the longest interval between step lines.
QUIET_S = 25.0
# Warn with the projected time when a run on a CPU would take longer than this.
CPU_PROJECTION_WARN_S = 12 * 3600.0


def fmt_duration(seconds: float) -> str:
    """45 -> '45s', 83 -> '1m23s', 7500 -> '2h05m', 6048000 -> '70d00h'."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600:02d}h"


def gpu_settings(cfg: Config) -> list[str]:
    """The settings of `cfg` that are meant for a GPU (a CPU runs them, slowly)."""
    out = []
    if cfg.model.dtype == "bfloat16":
        out.append("model.dtype bfloat16")
    if cfg.model.nsa.attention_impl != "xla":
        out.append(f"model.nsa.attention_impl {cfg.model.nsa.attention_impl}")
    return out


def cpu_projection(cfg: Config, steps_left: int, step_s: float, backend: str) -> str | None:
    """A warning line with the projected time of the rest of the run when a CPU runs a GPU config,
    or any run whose projection exceeds CPU_PROJECTION_WARN_S; None otherwise."""
    if backend != "cpu" or steps_left <= 0:
        return None
    total = steps_left * step_s
    gpu = gpu_settings(cfg)
    if not gpu and total < CPU_PROJECTION_WARN_S:
        return None
    why = f"a config meant for a GPU ({', '.join(gpu)}) on a CPU" if gpu else "on a CPU"
    return (
        f"warning: {fmt_duration(step_s)} a step {why}: the {steps_left:,} steps left take about "
        f"{fmt_duration(total)}; on a CPU train a small config (--config cpu_tiny), or run this one on a GPU"
    )


def progress_line(step: int, steps: int, loss: float, lr: float, toks_per_s: float, eta_s: float) -> str:
    """`step 40/300 | loss 3.1234 | lr 1.00e-03 | 12,345 tok/s | ETA 1m23s`."""
    return f"step {step}/{steps} | loss {loss:.4f} | lr {lr:.2e} | {toks_per_s:,.0f} tok/s | ETA {fmt_duration(eta_s)}"


def enable_compile_cache(path: str | None) -> None:
    """jax's persistent compilation cache in `path` (None: off). A repeated or resumed run then
    loads the compiled step instead of compiling it; entries are keyed by program and flags."""
    if path is None:
        return
    jax.config.update("jax_compilation_cache_dir", str(path))
    # The train step and the evaluation take seconds to compile; small programs are not worth a file.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


@dataclasses.dataclass
class _Pending:
    """A dispatched step whose metrics have not been read yet."""

    step: int
    metrics: dict[str, jax.Array]
    dispatched: float
    evaluate: bool = False  # evaluate the state after this step once it is recorded


class Trainer:
    """One training run of `cfg` into `cfg.train.out_dir` (or `out_dir`)."""

    def __init__(
        self,
        cfg: Config,
        *,
        applied_env: dict[str, str] | None = None,
        state: TrainState | None = None,
        data_state: dict | None = None,
        devices: list | None = None,
        print_fn: Callable[[str], None] | None = None,
        eval_off: str | None = None,
    ):
        """`eval_off`: why this run evaluates nothing (no validation data: launch.train checks the
        data before the out dir is touched, nsa_jax/data/check.py); None evaluates every
        train.eval_every steps."""
        self.cfg = cfg
        self.out = pathlib.Path(cfg.train.out_dir)
        self.lead = jax.process_index() == 0
        self._print = print_fn or _print_flushed
        self._last_said = time.perf_counter()  # when a line was last printed (QUIET_S)
        self._activity: tuple[str, float] | None = None  # what the progress thread reports while quiet
        self.eval_off = eval_off
        # The progress thread, from boot on (a kernel guard, a restore or a first batch can take long).
        self._quiet_stop = threading.Event()
        threading.Thread(target=self._report_quiet, args=(self._quiet_stop,), name="nsa-progress", daemon=True).start()
        try:
            self._boot(cfg, applied_env, state, data_state, devices)
        except BaseException:
            self._quiet_stop.set()
            raise
        finally:
            self._doing(None)

    def _boot(self, cfg: Config, applied_env, state, data_state, devices) -> None:
        self.mesh = S.make_mesh(cfg, devices)
        # A checkpoint saved on another device count: the same rows per step, split anew into micro-batches.
        elastic = None
        if state is None and data_state is None:
            cfg, elastic = resume.elastic_batch(cfg, self.mesh.size)
            self.cfg = cfg
        # Strategy, shardings and the batch split, derived and checked once for the run.
        self.plan = make_plan(cfg, self.mesh)
        n_dev = self.plan.n_devices
        self.tokens_per_step = cfg.train.global_batch * cfg.train.accumulate * cfg.train.seq_len
        self._doing("boot: kernel guard (each branch's kernel compiled once)")
        fallback = self._guard_kernels(cfg.train.global_batch // n_dev)
        if fallback:  # the kernel plan of every phase runs the failed branches on XLA
            self.plan = dataclasses.replace(self.plan, kernel_fallback=frozenset(fallback))
        self.train_step = S.make_train_step(self.plan)
        # Opening the stream validates the data settings before any artifact is written.
        self._doing("boot: opening the data stream")
        self.data = make_dataset(cfg, "train", process_index=jax.process_index(), process_count=jax.process_count())
        # Checkpoints in out_dir are resumed from, never trained over (nsa_jax/checkpoint.py).
        self.ckpt = ckpt.Checkpointer(self.plan, self.out, warn=self.say)
        self._doing("boot: restoring the newest checkpoint")
        restored = self.ckpt.restore_latest() if state is None and data_state is None else None
        self._doing(None)
        if restored is not None:
            state, data_state = restored.state, restored.train_data
        if data_state is not None:
            self.data.set_state(data_state)
        # The CSVs keep their rows up to the checkpoint; later steps are re-run and appended.
        kernel_plans = [(p.start, self.plan.kernels(p.model)) for p in schedule.phases(cfg)]
        self.art = RunArtifacts(
            cfg, self.out, self.mesh, applied_env, restored.step if restored else None, kernel_plans
        )
        if restored is not None:
            how = "" if restored.train_data is not None else " (data stream restarted: checkpoint.restore_data=false)"
            self.say(f"resume: step {restored.step} from {restored.path}{how}")
            self.art.event("resume", restored.step, str(restored.path))
            lr_note = self._lr_change(restored)
            if lr_note:
                self.say(lr_note)
        self.say(
            f"boot: {jax.process_count()} process(es), {n_dev} {jax.default_backend()} device(s) on the data axis, "
            f"per-device batch {cfg.train.global_batch // n_dev} x accumulate {cfg.train.accumulate}, "
            f"{self.tokens_per_step:,} tokens/step -> {self.out}"
            + (f" (resized on resume: {elastic})" if elastic else "")
        )
        if jax.default_backend() == "cpu" and gpu_settings(cfg):
            self.say(
                f"warning: this config is meant for a GPU ({', '.join(gpu_settings(cfg))}) and runs on a CPU here: "
                "expect minutes per step; the projected time follows the first step"
            )
        if self.eval_off:
            self.say(f"warning: {self.eval_off}")
            self.art.event("eval_off", 0, self.eval_off)
        if learning_options(cfg):
            self.say(f"nsa learning options: {learning_options(cfg)}")
        self._dense_until = schedule.dense_selection_steps(cfg)
        self._scale_warned = False
        if int(state.step if state is not None else 0) < self._dense_until:
            n = cfg.model.nsa.n
            self.say(f"selection: every block for steps 1-{self._dense_until}, then top-{n} (evaluation: top-{n})")
        self.art.event(
            "boot", 0, "boot", devices=n_dev, processes=jax.process_count(), tokens_per_step=self.tokens_per_step
        )
        self._doing("boot: reading the first batch")
        self._first = self._first_batch()
        # Held-out metrics and eval.suites; what they read and compile is built at the first evaluation.
        self.evaluation = RunEvaluation(self.cfg, self.mesh)
        self.state = state

    def _lr_change(self, restored) -> str | None:
        """The line on the LR schedule when train.steps (or another LR setting) changed since the checkpoint."""
        try:
            saved = resume.saved_config(restored.path)["train"]
        except (OSError, ValueError, KeyError, TypeError):
            return None

        def lr_at(step: int, train) -> float:
            return float(O.learning_rate(step, train))

        return schedule.lr_change_on_resume(saved, self.cfg.train, restored.step, lr_at)

    def _guard_kernels(self, batch_per_device: int) -> set[str]:
        """`auto` on a GPU: the branches whose Pallas kernel fails to compile or disagrees with XLA.

        Before the step is traced, so the fallback is in its program; every process takes the
        union of the failures, so all of them compile the same program.
        """
        failed = set(guard_kernels(self.cfg.model, batch_per_device, self.cfg.train.seq_len, warn=self.say))
        if jax.process_count() > 1 and self.cfg.model.nsa.attention_impl == "auto":
            failed = {b for b in ("cmp", "slc", "win") if agree_any(b in failed)}
        return failed

    # -- output ---------------------------------------------------------------

    def say(self, msg: str) -> None:
        if self.lead:
            self._print(msg)
            self._last_said = time.perf_counter()

    def _doing(self, what: str | None) -> None:
        """What the run is doing from now on (the progress thread reports it after QUIET_S of silence)."""
        self._activity = None if what is None else (what, time.perf_counter())

    def _report_quiet(self, stop: threading.Event) -> None:
        """The progress thread: a line whenever nothing was printed for QUIET_S while the run works."""
        while not stop.wait(1.0):
            activity = self._activity
            if activity is None or time.perf_counter() - self._last_said < QUIET_S:
                continue
            what, t0 = activity
            self.say(f"{what}: {fmt_duration(time.perf_counter() - t0)} so far" + self._last_step_note())

    def _last_step_note(self) -> str:
        last = getattr(self, "_last_step_s", None)
        return f" (the last step took {fmt_duration(last)})" if last else ""

    # -- data -----------------------------------------------------------------

    def _first_batch(self) -> np.ndarray:
        """The first batch under data.loader_timeout; synthetic data instead when allowed."""
        cfg = self.cfg
        self.art.event("loader_start", 0, f"dataset {cfg.data.dataset}")
        try:
            first = first_batch_with_timeout(self.data, cfg.data.loader_timeout)
        except TimeoutError as e:
            self.art.event("loader_timeout", 0, str(e))
            if not cfg.data.synthetic_on_fail:
                raise
            self.say(f"warning: {e}; continuing on synthetic data (data.synthetic_on_fail)")
            self.data.close()
            self.cfg = cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, dataset="synthetic"))
            self.data = make_dataset(cfg, "train", process_index=jax.process_index(), process_count=jax.process_count())
            first = next(self.data)
        self.art.event("loader_ready", 0, f"first batch {tuple(first.shape)}")
        return first

    def _next_tokens(self) -> np.ndarray:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return next(self.data)

    def _next_batch(self) -> jax.Array:
        """A micro-batches of this process's rows, placed as the global [A, B, T + 1] array."""
        rows = [self._next_tokens() for _ in range(self.cfg.train.accumulate)]
        return S.put_batch(np.stack(rows), self.mesh)

    # -- halting --------------------------------------------------------------

    def _halt_requested(self, step: int) -> bool:
        """<out>/.HALT present; in multi-process runs agreed at log intervals so all stop together."""
        if jax.process_count() == 1:
            return (self.out / HALT_FILE).exists()
        if step % self.cfg.train.log_every:
            return False
        return agree_any((self.out / HALT_FILE).exists())

    def _anomaly(self, step: int, kind: str, msg: str) -> None:
        self.art.event("anomaly", step, msg, anomaly_type=kind)
        if self.lead:
            write_halt(self.out, kind, f"step {step}: {msg}")

    # -- run ------------------------------------------------------------------

    def compile(self, batch: jax.Array):
        """Compiles the step ahead of time; a fresh state is initialised meanwhile.

        The step is lowered against the state's shapes, so XLA compiles it in one
        worker thread while another builds (compiles and runs) the init. The main
        thread only waits, so a stop signal (SIGINT, SIGTERM) ends the wait at once:
        None then, and the threads (daemons) are left behind.
        """
        abstract = self.state if self.state is not None else self.plan.state_shapes
        self.say("compile: tracing and compiling the train step (cached programs load in seconds)")
        self._doing("compile: compiling the train step")
        box: dict[str, Any] = {}
        compiled_done, state_done = threading.Event(), threading.Event()

        def timed_compile():
            try:
                lowered = self.train_step.lower(abstract, batch)
                t0 = time.perf_counter()
                box["compiled"] = lowered.compile()
                box["seconds"] = time.perf_counter() - t0
            except BaseException as e:  # noqa: BLE001 - raised in the main thread
                box["error"] = e
            compiled_done.set()

        def init_state():
            try:
                box["state"] = S.create_state(self.plan)
            except BaseException as e:  # noqa: BLE001 - raised in the main thread
                box.setdefault("error", e)
            state_done.set()

        threading.Thread(target=timed_compile, name="nsa-compile", daemon=True).start()
        if self.state is None:
            threading.Thread(target=init_state, name="nsa-init-state", daemon=True).start()
        else:
            state_done.set()
        guard = getattr(self, "_preempt", None)
        for done in (state_done, compiled_done):
            while not done.wait(0.25):
                if guard is not None and guard.requested:
                    return None
        if guard is not None and guard.requested:
            return None
        if "error" in box:
            raise box["error"]
        if self.state is None:
            self.state = box["state"]
        self._doing(None)
        compiled, seconds = box["compiled"], box["seconds"]
        mem = compiled_memory(compiled)
        line = f"compile: {seconds:.1f}s" + describe(mem)
        self.say(line)
        self.art.event("compile", int(self.state.step), line, compile_s=seconds, memory_analysis=mem)
        self.art.write_env(compile={"seconds": seconds, "memory_analysis": mem})
        check_fits(self.cfg, mem, self.mesh.devices.flat[0])
        return compiled

    def run(self) -> dict[str, Any]:
        """Trains to train.steps; returns a summary (first/last loss, tokens/s, wall time).

        SIGINT and SIGTERM (checkpoint.PreemptionGuard, from before the compile on) stop the
        run after the step in flight with a checkpoint; summary["halted"] is then "sigint" or
        "sigterm", summary["checkpoint"] the newest committed step.
        """
        cfg = self.cfg
        t_start = time.perf_counter()
        # Ctrl-C / SIGTERM: finish the step in flight, save, return. Installed before Health, which
        # passes the signals it does not handle on to it (and restores it when it closes).
        self._preempt = ckpt.PreemptionGuard(self.mesh, on_first=self._stop_announcement, abort_note=self._kept_note)
        self._preempt.install()
        self._dispatched = int(self.state.step) if self.state is not None else 0
        # SIGUSR1 dumps from here on; the stall clock starts with the first step.
        self.health = Health(
            self.out, rank=jax.process_index(), stall_seconds=cfg.ops.stall_seconds, event=self.art.event
        ).start()
        quiet_stop = self._quiet_stop
        try:
            with self.health.paused():
                batch = self._next_batch()
                step_fn = self.compile(batch)
        except BaseException as e:
            # Nothing was trained: close what boot opened, say why in the heartbeat.
            quiet_stop.set()
            self.health.close()
            self.ckpt.close()
            self._preempt.uninstall()
            self.art.event("crash", int(self.state.step) if self.state is not None else 0, _first_line(e))
            self.art.close()
            self.data.close()
            raise
        start = int(self.state.step) if self.state is not None else 0
        self.summary = {
            "first_loss": None,
            "last_loss": None,
            "steps_done": start,
            "halted": None,
            "skipped_steps": 0,
            "error": None,
        }
        self._t_loop = self._last_done = self._last_line = time.perf_counter()
        self._interval = {"t": self._t_loop, "steps": 0, "step_s": 0.0}
        self._step_s = 0.0  # sum of the steps' own times
        self._last_step_s = None  # the last step's own time (LONG_STEP_S)
        self._first_step = start + 1
        pending: _Pending | None = None
        error: BaseException | None = None
        try:
            if step_fn is None:  # a stop signal during the compile: nothing to train or save
                self._stopped_by_signal(start, save=False)
            for step in range(start + 1, cfg.train.steps + 1):
                if step_fn is None:
                    break
                if pending is not None and self._one_at_a_time():
                    # Long steps: record step t-1 before t is dispatched, so a stop waits for one step.
                    ok, pending = self._record(pending), None
                    if not ok:
                        break
                if not self._poll_checkpoint():
                    break
                if self._halt_requested(step):
                    self.summary["halted"] = "halt_file"
                    self.say(f"halt: {self.out / HALT_FILE} found before step {step}")
                    self.art.event("halt", step - 1, ".HALT file found")
                    break
                if self._outputs_failed(step):
                    break
                if self._preempt.stop_requested():
                    self._stopped_by_signal(self._dispatched)
                    break
                if batch is None:
                    batch = self._next_batch()
                self.art.event("step_start", step)
                t_dispatch = time.perf_counter()
                self.state, metrics = step_fn(self.state, batch)
                self._dispatched = step
                batch = None
                # Step t is queued; now wait for t-1 and log it while the device runs t.
                if pending is not None and not self._record(pending):
                    pending = None
                    break
                evaluate = step % cfg.train.eval_every == 0 and not self.eval_off
                save = cfg.checkpoint.enabled and step % cfg.checkpoint.save_every == 0
                pending = _Pending(step, metrics, t_dispatch, evaluate)
                if evaluate or save:
                    # Wait for step t now, so its time is its own; evaluation and the save's
                    # blocking part are timed separately. Logged before it is saved, so
                    # training.csv never lacks a saved step.
                    ok, pending = self._record(pending), None
                    if not ok:
                        break
                    # A refused row must not be followed by a save of its step: training.csv never
                    # lacks a saved step (a resume keeps the rows up to the checkpoint).
                    if save and (self._outputs_failed(None) or not self._checkpoint()):
                        break
            if pending is not None:
                self._record(pending)
            if self.summary["halted"] is None:
                self._outputs_failed(None)  # a row of the last steps refused: no final save either
            if step_fn is not None and self.summary["halted"] not in (
                "nan_loss",
                "nan_grad",
                "checkpoint_failed",
                "output_failed",
            ):
                if self._checkpoint():
                    self._doing(f"checkpoint: writing step {self.summary['steps_done']}")
                    self._poll_checkpoint(block=True)
        except BaseException as e:
            error = e
            raise
        finally:
            # The stall clock stops first: the final checkpoint commit below is no training step.
            self.health.close()
            self.ckpt.close()  # waits until the last save is committed (a second signal quits at once)
            quiet_stop.set()
            self._preempt.uninstall()
            loop_s = time.perf_counter() - self._t_loop
            done = self.summary["steps_done"] - start
            self.summary.update(
                wall_s=time.perf_counter() - t_start,
                loop_s=loop_s,
                step_s=self._step_s,
                # tokens over the steps' own time: evaluation and saves are not in it
                toks_per_s=done * self.tokens_per_step / max(self._step_s, 1e-9),
                checkpoint=self.ckpt.committed,
            )
            if error is None:
                self.art.event("done", self.summary["steps_done"], "done", **self.summary)
            else:  # watchdogs must tell a crash from a finished run
                self.art.event("crash", self.summary["steps_done"], _first_line(error), **self.summary)
            self.art.close()
            self.data.close()
        s = self.summary
        self.say(
            f"done: {done} steps in {fmt_duration(loop_s)} (+{fmt_duration(s['wall_s'] - loop_s)} boot/compile) | "
            f"{s['toks_per_s']:,.0f} tok/s | loss {s['first_loss']:.4f} -> {s['last_loss']:.4f}"
            if done > 0
            else "done: no steps run"
        )
        return s

    def _one_at_a_time(self) -> bool:
        """True while steps take LONG_STEP_S or more, and before the first is timed (on a CPU a GPU
        config's first step takes minutes): no second step is queued behind the one in flight."""
        return self._last_step_s is None or self._last_step_s >= LONG_STEP_S

    def _stopped_by_signal(self, step: int, save: bool = True) -> None:
        """The run stops after `step` on SIGINT or SIGTERM: says so once, in the summary and the heartbeat."""
        name = self._preempt.signal_name or "SIGTERM"
        self.summary["halted"] = "sigint" if name == "SIGINT" else "sigterm"
        if not save:
            said = "interrupted: Ctrl-C (SIGINT)" if name == "SIGINT" else "preempted: SIGTERM"
            self.say(f"{said} received during the compile; stopping before step {step + 1}: nothing new to save")
            self.art.event("halt", step, f"{name} received")
            return
        if self.cfg.checkpoint.enabled:
            then = "saving a checkpoint"
        else:
            then = "no checkpoint (checkpoint.enabled=false)"
        if name == "SIGINT":
            self.say(
                f"interrupted: Ctrl-C (SIGINT) received; stopping after step {step}; {then} "
                "(Ctrl-C again quits at once without saving)"
            )
        else:
            self.say(f"preempted: SIGTERM received; stopping after step {step} and {then}")
        self.art.event("halt", step, f"{name} received")

    def _stop_announcement(self, name: str) -> str:
        """The line printed the moment the first stop signal arrives (the guard's helper thread)."""
        again = "Ctrl-C again" if name == "SIGINT" else "a second SIGTERM"
        summary = getattr(self, "summary", None)
        if summary is not None and summary["halted"] in ("sigint", "sigterm"):
            return ""  # the loop has said what it does
        if summary is None:
            what = "the run stops before its first step"
        elif self._one_at_a_time() and self._dispatched > summary["steps_done"]:
            took = f" (the last step took {fmt_duration(self._last_step_s)})" if self._last_step_s else ""
            what = f"the run stops when step {self._dispatched} ends{took}"
        else:
            what = f"the run stops after step {self._dispatched}"
        saving = ", saves a checkpoint," if self.cfg.checkpoint.enabled and summary is not None else ""
        return f"{name}: {what}{saving} and exits; {again} quits at once without saving"

    def _kept_note(self) -> str:
        """What a second stop signal leaves behind (the guard's helper thread)."""
        steps = resume.complete_steps(self.ckpt.dir)
        if not steps:
            return "no checkpoint was saved (the same command starts again from step 0)"
        return f"the newest checkpoint is step {steps[-1]} (the same command resumes from it)"

    def _checkpoint(self) -> bool:
        """Saves the current state, every step of which has been recorded, with the data position after it.

        False when a save failed (the run must stop); the `checkpoint` event follows once
        the step is committed (`_poll_checkpoint`).
        """
        if not self.cfg.checkpoint.enabled:
            return True
        step = self.summary["steps_done"]
        if int(jax.device_get(self.state.step)) != step:  # a step was dispatched but never recorded
            return True
        t0 = time.perf_counter()
        self._doing(f"checkpoint: saving step {step}")
        try:
            # The held-out rows are fixed (evaluation/heldout.py): no validation stream position to save.
            info = self.ckpt.save(step, self.state, self.data.get_state(), None)
        except ckpt.CheckpointSaveError as e:
            self._checkpoint_failed(e)
            return False
        # The next step's time starts after the save's blocking part.
        self._last_done = time.perf_counter()
        self._doing(None)
        if info is not None:
            self.art.event(
                "checkpoint_start",
                step,
                info["path"],
                save_s=self._last_done - t0,
                checksum_s=info["checksum_s"],
            )
        return True

    def _poll_checkpoint(self, block: bool = False) -> bool:
        """Writes `checkpoint` events for committed saves; False (and a `checkpoint_failed` event)
        for one that failed."""
        try:
            committed = self.ckpt.poll(block=block)
        except ckpt.CheckpointSaveError as e:
            self._checkpoint_failed(e)
            return False
        for step in committed:
            self.art.event("checkpoint", step, str(self.ckpt.dir / str(step)))
        return True

    def _checkpoint_failed(self, e: ckpt.CheckpointSaveError) -> None:
        last = self.ckpt.committed
        keep = f"the newest committed checkpoint is step {last}" if last is not None else "no checkpoint was committed"
        msg = f"{e}; {keep}; stopping (fix the cause and run the same command to resume)"
        self.summary.update(halted="checkpoint_failed", error=msg)
        self.art.event("checkpoint_failed", e.step, msg, cause=e.cause, committed_step=last)

    def _outputs_failed(self, step: int | None) -> bool:
        """True (and the run stops, with an `output_failed` event) once a run file could not be written.

        No save on the way out: the disk that refused a CSV row would most likely refuse the
        checkpoint too, and a failed save adds nothing to the committed ones. With several
        processes (only process 0 writes the CSVs) all agree at log intervals, as for .HALT.
        """
        failed = self.art.failed
        if jax.process_count() > 1:  # step None: before a save or after the last step, where every process checks
            if (step is not None and step % self.cfg.train.log_every) or not agree_any(failed is not None):
                return False
        elif failed is None:
            return False
        # A save in flight commits (its `checkpoint` event) or fails before the message names the newest.
        self._poll_checkpoint(block=True)
        last = self.ckpt.committed
        keep = f"the newest committed checkpoint is step {last}" if last is not None else "no checkpoint was committed"
        what = failed.strerror if failed is not None else "process 0 could not write its run files"
        msg = f"{what}; {keep}; stopping (free space and run the same command to resume)"
        self.summary.update(halted="output_failed", error=msg)
        self.art.event(
            "output_failed",
            self.summary["steps_done"],
            msg,
            path=str(failed.path) if failed else None,
            committed_step=last,
        )
        return True

    def _check_branch_scale(self, step: int, m: dict[str, Any]) -> None:
        """Warn once when the compressed keys or values outgrow the selection branch's."""
        if self._scale_warned or (found := _branch_scale_warning(m)) is None:
            return
        self._scale_warned = True
        ratio, what, layer = found
        msg = (
            f"the compressed {what} of layer {layer} are {ratio:.0f}x the selection branch's (RMS); "
            f"the compressed branch may swamp the others (docs/NSA.md, cmp_phi): "
            f"consider model.nsa.cmp_phi=avg or a lower train.lr"
        )
        self.say(f"warning: {msg}")
        self.art.event("branch_scale", step, msg, ratio=ratio, layer=layer)

    def _evaluate(self, step: int) -> tuple[dict[str, Any] | None, float | None, dict[str, float]]:
        """Held-out metrics (with eval_s) and eval.suites figures of the current state, waited for.

        (None, None, {}) when the validation rows cannot be read (a split with no document on
        some process): evaluation is switched off with one warning, the run goes on.
        """
        first = "" if self.evaluation.started else " (the first one reads the held-out rows and compiles)"
        self._doing(f"eval: step {step}: evaluating{first}")
        t0 = time.perf_counter()
        cause = self.evaluation.start()
        if cause is not None:
            self.eval_off = f"no validation rows ({cause}); this run evaluates nothing from step {step} on"
            self.say(f"warning: {self.eval_off}")
            self.art.event("eval_off", step, self.eval_off)
            self._doing(None)
            self._last_done = time.perf_counter()
            return None, None, {}
        val = self.evaluation.heldout(self.state.params)
        val["eval_s"] = eval_s = time.perf_counter() - t0
        self._doing(None)
        long = self.evaluation.long(self.state.params)
        self._last_done = time.perf_counter()
        return val, eval_s, long

    def _record(self, p: _Pending) -> bool:
        """Reads a finished step's metrics (blocking) and logs them; False stops the run."""
        cfg = self.cfg
        self._doing(f"step {p.step}/{cfg.train.steps}: running")
        m = jax.device_get(p.metrics)
        self._doing(None)
        now = time.perf_counter()
        # The step ran from when the device finished the previous one (or from its dispatch).
        step_time = now - max(self._last_done, p.dispatched)
        self._last_done = now
        self._step_s += step_time
        self._last_step_s = step_time
        val, eval_s, long = None, None, {}
        if p.evaluate:  # the state is still the one after p.step: nothing was dispatched since
            val, eval_s, long = self._evaluate(p.step)
        if p.step == self._dense_until + 1 and p.step > 1:
            self.say(f"selection: dense warm-up over; top-{cfg.model.nsa.n} from step {p.step}")
            self.art.event("selection_top_n", p.step, f"dense selection warm-up over, top-{cfg.model.nsa.n}")
        loss, lr = float(m["loss"]), float(m["lr"])
        aux = _aux_means(m)
        self._check_branch_scale(p.step, m)
        row = {
            "step": p.step,
            "loss": loss,
            "lr": lr,
            "toks_per_s": self.tokens_per_step / max(step_time, 1e-9),
            "grad_norm": float(m["grad_norm"]),
            "step_time_s": step_time,
            "tokens": p.step * self.tokens_per_step,
            "elapsed_s": now - self._t_loop,
            "skipped": int(m["skipped"]),
            "val_loss": val and val["val_loss"],
            "eval_s": eval_s,
            **aux,
        }
        self.art.row(row)
        self.art.event("step_end", p.step, "", loss=loss, lr=lr, step_time_s=step_time)
        self.health.step_ended(p.step)
        scalars = {f"train/{k}": row[k] for k in ("loss", "lr", "grad_norm", "toks_per_s", "step_time_s")}
        if val is not None:
            self.art.val_row({"step": p.step, "tokens": row["tokens"], "elapsed_s": row["elapsed_s"], **val})
            self.art.event("eval", p.step, format_eval(val).strip(" |"), **val)
            scalars.update(
                {
                    "eval/loss": val["val_loss"],
                    "eval/ppl": val["val_ppl"],
                    "eval/retrieval_acc": val["retrieval_acc"],
                    "eval/seconds": eval_s,
                }
            )
            if long:
                self.art.long_eval_row({"step": p.step, "tokens": row["tokens"], **long})
                scalars.update({f"long/{k}": v for k, v in long.items()})
                self.say(f"long eval: step {p.step} | " + " ".join(f"{k} {v:.3f}" for k, v in long.items()))
        projection = None
        if self.summary["first_loss"] is None:
            self.summary["first_loss"] = loss
            projection = cpu_projection(cfg, cfg.train.steps - p.step, step_time, jax.default_backend())
        self.summary.update(last_loss=loss, steps_done=p.step)

        iv = self._interval
        iv["steps"] += 1
        iv["step_s"] += step_time
        # A step line every train.log_every steps, and also at the first step of the run and
        # whenever QUIET_S passed without one (slow steps).
        due = p.step % cfg.train.log_every == 0 or p.step in (cfg.train.steps, self._first_step)
        if due or now - self._last_line >= QUIET_S:
            # tokens/s over the interval's own step times; the ETA counts evaluations and saves too
            rate = iv["steps"] * self.tokens_per_step / max(iv["step_s"], 1e-9)
            eta = (cfg.train.steps - p.step) * max(now - iv["t"], 1e-9) / iv["steps"]
            line = progress_line(p.step, cfg.train.steps, loss, lr, rate, eta)
            if val is not None:
                line += format_eval(val)
            self.say(line)
            self._last_line = now
            self.art.event("progress", p.step, line, loss=loss, lr=lr, toks_per_s=rate)
            scalars.update(
                {"train/toks_per_s_interval": rate, **{f"aux/{k}": v for k, v in aux.items()}, **_aux_per_layer(m)}
            )
            self._interval = {"t": now, "steps": 0, "step_s": 0.0}
        elif val is not None:
            self.say(f"eval: step {p.step}{format_eval(val)}")
        if projection:  # after the first step's line, which has the ETA it explains
            self.say(projection)
            self.art.event("projection", p.step, projection, step_time_s=step_time)
        self.art.scalars(p.step, scalars)

        if row["skipped"]:
            kind = "nan_loss" if not math.isfinite(loss) else "nan_grad"
            msg = f"non-finite {'loss' if kind == 'nan_loss' else 'gradient'} at step {p.step}; update skipped"
            self.summary["skipped_steps"] += 1
            skips = self.summary["skipped_steps"]
            too_many = 0 < cfg.ops.max_skips <= skips
            if too_many:
                msg += f"; {skips} updates skipped, ops.max_skips={cfg.ops.max_skips} reached"
            if cfg.ops.nan_policy == "halt" or too_many:
                self._anomaly(p.step, kind, msg)
                self.say(f"halt: {msg}; wrote {self.out / HALT_FILE}")
                self.summary["halted"] = kind
                return False
            self.art.event("anomaly", p.step, msg, anomaly_type=kind, skipped_steps=skips)
            self.say(f"warning: {msg} (ops.nan_policy=skip; {skips} skipped so far)")
        return True


def _branch_scale_warning(m: dict[str, Any]) -> tuple[float, str, int] | None:
    """(ratio, 'keys'/'values', layer) of the largest compressed/selection scale above CMP_SCALE_WARN, else None."""
    if SCALE_COLUMNS[0] not in m:
        return None
    worst = max(
        (float(r), what, i)
        for key, what in zip(SCALE_COLUMNS, ("keys", "values"), strict=True)
        for i, r in enumerate(np.asarray(m[key]))
    )
    return worst if worst[0] > CMP_SCALE_WARN else None


def _print_flushed(msg: str) -> None:
    """One line on stdout in one write, flushed: a log gets each line when it is said, and the
    progress and signal threads never split another thread's line."""
    sys.stdout.write(msg + "\n")
    sys.stdout.flush()


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0][:500]


def _aux_means(m: dict[str, Any]) -> dict[str, float]:
    if "gate_mean" not in m:
        return {}
    g = np.asarray(m["gate_mean"]).mean(axis=0)
    out = {f"gate_{b}": float(g[i]) for i, b in enumerate(BRANCHES)}
    out["gate_entropy"] = float(np.mean(m["gate_entropy"]))
    out["sel_far_frac"] = float(np.mean(m["sel_far_frac"]))
    for k in SCALE_COLUMNS:  # the largest layer's: the warning signal
        out[k] = float(np.max(m[k]))
    return out


def _aux_per_layer(m: dict[str, Any]) -> dict[str, float]:
    if "gate_mean" not in m:
        return {}
    out = {}
    for i, g in enumerate(np.asarray(m["gate_mean"])):
        out.update({f"layer{i}/gate_{b}": float(g[j]) for j, b in enumerate(BRANCHES)})
        out[f"layer{i}/gate_entropy"] = float(m["gate_entropy"][i])
        out[f"layer{i}/sel_far_frac"] = float(m["sel_far_frac"][i])
        out.update({f"layer{i}/{k}": float(m[k][i]) for k in SCALE_COLUMNS})
    return out


def train(cfg: Config, **kwargs: Any) -> dict[str, Any]:
    """Trainer(cfg, **kwargs).run()."""
    return Trainer(cfg, **kwargs).run()
