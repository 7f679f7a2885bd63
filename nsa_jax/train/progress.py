"""What a training run says, and when: step lines, the quiet-time reporter, warnings and stop lines.

Nothing here touches the device or the run directory; the loop (loop.py) calls in.

  - `Reporter`: `say` prints on process 0, one write a line, flushed; `doing(what)`
    names what the run is doing from now on, and a thread says what and for how long
    whenever QUIET_S passed without a line while it lasts (a compile, a step, an
    evaluation, a save);
  - `StepLines`: when a step line is due (the first step of the run, every
    train.log_every steps, the last step, and whenever QUIET_S passed without one) and
    what it says (`progress_line`: loss, lr, tokens/s over the interval's own step
    times, an ETA over its wall time, evaluations and saves included);
  - warnings: a config meant for a GPU on a CPU (`gpu_settings`, `gpu_config_warning`),
    and after the first step a run projected past CPU_PROJECTION_WARN_S on a CPU
    (`cpu_projection`);
  - the lines of a stop by SIGINT or SIGTERM (`signal_stop_line`, `stop_announcement`, `kept_note`).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable

from nsa_jax.config import Config
from nsa_jax.progress_text import fmt_duration, so_far
from nsa_jax.words import count

# While the run works, a line at least this often (a long compile, step or evaluation says
# what it is doing); also the longest interval between step lines.
QUIET_S = 25.0
# Warn with the projected time when a run on a CPU would take longer than this.
CPU_PROJECTION_WARN_S = 12 * 3600.0


# The largest model meant for a CPU, d_model x n_layers (configs/cpu_small.yaml: 384 x 6). Telling a run
# of such a model to train a small config instead (--config cpu_tiny) is no help.
CPU_SIZED_WIDTH_X_DEPTH = 384 * 6
# Per setting meant for a GPU: how a CPU run of the same config goes without it.
_CPU_FIX = {
    "model.dtype bfloat16": "--precision fp32",
    "model.nsa.attention_impl pallas": "--set model.nsa.attention_impl=xla",
}


def gpu_settings(cfg: Config) -> list[str]:
    """The settings of `cfg` that are meant for a GPU (a CPU runs them, slowly). attention_impl auto is
    not one: off a GPU it runs XLA, the CPU path."""
    out = []
    if cfg.model.dtype == "bfloat16":
        out.append("model.dtype bfloat16")
    if cfg.model.nsa.attention_impl == "pallas":
        out.append("model.nsa.attention_impl pallas")
    return out


def sized_for_cpu(cfg: Config) -> bool:
    """Whether the model is no larger than the configs meant for a CPU (cpu_tiny, cpu_small)."""
    return cfg.model.d_model * cfg.model.n_layers <= CPU_SIZED_WIDTH_X_DEPTH


def _cpu_fixes(cfg: Config) -> str:
    return " ".join(_CPU_FIX[s] for s in gpu_settings(cfg))


# XLA's SlowCompilationAlarm (xla/service/slow_operation_alarm.cc): an ERROR log line of its own, after a fixed
# 2 minutes of one compile, that no XLA flag sets (TF_CPP_MIN_LOG_LEVEL=3 would hide every other error too).
SLOW_COMPILE_ALARM, SLOW_COMPILE_ALARM_MIN = "Very slow compile?", 2


def gpu_config_warning(cfg: Config, backend: str) -> str | None:
    """The boot warning for a config with settings meant for a GPU that runs on a CPU; None otherwise."""
    if backend != "cpu" or not gpu_settings(cfg):
        return None
    settings = ", ".join(gpu_settings(cfg))
    if sized_for_cpu(cfg):
        return (
            f"warning: {settings} is meant for a GPU and runs slower on a CPU; "
            f"for the CPU path run the same command with {_cpu_fixes(cfg)}"
        )
    return (
        f"warning: this config is meant for a GPU ({settings}) and runs on a CPU here: expect minutes per step "
        f'and a compile of minutes (XLA\'s "{SLOW_COMPILE_ALARM}" alarm after {SLOW_COMPILE_ALARM_MIN} minutes is '
        "expected: nothing to report); the projected time follows the first step"
    )


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
    if not sized_for_cpu(cfg):
        advice = "on a CPU train a small config (--config cpu_tiny), or run this one on a GPU"
    elif gpu:
        advice = f"on a CPU run it with {_cpu_fixes(cfg)}"
    else:
        advice = "fewer --steps take less, or run it on a GPU"
    return (
        f"warning: {fmt_duration(step_s)} a step {why}: the {count(steps_left, 'step')} left take about "
        f"{fmt_duration(total)}; {advice}"
    )


def progress_line(step: int, steps: int, loss: float, lr: float, toks_per_s: float, eta_s: float) -> str:
    """`step 40/300 | loss 3.1234 | lr 1.00e-03 | 12,345 tok/s | ETA 1m23s`."""
    return f"step {step}/{steps} | loss {loss:.4f} | lr {lr:.2e} | {toks_per_s:,.0f} tok/s | ETA {fmt_duration(eta_s)}"


# Lines that start so are remarks on the run, not its progress: they go to stderr, as launch.generate's
# and launch.report's do, so stdout carries the progress and the results alone.
REMARKS = ("warning:", "note:", "error:")


def print_flushed(msg: str) -> None:
    """One line in one write, flushed: a log gets each line when it is said, and the progress and
    signal threads never split another thread's line. Remarks (REMARKS) on stderr, the rest on stdout."""
    stream = sys.stderr if msg.startswith(REMARKS) else sys.stdout
    stream.write(msg + "\n")
    stream.flush()


