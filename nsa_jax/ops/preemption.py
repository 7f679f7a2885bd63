"""Preemption and Ctrl-C: SIGTERM or SIGINT -> a stop at a step boundary that every process agrees on.

`PreemptionGuard` turns either signal into a flag; the loop (nsa_jax/train/loop.py)
stops at the next step boundary, saves, and the launcher exits 0 (SIGTERM) or 130
(SIGINT). With several processes the flag is OR-reduced across them with one small
all-reduce per step that is read one step later, so every process stops after the
same step without the loop ever waiting for it. A second signal ends the process at
once (by that signal, after one line on stderr): a save in flight is left under its
temporary name, so the newest committed checkpoint stays the one a resume reads, and the
line names that step, read just before the exit (a save that commits while the output is
flushed counts). From that signal on the run says nothing more (`on_abort`).

`QuitOnSignal` is the same two signals for a command that keeps each finished piece
of work as it goes (launch.evaluate): the work in flight belongs to nothing kept, so
the first signal ends the process at once, with one line saying what was kept and
how to go on, and the status a training run gives (0 after SIGTERM, 130 after Ctrl-C).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nsa_jax.ops.wakeup import WakeupReader


def _flush_stdout() -> None:
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 - closed or broken: nothing more to save
        pass


class PreemptionGuard:
    """SIGTERM or SIGINT -> stop at a step boundary that every process agrees on.

    `stop_requested()` is called once per step boundary by every process. With one
    process it is the local flag. With several, each call reads the OR of the flags
    posted at the previous boundary (an all-reduce queued behind the previous step,
    finished by the time it is read) and posts the current flag, so all processes
    see the same answer at the same boundary, one step after the signal at most.

    The signals are seen by a helper thread woken through `signal.set_wakeup_fd`
    (nsa_jax/ops/wakeup.py), so they act while the main thread is blocked in
    a device wait or a compile, where a Python handler would run only once it returns.
    The first signal sets the flag (and `signal_name`) and, a second later,
    prints the line `on_first(name)` returns (what the run does now; empty when the loop
    has said it already); a second one (either kind) calls `on_abort()` (the run goes
    quiet), flushes what was printed, writes one line to stderr (`abort_note()`, called
    last, adds what is kept) and ends the process at once with status 128 + the signal
    number (130 for Ctrl-C): no traceback, and nothing that could wait on a step or a
    save. Without the helper thread (a guard installed outside the main thread) the
    signals keep their default action.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    ANNOUNCE_AFTER_S = 1.0

    def __init__(
        self,
        mesh=None,
        *,
        on_first: Callable[[str], str] | None = None,
        abort_note: Callable[[], str] | None = None,
        on_abort: Callable[[], None] | None = None,
        exit_fn: Callable[[int], Any] = os._exit,
    ):
        self.mesh = mesh
        self.requested = False
        self.signal_name: str | None = None
        self.on_first = on_first
        self.abort_note = abort_note
        self.on_abort = on_abort
        self.aborting = False  # a second signal came: the process is quitting
        self._exit = exit_fn
        self._prev_handlers: dict[int, Any] = {}
        self._wakeup = WakeupReader(self.SIGNALS, self._on_signals, "nsa-stop-signals")
        self._seen = 0  # stop signals the reader thread saw
        self._installed = False
        self._posted = None
        self._reduce = None
        self.posted_stop = False  # a stop flag was posted to the other processes (read at the next boundary)

    def install(self) -> None:
        # Signal handlers and the wakeup fd belong to the main thread.
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self.SIGNALS:
            self._prev_handlers[sig] = signal.signal(sig, self._on_signal)
        self._seen = 0  # a guard installed again counts afresh, as each reader thread did
        self._wakeup.start()
        self._installed = True

    def uninstall(self) -> None:
        """Gives the signals back; after a stop signal, a later one still quits at once and quietly.

        A run stopped by the first signal tears down (saves, joins writer threads) after
        this; a second signal arriving then, from a hand or a scheduler's escalation,
        must not become a KeyboardInterrupt traceback in the interpreter's shutdown.
        """
        if not self._installed:
            return
        self._installed = False
        for sig, prev in self._prev_handlers.items():
            if self.requested:
                signal.signal(sig, lambda signum, frame: self._abort(signum))
            else:
                signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._wakeup.stop()

    def _on_signal(self, signum, frame) -> None:
        """The Python-level handler: the reader thread does the work (it may not have run yet)."""
        self._first(signum)

    def _first(self, signum: int) -> bool:
        """Records the first stop signal; False when one was recorded already."""
        if self.requested:
            return False
        self.requested = True
        self.signal_name = signal.Signals(signum).name
        return True

    def _on_signals(self, numbers: list[int]) -> bool:
        """The reader thread's work: the first stop signal sets the flag, a second one ends the process."""
        for signum in numbers:
            self._seen += 1
            if self._seen == 1:
                self._first(signum)
                # After a moment, so a loop that acts on the flag at once says it first
                # (on_first then has nothing to add).
                announce = threading.Timer(self.ANNOUNCE_AFTER_S, self._say_first, args=(signum,))
                announce.daemon = True
                announce.start()
            else:
                self._abort(signum)
                return False
        return True

    def _say_first(self, signum: int) -> None:
        name = signal.Signals(signum).name
        what = ""
        if self.on_first is not None:
            try:
                what = self.on_first(name)
            except Exception:  # noqa: BLE001 - the stop must not depend on it
                what = ""
        if what and not self.aborting:  # one write: the line is not split by another thread's
            sys.stdout.write(what + "\n")
            sys.stdout.flush()

    def _abort(self, signum: int) -> None:
        self.aborting = True
        if self.on_abort is not None:
            try:
                self.on_abort()  # nothing more is said: no line may promise a save that will not happen
            except Exception:  # noqa: BLE001 - the exit must not depend on it
                pass
        # What was printed so far is flushed, in a thread given a second: a stdout that blocks
        # (a full pipe) must not keep the process alive.
        flush = threading.Thread(target=_flush_stdout, daemon=True)
        flush.start()
        flush.join(1.0)
        # Read last, just before the exit: the step it names is the one a restart resumes from,
        # even when a save in flight committed during the flush.
        note = ""
        if self.abort_note is not None:
            try:
                note = self.abort_note()
            except Exception:  # noqa: BLE001 - the exit must not depend on it
                note = ""
        name = signal.Signals(signum).name
        line = f"{name} again: quitting now without saving" + (f"; {note}" if note else "") + "\n"
        try:
            os.write(2, line.encode())
        except OSError:
            pass
        self._exit(128 + signum)

    @property
    def agrees_late(self) -> bool:
        """Several processes: a stop is agreed one step boundary after the boundary that posts it."""
        return self.mesh is not None and jax.process_count() > 1

    def stop_requested(self) -> bool:

        if jax.process_count() == 1 or self.mesh is None:
            return self.requested
        agreed = False
        if self._posted is not None:
            agreed = bool(np.asarray(self._posted.addressable_data(0)))
        if not agreed:
            flag = self.requested
            self._posted = self._post(flag)
            self.posted_stop = self.posted_stop or flag
        return agreed

    def _post(self, flag: bool):

        mesh = self.mesh
        if self._reduce is None:
            self._reduce = jax.jit(jnp.max, out_shardings=NamedSharding(mesh, P()))
        local = np.full((mesh.local_mesh.size,), int(flag), np.int32)
        # One flag per device, over every mesh axis (data x seq): each process gives its devices' own.
        every = NamedSharding(mesh, P(tuple(mesh.axis_names)))
        flags = jax.make_array_from_process_local_data(every, local, (mesh.size,))
        return self._reduce(flags)


