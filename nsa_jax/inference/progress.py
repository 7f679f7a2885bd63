"""Lines on stderr while a long call works, so a command is never silent for long.

A prefill is one compiled call: nothing inside it can report how far it got, and a
long prompt on a CPU takes minutes. `Progress` runs a thread that, when nothing was
printed for `quiet_s` seconds while an activity is under way (then every `repeat_s`; 10 s both),
prints what is being done and for how long (`prefill of 61,440 prompt tokens: 30s so
far`). An activity that was reported ends with one line giving its time; one that
ended within `quiet_s` prints nothing, so short commands stay quiet.

    with Progress() as progress:
        progress.doing("prefill of 61,440 prompt tokens")
        ...
        progress.done()          # 'prefill of 61,440 prompt tokens: done in 1m02s' if reported
        progress.doing(lambda: f"decoding: {k} of 128 tokens")   # a callable: read at each line
        progress.touch()         # something else was just printed (a streamed token)
        progress.emit("note: ...")   # a line of the command's own, through the same output
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable

from nsa_jax.progress_text import fmt_duration, so_far

# Seconds of silence after which a line says what is going on, then between the lines of
# the same activity: every 10 s, as the README and launch.generate's --help say.
QUIET_S = 10.0
REPEAT_S = 10.0

What = str | Callable[[], str]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Progress:
    """Reports the current activity after `quiet_s` seconds of silence, then every `repeat_s` while it lasts."""

    def __init__(
        self, say: Callable[[str], None] | None = None, quiet_s: float | None = None, repeat_s: float | None = None
    ):
        self.say = say or _stderr
        self.quiet_s = QUIET_S if quiet_s is None else quiet_s
        self.repeat_s = REPEAT_S if repeat_s is None else repeat_s
        self._lock = threading.Lock()
        self._what: What | None = None
        self._count: tuple[float, str] | None = None
        self._t0 = self._last = time.perf_counter()
        self._reported = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "Progress":
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if exc[0] is None:
            self.done()

    def doing(self, what: What, count: tuple[float, str] | None = None) -> None:
        """From now on the command is doing `what` (a previous activity ends first).

        `count` (amount, unit), e.g. (61440, "tokens"): the done line gives the rate.
        """
        self.done()
        with self._lock:
            self._what, self._count, self._t0, self._reported = what, count, time.perf_counter(), False

    def done(self) -> float | None:
        """Ends the current activity; its seconds, or None when there was none.

        Prints '<what>: done in <time>' (with the rate where a count was given) when the
        activity was reported while it ran.
        """
        with self._lock:
            what, t0, reported = self._what, self._t0, self._reported
            self._what = None
            if what is None:
                return None
            seconds = time.perf_counter() - t0
            if reported:
                rate = f" ({self._count[0] / seconds:,.0f} {self._count[1]}/s)" if self._count and seconds > 0 else ""
                self._print(f"{_text(what)}: done in {fmt_duration(seconds)}{rate}")
            return seconds

    def touch(self) -> None:
        """Something was just printed by the command itself: the silence starts again."""
        self._last = time.perf_counter()

    def emit(self, msg: str) -> None:
        """Prints a line of the command's own through `say` (the silence starts again)."""
        with self._lock:
            self._print(msg)

    def _print(self, msg: str) -> None:
        self.say(msg)
        self._last = time.perf_counter()

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, self.quiet_s / 4)):
            with self._lock:
                now = time.perf_counter()
                # Silence counts from the last line or the start of the activity, whichever is later.
                wait = self.repeat_s if self._reported else self.quiet_s
                if self._what is None or now - max(self._last, self._t0) < wait:
                    continue
                self._reported = True
                self._print(so_far(_text(self._what), now - self._t0))


def _text(what: What) -> str:
    return what() if callable(what) else what
