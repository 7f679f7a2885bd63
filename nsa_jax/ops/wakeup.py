"""Signals seen by a thread: the `signal.set_wakeup_fd` pipe that Ctrl-C, SIGTERM and SIGUSR1 share.

A Python signal handler runs only when the main thread returns to Python, which it
does not while it waits on a device, a collective or a compile: exactly when a stop
or a stack dump is wanted. The interpreter also writes each signal's number to the
wakeup fd at once, so a daemon thread reading that pipe acts in time
(nsa_jax/ops/preemption.py for SIGTERM/SIGINT, nsa_jax/ops/health.py for SIGUSR1;
each still installs a Python handler, without which the signal keeps its default
action). The wakeup fd is one per process: `WakeupReader` passes the signals it does
not own on to the fd it replaced, and gives that fd back when it stops.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Callable


class WakeupReader:
    """Takes the wakeup fd and calls `on_signals(numbers)` from a daemon thread for the `signals` it owns.

    `on_signals` gets the numbers of one read, in order; it returns False to stop
    reading. `start` and `stop` belong to the main thread (signal.set_wakeup_fd's rule).
    """

    def __init__(self, signals: tuple[int, ...], on_signals: Callable[[list[int]], bool], name: str):
        self.signals = frozenset(int(s) for s in signals)
        self.on_signals = on_signals
        self.name = name
        self.thread: threading.Thread | None = None
        self._prev = -1
        self._w: int | None = None

    def start(self) -> None:
        r, w = os.pipe()
        os.set_blocking(w, False)  # a full pipe drops a byte rather than blocking the handler
        self._prev = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self._w = w
        self.thread = threading.Thread(target=self._read, args=(r,), name=self.name, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Gives the former wakeup fd back (unless another owner replaced ours meanwhile) and ends the thread."""
        w, self._w = self._w, None
        if w is None:
            return
        try:
            current = signal.set_wakeup_fd(self._prev)
            if current != w:  # someone replaced ours meanwhile: leave theirs in place
                signal.set_wakeup_fd(current)
        finally:
            os.close(w)  # EOF ends the reader, which closes r

    def _read(self, r: int) -> None:
        try:
            while data := os.read(r, 64):
                others = bytes(b for b in data if b not in self.signals)
                if others and self._prev >= 0:
                    try:  # the wakeup fd is process-wide: pass other signals on to its former owner
                        os.write(self._prev, others)
                    except OSError:
                        pass
                mine = [b for b in data if b in self.signals]
                if mine and not self.on_signals(mine):
                    return
        finally:
            os.close(r)