class Reporter:
    """A run's output: `say` (process 0 only) and the progress thread that reports `doing` after QUIET_S of silence.

    `note()` is appended to the thread's lines (the loop's: how long the last step took).
    """

    def __init__(self, lead: bool, print_fn: Callable[[str], None] | None = None, note: Callable[[], str] = str):
        self.lead = lead
        self._print = print_fn or print_flushed
        self._note = note
        self._last_said = time.perf_counter()  # when a line was last printed (QUIET_S)
        self._muted = False  # a second stop signal: the process is quitting and says nothing more
        self._activity: tuple[str, float] | None = None  # what the progress thread reports while quiet
        # The progress thread, from boot on (a kernel guard, a restore or a first batch can take long).
        self._stop = threading.Event()
        threading.Thread(target=self._report_quiet, name="nsa-progress", daemon=True).start()

    def say(self, msg: str) -> None:
        if self.lead and not self._muted:
            self._print(msg)
            self._last_said = time.perf_counter()

    def doing(self, what: str | None) -> None:
        """What the run is doing from now on (the progress thread reports it after QUIET_S of silence)."""
        self._activity = None if what is None else (what, time.perf_counter())

    def mute(self) -> None:
        """Nothing more is printed (the process quits at a second stop signal: a step line or a stop line
        after it would promise what will not happen)."""
        self._muted = True

    def close(self) -> None:
        """Stops the progress thread."""
        self._stop.set()

    def _report_quiet(self) -> None:
        while not self._stop.wait(1.0):
            activity = self._activity
            if activity is None or time.perf_counter() - self._last_said < QUIET_S:
                continue
            what, t0 = activity
            self.say(so_far(what, time.perf_counter() - t0) + self._note())


class StepLines:
    """When the next step line is due and what it says (module docstring); one per run, from its first step."""

    def __init__(self, steps: int, log_every: int, first_step: int, tokens_per_step: int, now: float):
        self.steps, self.log_every, self.first_step, self.tokens_per_step = (
            steps,
            log_every,
            first_step,
            tokens_per_step,
        )
        self._last_line = now
        self._interval = {"t": now, "steps": 0, "step_s": 0.0}

    def after(self, step: int, step_s: float, now: float, loss: float, lr: float) -> tuple[str, float] | None:
        """Counts a finished step; (its step line, tokens/s over the interval) when one is due, else None."""
        iv = self._interval
        iv["steps"] += 1
        iv["step_s"] += step_s
        due = step % self.log_every == 0 or step in (self.steps, self.first_step)
        if not due and now - self._last_line < QUIET_S:
            return None
        # tokens/s over the interval's own step times; the ETA counts evaluations and saves too
        rate = iv["steps"] * self.tokens_per_step / max(iv["step_s"], 1e-9)
        eta = (self.steps - step) * max(now - iv["t"], 1e-9) / iv["steps"]
        self._last_line = now
        self._interval = {"t": now, "steps": 0, "step_s": 0.0}
        return progress_line(step, self.steps, loss, lr, rate, eta), rate


def signal_stop_line(name: str, step: int, save: bool, checkpoint: bool) -> str:
    """The line of a run that stops after `step` on SIGINT or SIGTERM (`save` False: received during the compile)."""
    if not save:
        said = "Ctrl-C (SIGINT)" if name == "SIGINT" else "preempted: SIGTERM"
        return f"{said} received during the compile; stopping before step {step + 1}: nothing new to save"
    then = "saving a checkpoint" if checkpoint else "no checkpoint (checkpoint.enabled=false)"
    if name == "SIGINT":
        return (
            f"Ctrl-C (SIGINT) received; stopping after step {step}; {then} (Ctrl-C again quits at once without saving)"
        )
    return f"preempted: SIGTERM received; stopping after step {step} and {then}"


def kept_note(steps: list[int]) -> str:
    """What a second stop signal leaves behind, given the complete checkpoint steps."""
    if not steps:
        return "no checkpoint was saved (the same command starts again from step 0)"
    return f"the newest checkpoint is step {steps[-1]} (the same command resumes from it)"


def stop_announcement(name: str, what: str, saves: bool) -> str:
    """`SIGINT: <what>, saves a checkpoint, and exits; Ctrl-C again quits at once without saving`."""
    again = "Ctrl-C again" if name == "SIGINT" else "a second SIGTERM"
    saving = ", saves a checkpoint," if saves else ""
    return f"{name}: {what}{saving} and exits; {again} quits at once without saving"