class QuitOnSignal:
    """SIGTERM or SIGINT -> `say(line(name))` and the end of the process: status 0 (SIGTERM) or 130 (SIGINT).

    Seen by a WakeupReader thread, so it acts while the main thread waits on a device or
    a compile. The first signal runs `line` in a thread of its own (it may wait a moment:
    a command takes the lock its writes hold, so the line names what is on disk); a second
    one while that runs ends the process at once with 128 + its number, as training's
    second signal does. Only the main thread installs it (without it the signals keep
    their default action).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    STATUS = {signal.SIGTERM: 0, signal.SIGINT: 128 + signal.SIGINT}

    def __init__(
        self,
        line: Callable[[str], str],
        say: Callable[[str], None] | None = None,
        exit_fn: Callable[[int], Any] | None = None,
    ):
        self.line = line
        self.say = say or (lambda msg: os.write(2, (msg + "\n").encode()))
        self._exit = exit_fn or os._exit
        self._prev: dict[int, Any] = {}
        self._wakeup = WakeupReader(self.SIGNALS, self._on_signals, "nsa-quit-signals")
        self._seen = 0
        self._installed = False

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self.SIGNALS:
            # The reader thread acts; the Python handler only keeps the default action (and
            # KeyboardInterrupt) away from the main thread.
            self._prev[sig] = signal.signal(sig, lambda signum, frame: None)
        self._seen = 0
        self._wakeup.start()
        self._installed = True

    def uninstall(self) -> None:
        if not self._installed:
            return
        self._installed = False
        for sig, prev in self._prev.items():
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._wakeup.stop()

    def _on_signals(self, numbers: list[int]) -> bool:
        for signum in numbers:
            self._seen += 1
            if self._seen == 1:
                threading.Thread(target=self._quit, args=(signum,), name="nsa-quit", daemon=True).start()
            else:
                name = signal.Signals(signum).name
                self._end(f"{name} again: quitting now", 128 + signum)
                return False
        return True

    def _quit(self, signum: int) -> None:
        name = signal.Signals(signum).name
        try:
            text = self.line(name)
        except Exception as e:  # noqa: BLE001 - the stop must not depend on it
            text = f"{name}: stopping ({type(e).__name__} while saying what was kept: {e})"
        self._end(text, self.STATUS[signal.Signals(signum)])

    def _end(self, text: str, status: int) -> None:
        # What was printed so far is flushed, in a thread given a second: a stdout that blocks
        # (a full pipe) must not keep the process alive.
        flush = threading.Thread(target=_flush_stdout, daemon=True)
        flush.start()
        flush.join(1.0)
        try:
            self.say(text)
        except Exception:  # noqa: BLE001 - the exit must not depend on it
            pass
        self._exit(status)
