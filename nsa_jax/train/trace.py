"""logging.profile_steps: jax.profiler's trace of optimizer steps A..B, per process, into <out>/traces/rank<r>/.

The trace starts before step A is dispatched and stops once step B has finished (the loop waits for
it, as for a save), so the window holds whole steps: every device of the process, compute and
collectives. `python -m launch.trace_summary OUT` turns the ranks' traces into summary.csv / .html.
A resumed run traces what is left of its window; a window already behind it is said and skipped.
"""

from __future__ import annotations

import pathlib
from typing import Callable

import jax

from nsa_jax.config_checks import profile_window


class StepTrace:
    def __init__(self, spec: str, out: pathlib.Path, rank: int, start_step: int, say: Callable, event: Callable):
        self.out, self.folder = out, out / "traces" / f"rank{rank}"
        self.say, self.event, self.active = say, event, False
        window = profile_window(spec) or None
        if window and window[1] <= start_step:
            say(
                f"profile: steps {window[0]}-{window[1]} are behind this run "
                f"(it resumes after step {start_step}): no trace"
            )
            window = None
        elif window and window[0] <= start_step:
            say(f"profile: resuming after step {start_step}: tracing steps {start_step + 1}-{window[1]}")
            window = (start_step + 1, window[1])
        self.window = window

    def starts_at(self, step: int) -> bool:
        return self.window is not None and step == self.window[0] and not self.active

    def ends_at(self, step: int) -> bool:
        return self.active and step == self.window[1]

    def start(self, step: int) -> None:
        """Starts the trace before `step`; a folder that cannot be written costs the trace, not the run."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.folder), create_perfetto_trace=True)
        except (OSError, RuntimeError) as e:
            self.say(f"warning: profile: cannot trace into {self.folder} ({e}); training goes on untraced")
            self.window = None
            return
        self.active = True
        self.event("profile_start", step, f"tracing steps {step}-{self.window[1]} into {self.folder}")

    def stop(self, step: int) -> None:
        """Ends the trace after `step` (also when the run stops inside the window)."""
        if not self.active:
            return
        self.active = False
        try:
            jax.profiler.stop_trace()
        except (OSError, RuntimeError) as e:  # the trace is lost (a full disk, say); the run is not
            self.say(f"warning: profile: the trace of steps {self.window[0]}-{step} could not be written ({e})")
            return
        self.event(
            "profile_stop", step, f"trace of steps {self.window[0]}-{step} in {self.folder}", path=str(self.folder)
        )
        self.say(
            f"profile: steps {self.window[0]}-{step} traced in {self.folder}; summary: "
            f"python -m launch.trace_summary {self.out}"
        )
