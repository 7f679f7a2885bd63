"""The training loop: boot -> data -> state -> compile -> steps.

`Trainer(cfg, ...)` does everything that can fail on bad input (boot.py: mesh, batch split, dataset,
first batch) so a launcher can report it as one line; `Trainer.run()` compiles the step ahead of time
(printing compile time and the compiled program's memory, checked against the device's:
nsa_jax/ops/memory.py) and trains.

The loop dispatches step t and only then reads step t-1's metrics, so the host prepares batch t+1 and
writes t-1's logs while the device runs t. Step time is the interval between consecutive completions and
is the step's own: at a step that evaluates or saves, the loop first waits for that step, then evaluates
(`eval_s`) or starts the save (`save_s` in the `checkpoint_start` event). Steps of LONG_STEP_S or more run
one at a time, so a stop waits for the step in flight only. A finished step's row and scalars: metrics.py;
step lines, the progress thread, warnings: progress.py; saves and failed writes: saves.py; evaluation:
nsa_jax/evaluation/training.py. Stops: SIGINT and SIGTERM, from before the compile on, are a flag
(nsa_jax/ops/preemption.py PreemptionGuard): the loop stops after the step in flight, saves a checkpoint,
and returns with summary["halted"] "sigint" / "sigterm" (launch.train exits 130 / 0); a second signal
ends the process; during the compile the run returns at once. Checkpoint seam: `Trainer(...,
state=TrainState, data_state=dict)` resumes from a restored state and data position; `trainer.state` /
`trainer.data.get_state()` are what a checkpoint saves.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import threading
import time
from typing import Any, Callable

import jax
import numpy as np

from nsa_jax.config import Config
from nsa_jax.evaluation.heldout import format_eval
from nsa_jax.evaluation.training import RunEvaluation
from nsa_jax.mesh import put_batch
from nsa_jax.ops.health import Health, halt_requested
from nsa_jax.ops.memory import check_fits, compiled_memory, describe
from nsa_jax.ops.preemption import PreemptionGuard
from nsa_jax.progress_text import fmt_duration
from nsa_jax.rundir import resume
from nsa_jax.rundir.files import HALT_FILE, write_halt
from nsa_jax.rundir.model_dir import initial_params
from nsa_jax.step import schedule
from nsa_jax.step.state import TrainState, check_trainable
from nsa_jax.step.step import create_state
from nsa_jax.train import metrics, progress
from nsa_jax.train.boot import boot, compile_step
from nsa_jax.train.saves import RunSaves
from nsa_jax.train.trace import StepTrace
from nsa_jax.words import count

# Steps at least this long run one at a time: the next step is dispatched once the one in
# flight is recorded, so a stop (SIGINT, SIGTERM, .HALT) waits for one step, not two. The
# host's share of such a step (a batch, a log row) is milliseconds.
LONG_STEP_S = 2.0


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
        check_trainable(cfg)  # before boot writes anything in the out dir
        # train.init_from's parameters (memory-mapped), their shapes checked against the model here, before
        # boot writes anything: a folder of another shape is one ConfigError and the out dir stays as it was.
        self._init_params = initial_params(cfg) if state is None else None
        self.cfg = cfg
        self.out = pathlib.Path(cfg.train.out_dir)
        self.lead = jax.process_index() == 0
        self.eval_off = eval_off
        # The run's lines; its progress thread from boot on (a kernel guard, a restore or a first batch can take long).
        self.reporter = progress.Reporter(self.lead, print_fn, note=self._last_step_note)
        self.say, self._doing = self.reporter.say, self.reporter.doing
        try:
            parts = boot(cfg, self.out, applied_env, (state, data_state), devices, eval_off, self.say, self._doing)
        except BaseException:
            self.reporter.close()
            raise
        finally:
            self._doing(None)
        self.cfg, self.mesh, self.plan, self.train_step = parts.cfg, parts.mesh, parts.plan, parts.train_step
        self.tokens_per_step, self.data, self.ckpt, self.art = parts.tokens_per_step, parts.data, parts.ckpt, parts.art
        self.state, self._first = parts.state, parts.first
        self._dense_until = schedule.dense_selection_steps(self.cfg)
        self._scale_warned = False
        # The step a stop signal's line named (the guard's announcement or the loop's); None: not said yet.
        self._stop_said: int | None = None
        self._stop_lock = threading.Lock()
        self._posted_after: int | None = None  # several processes: the step after which the stop flag was posted
        # Held-out metrics and eval.suites; what they read and compile is built at the first evaluation.
        self.evaluation = RunEvaluation(self.cfg, self.mesh, self.plan.kernel_fallback)

    def _last_step_note(self) -> str:
        last = getattr(self, "_last_step_s", None)
        return f" (the last step took {fmt_duration(last)})" if last else ""

    def _next_tokens(self) -> np.ndarray:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return next(self.data)

    def _next_batch(self) -> Any:
        """A micro-batches of this process's rows, placed as the global [A, B, T + 1] array (each leaf
        of a batch pytree: data/targets.LabeledRows)."""
        rows = [self._next_tokens() for _ in range(self.cfg.train.accumulate)]
        return put_batch(jax.tree.map(lambda *xs: np.stack(xs), *rows), self.mesh)

    # -- run ------------------------------------------------------------------

    def compile(self, batch: jax.Array):
        """Compiles the step ahead of time while a fresh state is initialised (boot.compile_step);
        None after a stop signal during the compile. Says the compile time and the compiled memory,
        and raises WontFitError for a step that cannot fit the device."""
        abstract = self.state if self.state is not None else self.plan.state_shapes
        self.say("compile: tracing and compiling the train step (cached programs load in seconds)")
        self._doing("compile: compiling the train step")
        guard = getattr(self, "_preempt", None)
        init = None
        if self.state is None:
            start = self._init_params  # train.init_from's, or None: random
            if start is not None:
                self.say(f"init: parameters from {self.cfg.train.init_from} (train.init_from)")
            init = functools.partial(create_state, self.plan, params=start)
        out = compile_step(self.train_step, abstract, batch, init, lambda: guard is not None and guard.requested)
        if out is None:
            return None
        compiled, seconds, state = out
        if self.state is None:
            self.state = state
        self._doing(None)
        mem = compiled_memory(compiled)
        line = f"compile: {seconds:.1f}s" + describe(mem)
        self.say(line)
        self.art.event("compile", int(self.state.step), line, compile_s=seconds, memory_analysis=mem)
        self.art.write_env(compile={"seconds": seconds, "memory_analysis": mem})
        check_fits(self.cfg, mem, self.mesh.devices.flat[0])
        return compiled

    def run(self) -> dict[str, Any]:
        """Trains to train.steps; returns a summary (first/last loss, tokens/s, wall time).

        SIGINT and SIGTERM (PreemptionGuard, from before the compile on) stop the
        run after the step in flight with a checkpoint; summary["halted"] is then "sigint" or
        "sigterm", summary["checkpoint"] the newest committed step.
        """
        t_start = time.perf_counter()
        step_fn, batch = self._start()
        start = int(self.state.step) if self.state is not None else 0
        self.summary = dict(first_loss=None, last_loss=None, steps_done=start, halted=None, skipped_steps=0, error=None)
        self.saves = RunSaves(self.cfg, self.ckpt, self.art, self.summary, self._doing)
        self.trace = StepTrace(
            self.cfg.logging.profile_steps, self.out, jax.process_index(), start, self.say, self.art.event
        )
        self._t_loop = self._last_done = time.perf_counter()
        self._lines = progress.StepLines(
            self.cfg.train.steps, self.cfg.train.log_every, start + 1, self.tokens_per_step, self._t_loop
        )
        self._step_s = 0.0  # sum of the steps' own times
        self._last_step_s = None  # the last step's own time (LONG_STEP_S)
        error: BaseException | None = None
        try:
            if step_fn is None:  # a stop signal during the compile: nothing to train or save
                self._stopped_by_signal(start, save=False)
            else:
                self._steps(step_fn, batch, start)
                self._final_save()
        except BaseException as e:
            error = e
            raise
        finally:
            self._close(start, t_start, error)
        s = self.summary
        done, loop_s, fmt = s["steps_done"] - start, s["loop_s"], fmt_duration
        self.say(
            f"done: {count(done, 'step')} in {fmt(loop_s)} (+{fmt(s['wall_s'] - loop_s)} boot/compile) | "
            f"{s['toks_per_s']:,.0f} tok/s | loss {s['first_loss']:.4f} -> {s['last_loss']:.4f}"
            if done > 0
            else "done: no steps run"
        )
        return s

    def _start(self) -> tuple[Callable | None, jax.Array]:
        """Stop signals and the stall clock from here on, then the compile: (the compiled step, or None
        after a stop signal during the compile; the first batch). When it fails nothing was trained:
        what boot opened is closed and the heartbeat says why."""
        # Ctrl-C / SIGTERM: finish the step in flight, save, return. Installed before Health, which
        # passes the signals it does not handle on to it (and restores it when it closes).
        self._preempt = PreemptionGuard(
            self.mesh, on_first=self._stop_announcement, abort_note=self._kept_note, on_abort=self.reporter.mute
        )
        self._preempt.install()
        self._dispatched = int(self.state.step) if self.state is not None else 0
        # SIGUSR1 dumps from here on; the stall clock starts with the first step.
        self.health = Health(
            self.out, rank=jax.process_index(), stall_seconds=self.cfg.ops.stall_seconds, event=self.art.event
        ).start()
        try:
            with self.health.paused():
                batch = self._next_batch()
                return self.compile(batch), batch
        except BaseException as e:
            self.reporter.close()
            self.health.close()
            self.ckpt.close()
            self._preempt.uninstall()
            self.art.event("crash", int(self.state.step) if self.state is not None else 0, _first_line(e))
            self.art.close()
            self.data.close()
            raise

    def _steps(self, step_fn: Callable, batch: jax.Array | None, start: int) -> None:
        """Steps start + 1 .. train.steps, each recorded while the next runs, until one of them stops the run."""
        cfg = self.cfg
        pending: _Pending | None = None
        for step in range(start + 1, cfg.train.steps + 1):
            if pending is not None and self._one_at_a_time():
                # Long steps: record step t-1 before t is dispatched, so a stop waits for one step.
                ok, pending = self._record(pending), None
                if not ok:
                    break
            if self._stops_before(step):
                break
            if batch is None:
                batch = self._next_batch()
            if self.trace.starts_at(step):
                self.trace.start(step)
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
            save = cfg.checkpoint.enabled and (step % cfg.checkpoint.save_every == 0 or self.saves.due(step))
            pending = _Pending(step, metrics, t_dispatch, evaluate)
            trace_end = self.trace.ends_at(step)
            if evaluate or save or trace_end:
                # Wait for step t now, so its time is its own; evaluation and the save's
                # blocking part are timed separately. Logged before it is saved, so
                # training.csv never lacks a saved step.
                ok, pending = self._record(pending), None
                if trace_end:  # the window's last step has finished
                    with self.health.paused():
                        self.trace.stop(step)
                if not ok:
                    break
                # A refused row must not be followed by a save of its step: training.csv never
                # lacks a saved step (a resume keeps the rows up to the checkpoint).
                if save and (self.saves.outputs_failed(None) or not self._checkpoint()):
                    break
        if pending is not None:
            self._record(pending)

    def _stops_before(self, step: int) -> bool:
        """Whether the run stops before `step`: a failed save, .HALT, a run file not written, a stop signal."""
        if not self.saves.poll():
            return True
        if halt_requested(self.out, step, self.cfg.train.log_every):
            self.summary["halted"] = "halt_file"
            self.say(f"halt: {self.out / HALT_FILE} found before step {step}")
            self.art.event("halt", step - 1, ".HALT file found")
            return True
        if self.saves.outputs_failed(step):
            return True
        with self._stop_lock:  # the stop announcement reads whether the flag was posted, and after which step
            stop = self._preempt.stop_requested()
            if self._posted_after is None and self._preempt.posted_stop:
                self._posted_after = self._dispatched
        if stop:
            self._stopped_by_signal(self._dispatched)
            return True
        return False

    def _final_save(self) -> None:
        """The save after the last step or a stop; none after an anomaly or a failed write."""
        if self.summary["halted"] is None:
            self.saves.outputs_failed(None)  # a row of the last steps refused: no final save either
        if self.summary["halted"] in ("nan_loss", "nan_grad", "checkpoint_failed", "output_failed"):
            return
        if self._checkpoint():
            self._doing(f"checkpoint: writing step {self.summary['steps_done']}")
            self.saves.poll(block=True)

    def _checkpoint(self) -> bool:
        """Saves the current state (saves.py); False when the save failed (the run must stop)."""
        ok, done = self.saves.save(self.state, self.data)
        if done is not None:  # the next step's time starts after the save's blocking part
            self._last_done = done
        return ok

    def _close(self, start: int, t_start: float, error: BaseException | None) -> None:
        """Closes what the run opened; the summary's times, and `done` (or `crash`) in the heartbeat."""
        # The stall clock stops first: the final checkpoint commit below is no training step.
        self.health.close()
        self.trace.stop(self.summary["steps_done"])  # a run stopped inside its profile window
        self.ckpt.close()  # waits until the last save is committed (a second signal quits at once)
        self.reporter.close()
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

    def _one_at_a_time(self) -> bool:
        """True while steps take LONG_STEP_S or more, and before the first is timed (on a CPU a GPU
        config's first step takes minutes): no second step is queued behind the one in flight."""
        return self._last_step_s is None or self._last_step_s >= LONG_STEP_S

    def _stopped_by_signal(self, step: int, save: bool = True) -> None:
        """The run stops after `step` on SIGINT or SIGTERM: in the summary and the heartbeat, and said unless
        the guard's announcement said it already (`_stop_said`)."""
        name = self._preempt.signal_name or "SIGTERM"
        self.summary["halted"] = "sigint" if name == "SIGINT" else "sigterm"
        with self._stop_lock:
            said, self._stop_said = self._stop_said, step
        if said != step:  # not said, or said of another step (processes agree one step later)
            self.say(progress.signal_stop_line(name, step, save, self.cfg.checkpoint.enabled))
        self.art.event("halt", step, f"{name} received")

    def _stop_announcement(self, name: str) -> str:
        """The line printed the moment the first stop signal arrives (the guard's helper thread); "" when the
        loop has said the stop already, so it is said once."""
        summary = getattr(self, "summary", None)
        if not self.lead:
            return ""  # process 0 speaks for the run (every process gets a Ctrl-C)
        with self._stop_lock:
            if self._stop_said is not None:
                return ""
            # The step the run stops after (before its first step: the start, as the loop says it).
            self._stop_said = stop = self._dispatched if summary is None else self._stop_step()
        if summary is None:
            what = "the run stops before its first step"
        elif self._one_at_a_time() and stop == self._dispatched > summary["steps_done"]:
            what = f"the run stops when step {stop} ends{self._last_step_note()}"
        else:
            what = f"the run stops after step {stop}"
        return progress.stop_announcement(name, what, saves=self.cfg.checkpoint.enabled and summary is not None)

    def _stop_step(self) -> int:
        """The step a stop signal seen now ends the run after (under `_stop_lock`): the step in flight; with several
        processes, the step dispatched after the boundary that posts the flag (they read it one boundary later)."""
        if not self._preempt.agrees_late:
            return self._dispatched
        posted_after = self._dispatched if self._posted_after is None else self._posted_after
        return min(posted_after + 1, self.cfg.train.steps)

    def _kept_note(self) -> str:
        """What a second stop signal leaves behind (the guard's helper thread)."""
        return progress.kept_note(resume.complete_steps(self.ckpt.dir))

    def _check_branch_scale(self, step: int, m: dict[str, Any]) -> None:
        """Warn once when the compressed keys or values outgrow the selection branch's."""
        if self._scale_warned or (found := metrics.branch_scale_warning(m)) is None:
            return
        self._scale_warned = True
        msg = metrics.branch_scale_message(*found)
        self.say(f"warning: {msg}")
        self.art.event("branch_scale", step, msg, ratio=found[0], layer=found[2])

    def _evaluate(self, step: int) -> tuple[dict[str, Any] | None, float | None, dict[str, float]]:
        """(held-out metrics, eval_s, eval.suites figures) of the current state (evaluation/training.py); (None,
        None, {}) when the validation rows cannot be read: evaluation is off with one warning, the run goes on."""
        val, eval_s, long, off = self.evaluation(self.state.params, step, self._doing)
        if off is not None:
            self.eval_off = off
            self.say(f"warning: {off}")
            self.art.event("eval_off", step, off)
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
        # The state is still the one after p.step: nothing was dispatched since.
        val, eval_s, long = self._evaluate(p.step) if p.evaluate else (None, None, {})
        if p.step == self._dense_until + 1 and p.step > 1:
            self.say(f"selection: dense warm-up over; top-{cfg.model.nsa.n} from step {p.step}")
            self.art.event("selection_top_n", p.step, f"dense selection warm-up over, top-{cfg.model.nsa.n}")
        self._check_branch_scale(p.step, m)
        row = metrics.step_row(p.step, m, step_time, self.tokens_per_step, now - self._t_loop, val, eval_s)
        loss, lr = row["loss"], row["lr"]
        self.art.row(row)
        self.art.event("step_end", p.step, "", loss=loss, lr=lr, step_time_s=step_time)
        self.health.step_ended(p.step)
        if cfg.logging.mem_dump_every and p.step % cfg.logging.mem_dump_every == 0:
            self.art.memory_profile(p.step)
        scalars = metrics.train_scalars(row)
        if val is not None:
            scalars.update(self._log_eval(p.step, row, val, eval_s, long))
        projection = None
        if self.summary["first_loss"] is None:
            self.summary["first_loss"] = loss
            projection = progress.cpu_projection(cfg, cfg.train.steps - p.step, step_time, jax.default_backend())
        self.summary.update(last_loss=loss, steps_done=p.step)
        line = self._lines.after(p.step, step_time, now, loss, lr)
        if line is not None:
            text, rate = line[0] + (format_eval(val) if val is not None else ""), line[1]
            self.say(text)
            self.art.event("progress", p.step, text, loss=loss, lr=lr, toks_per_s=rate)
            scalars.update(metrics.interval_scalars(rate, m))
        elif val is not None:
            self.say(f"eval: step {p.step}{format_eval(val)}")
        if projection:  # after the first step's line, which has the ETA it explains
            self.say(projection)
            self.art.event("projection", p.step, projection, step_time_s=step_time)
        self.art.scalars(p.step, scalars)
        return self._skipped(p.step, loss) if row["skipped"] else True

    def _log_eval(self, step: int, row: dict, val: dict, eval_s: float | None, long: dict) -> dict[str, Any]:
        """Writes an evaluation's val.csv (and long_eval.csv) row and event; returns its TensorBoard scalars."""
        self.art.val_row({"step": step, "tokens": row["tokens"], "elapsed_s": row["elapsed_s"], **val})
        self.art.event("eval", step, format_eval(val).strip(" |"), **val)
        scalars = metrics.eval_scalars(val, eval_s)
        if long:
            self.art.long_eval_row({"step": step, "tokens": row["tokens"], **long})
            scalars.update({f"long/{k}": v for k, v in long.items()})
            self.say(f"long eval: step {step} | " + " ".join(f"{k} {v:.3f}" for k, v in long.items()))
        return scalars

    def _skipped(self, step: int, loss: float) -> bool:
        """A step whose update was skipped (non-finite loss or gradient): a warning, or the run halts
        (ops.nan_policy=halt, or ops.max_skips reached; False)."""
        self.summary["skipped_steps"] += 1
        skips = self.summary["skipped_steps"]
        kind, msg, too_many = metrics.skipped_update(step, loss, skips, self.cfg.ops.max_skips)
        if self.cfg.ops.nan_policy == "halt" or too_many:
            self.art.event("anomaly", step, msg, anomaly_type=kind)
            if self.lead:
                write_halt(self.out, kind, f"step {step}: {msg}")
            self.say(f"halt: {msg}; wrote {self.out / HALT_FILE}")
            self.summary["halted"] = kind
            return False
        self.art.event("anomaly", step, msg, anomaly_type=kind, skipped_steps=skips)
        self.say(f"warning: {msg} (ops.nan_policy=skip; {skips} skipped so far)")
        return True


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0][:500]


def train(cfg: Config, **kwargs: Any) -> dict[str, Any]:
    """Trainer(cfg, **kwargs).run()."""
    return Trainer(cfg, **kwargs).run()
