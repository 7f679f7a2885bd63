"""The training loop: boot -> data -> state -> compile -> steps. The only place with I/O.

`Trainer(cfg, ...)` does everything that can fail on bad input (mesh, batch split,
dataset, first batch) so a launcher can report it as one line; `Trainer.run()`
compiles the step ahead of time (printing compile time and the compiled program's
memory) and trains.

The loop never waits on the device without need: it dispatches step t, and only
then reads step t-1's metrics (which blocks until t-1 is done while t is already
queued). The host therefore prepares batch t+1 and writes t-1's logs while the
device runs t. Step time is the interval between consecutive completions.

Checkpoint seam: `Trainer(..., state=TrainState, data_state=dict)` resumes from a
restored train state and data position; `trainer.state` / `trainer.data.get_state()`
are what a checkpoint saves.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import pathlib
import time
from typing import Any, Callable

import jax
import numpy as np

from nsa_jax import checkpoint as ckpt
from nsa_jax.config import Config
from nsa_jax.data import first_batch_with_timeout, make_dataset
from nsa_jax.ops.health import Health, agree_any, write_halt
from nsa_jax.train import step as S
from nsa_jax.train.artifacts import BRANCHES, RunArtifacts
from nsa_jax.train.evaluate import Evaluator, format_eval
from nsa_jax.train.state import TrainState, init_state


def fmt_duration(seconds: float) -> str:
    """45 -> '45s', 83 -> '1m23s', 7500 -> '2h05m'."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def progress_line(step: int, steps: int, loss: float, lr: float, toks_per_s: float, eta_s: float) -> str:
    """`step 40/300 | loss 3.1234 | lr 1.00e-03 | 12,345 tok/s | ETA 1m23s`."""
    return f"step {step}/{steps} | loss {loss:.4f} | lr {lr:.2e} | {toks_per_s:,.0f} tok/s | ETA {fmt_duration(eta_s)}"


def memory_summary(compiled) -> dict[str, int] | None:
    """Per-device bytes of the compiled step: arguments, outputs, aliased, temporaries."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        return None
    if m is None:
        return None
    keys = (
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "alias_size_in_bytes",
        "temp_size_in_bytes",
        "generated_code_size_in_bytes",
    )
    return {k: int(getattr(m, k, 0) or 0) for k in keys}


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


@dataclasses.dataclass
class _Pending:
    """A dispatched step whose metrics have not been read yet."""

    step: int
    metrics: dict[str, jax.Array]
    dispatched: float
    val: dict[str, jax.Array] | None  # Evaluator.dispatch sums, when this step evaluated


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
        print_fn: Callable[[str], None] = print,
    ):
        self.cfg = cfg
        self.out = pathlib.Path(cfg.train.out_dir)
        self.lead = jax.process_index() == 0
        self._print = print_fn
        self.mesh = S.make_mesh(cfg, devices)
        # Strategy, shardings and the batch split, derived and checked once for the run.
        self.plan = S.make_plan(cfg, self.mesh)
        n_dev = self.plan.n_devices
        self.tokens_per_step = cfg.train.global_batch * cfg.train.accumulate * cfg.train.seq_len
        self.train_step = S.make_train_step(self.plan)
        # Opening the stream validates the data settings before any artifact is written.
        self.data = make_dataset(cfg, "train", process_index=jax.process_index(), process_count=jax.process_count())
        # Checkpoints in out_dir are resumed from, never trained over (nsa_jax/checkpoint.py).
        self.ckpt = ckpt.Checkpointer(cfg, self.out, self.mesh, warn=self.say)
        restored = self.ckpt.restore_latest() if state is None and data_state is None else None
        if restored is not None:
            state, data_state = restored.state, restored.train_data
        if data_state is not None:
            self.data.set_state(data_state)
        # The CSVs keep their rows up to the checkpoint; later steps are re-run and appended.
        self.art = RunArtifacts(cfg, self.out, self.mesh, applied_env, resume_step=restored.step if restored else None)
        if restored is not None:
            how = "" if restored.train_data is not None else " (data stream restarted: checkpoint.restore_data=false)"
            self.say(f"resume: step {restored.step} from {restored.path}{how}")
            self.art.event("resume", restored.step, str(restored.path))
        self.say(
            f"boot: {jax.process_count()} process(es), {n_dev} {jax.default_backend()} device(s) on the data axis, "
            f"per-device batch {cfg.train.global_batch // n_dev} x accumulate {cfg.train.accumulate}, "
            f"{self.tokens_per_step:,} tokens/step -> {self.out}"
        )
        self.art.event(
            "boot", 0, "boot", devices=n_dev, processes=jax.process_count(), tokens_per_step=self.tokens_per_step
        )
        self._first = self._first_batch()
        self.evaluator: Evaluator | None = None  # built at the first evaluation
        self.state = state

    # -- output ---------------------------------------------------------------

    def say(self, msg: str) -> None:
        if self.lead:
            self._print(msg)

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

    def _eval(self, params) -> dict[str, jax.Array]:
        """Metrics of the fixed held-out set (dispatched, not waited for)."""
        if self.evaluator is None:
            self.evaluator = Evaluator(self.cfg, self.mesh)
        return self.evaluator.dispatch(params)

    # -- halting --------------------------------------------------------------

    def _halt_requested(self, step: int) -> bool:
        """<out>/.HALT present; in multi-process runs agreed at log intervals so all stop together."""
        if jax.process_count() == 1:
            return (self.out / ".HALT").exists()
        if step % self.cfg.train.log_every:
            return False
        return agree_any((self.out / ".HALT").exists())

    def _anomaly(self, step: int, kind: str, msg: str) -> None:
        self.art.event("anomaly", step, msg, anomaly_type=kind)
        if self.lead:
            write_halt(self.out, kind, f"step {step}: {msg}")

    # -- run ------------------------------------------------------------------

    def compile(self, batch: jax.Array):
        """Compiles the step ahead of time; a fresh state is initialised meanwhile.

        The step is lowered against the state's shapes, so XLA compiles it in a
        worker thread while the main thread builds (compiles and runs) the init.
        """
        abstract = self.state if self.state is not None else jax.eval_shape(functools.partial(init_state, self.cfg))
        lowered = self.train_step.lower(abstract, batch)

        def timed_compile():
            t0 = time.perf_counter()
            return lowered.compile(), time.perf_counter() - t0

        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nsa-compile") as pool:
            job = pool.submit(timed_compile)
            if self.state is None:
                self.state = S.create_state(self.plan)
            compiled, seconds = job.result()
        mem = memory_summary(compiled)
        line = f"compile: {seconds:.1f}s"
        if mem:
            line += (
                f" | per device: arguments {_mib(mem['argument_size_in_bytes'])}, "
                f"temporaries {_mib(mem['temp_size_in_bytes'])}, outputs {_mib(mem['output_size_in_bytes'])} "
                f"({_mib(mem['alias_size_in_bytes'])} aliased to donated inputs)"
            )
        self.say(line)
        self.art.event("compile", int(self.state.step), line, compile_s=seconds, memory_analysis=mem)
        self.art.write_env(compile={"seconds": seconds, "memory_analysis": mem})
        return compiled

    def run(self) -> dict[str, Any]:
        """Trains to train.steps; returns a summary (first/last loss, tokens/s, wall time)."""
        cfg = self.cfg
        t_start = time.perf_counter()
        # SIGUSR1 dumps from here on; the stall clock starts with the first step.
        self.health = Health(
            self.out, rank=jax.process_index(), stall_seconds=cfg.ops.stall_seconds, event=self.art.event
        ).start()
        with self.health.paused():
            batch = self._next_batch()
            step_fn = self.compile(batch)
        start = int(self.state.step)
        self.summary = {"first_loss": None, "last_loss": None, "steps_done": start, "halted": None, "skipped_steps": 0}
        self._t_loop = self._last_done = time.perf_counter()
        self._interval = {"t": self._t_loop, "steps": 0}
        pending: _Pending | None = None
        # SIGTERM (preemption): finish the step in flight, save, return normally.
        self._preempt = ckpt.PreemptionGuard(self.mesh)
        self._preempt.install()
        error: BaseException | None = None
        try:
            for step in range(start + 1, cfg.train.steps + 1):
                if self._halt_requested(step):
                    self.summary["halted"] = "halt_file"
                    self.say(f"halt: {self.out / '.HALT'} found before step {step}")
                    self.art.event("halt", step - 1, ".HALT file found")
                    break
                if self._preempt.stop_requested():
                    self.summary["halted"] = "sigterm"
                    self.say(f"preempted: SIGTERM received; stopping after step {step - 1} and saving a checkpoint")
                    self.art.event("halt", step - 1, "SIGTERM received")
                    break
                if batch is None:
                    batch = self._next_batch()
                self.art.event("step_start", step)
                t_dispatch = time.perf_counter()
                self.state, metrics = step_fn(self.state, batch)
                batch = None
                val = self._eval(self.state.params) if step % cfg.train.eval_every == 0 else None
                # Step t is queued; now wait for t-1 and log it while the device runs t.
                if pending is not None and not self._record(pending):
                    pending = None
                    break
                pending = _Pending(step, metrics, t_dispatch, val)
                if cfg.checkpoint.enabled and step % cfg.checkpoint.save_every == 0:
                    # Log step t before it is saved, so training.csv never lacks a saved step.
                    ok, pending = self._record(pending), None
                    if not ok:
                        break
                    self._checkpoint()
            if pending is not None:
                self._record(pending)
            if self.summary["halted"] not in ("nan_loss", "nan_grad"):
                self._checkpoint()
        except BaseException as e:
            error = e
            raise
        finally:
            # The stall clock stops first: the final checkpoint commit below is no training step.
            self.health.close()
            self.ckpt.close()  # waits until the last save is committed (SIGTERM still deferred)
            self._preempt.uninstall()
            loop_s = time.perf_counter() - self._t_loop
            done = self.summary["steps_done"] - start
            self.summary.update(
                wall_s=time.perf_counter() - t_start,
                loop_s=loop_s,
                toks_per_s=done * self.tokens_per_step / max(loop_s, 1e-9),
            )
            if error is None:
                self.art.event("done", self.summary["steps_done"], "done", **self.summary)
            else:  # watchdogs must tell a crash from a finished run
                msg = f"{type(error).__name__}: {error}".splitlines()[0][:500]
                self.art.event("crash", self.summary["steps_done"], msg, **self.summary)
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

    def _checkpoint(self) -> None:
        """Saves the current state, every step of which has been recorded, with the data position after it."""
        if not self.cfg.checkpoint.enabled:
            return
        step = self.summary["steps_done"]
        if int(jax.device_get(self.state.step)) != step:  # a step was dispatched but never recorded
            return
        # The held-out rows are fixed (evaluate.py): no validation stream position to save.
        info = self.ckpt.save(step, self.state, self.data.get_state(), None)
        if info is not None:
            self.art.event("checkpoint", step, info["path"], blocking_s=info["blocking_s"])

    def _record(self, p: _Pending) -> bool:
        """Reads a finished step's metrics (blocking) and logs them; False stops the run."""
        cfg = self.cfg
        m = jax.device_get(p.metrics)
        val = None if p.val is None else Evaluator.finish(p.val)
        now = time.perf_counter()
        # The step ran from when the device finished the previous one (or from its dispatch).
        step_time = now - max(self._last_done, p.dispatched)
        self._last_done = now
        loss, lr = float(m["loss"]), float(m["lr"])
        aux = _aux_means(m)
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
                {"eval/loss": val["val_loss"], "eval/ppl": val["val_ppl"], "eval/retrieval_acc": val["retrieval_acc"]}
            )
        if self.summary["first_loss"] is None:
            self.summary["first_loss"] = loss
        self.summary.update(last_loss=loss, steps_done=p.step)

        self._interval["steps"] += 1
        if p.step % cfg.train.log_every == 0 or p.step == cfg.train.steps:
            span = max(now - self._interval["t"], 1e-9)
            rate = self._interval["steps"] * self.tokens_per_step / span
            eta = (cfg.train.steps - p.step) * span / self._interval["steps"]
            line = progress_line(p.step, cfg.train.steps, loss, lr, rate, eta)
            if val is not None:
                line += format_eval(val)
            self.say(line)
            self.art.event("progress", p.step, line, loss=loss, lr=lr, toks_per_s=rate)
            scalars.update(
                {"train/toks_per_s_interval": rate, **{f"aux/{k}": v for k, v in aux.items()}, **_aux_per_layer(m)}
            )
            self._interval = {"t": now, "steps": 0}
        elif val is not None:
            self.say(f"eval: step {p.step}{format_eval(val)}")
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
                self.say(f"halt: {msg}; wrote {self.out / '.HALT'}")
                self.summary["halted"] = kind
                return False
            self.art.event("anomaly", p.step, msg, anomaly_type=kind, skipped_steps=skips)
            self.say(f"warning: {msg} (ops.nan_policy=skip; {skips} skipped so far)")
        return True


def _aux_means(m: dict[str, Any]) -> dict[str, float]:
    if "gate_mean" not in m:
        return {}
    g = np.asarray(m["gate_mean"]).mean(axis=0)
    out = {f"gate_{b}": float(g[i]) for i, b in enumerate(BRANCHES)}
    out["gate_entropy"] = float(np.mean(m["gate_entropy"]))
    out["sel_far_frac"] = float(np.mean(m["sel_far_frac"]))
    return out


def _aux_per_layer(m: dict[str, Any]) -> dict[str, float]:
    if "gate_mean" not in m:
        return {}
    out = {}
    for i, g in enumerate(np.asarray(m["gate_mean"])):
        out.update({f"layer{i}/gate_{b}": float(g[j]) for j, b in enumerate(BRANCHES)})
        out[f"layer{i}/gate_entropy"] = float(m["gate_entropy"][i])
        out[f"layer{i}/sel_far_frac"] = float(m["sel_far_frac"][i])
    return out


def train(cfg: Config, **kwargs: Any) -> dict[str, Any]:
    """Trainer(cfg, **kwargs).run()."""
    return Trainer(cfg, **kwargs).run()
