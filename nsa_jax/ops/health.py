"""In-process run health: stack dumps, the stall watchdog, and halt agreement.

Stack dumps: `<out>/stackdump_<ts>_rank<r>.txt`, every thread's Python stack with its name. SIGUSR1 asks
for one and training goes on. The dump is written by a helper thread that `signal.set_wakeup_fd` wakes, so
it is written even while the main thread is blocked in a device wait or a collective, which is when one is
wanted: a plain Python signal handler would run only once the main thread returns to Python.

Stall watchdog (`ops.stall_seconds` > 0): a daemon thread. When no training step ends within stall_seconds
it writes a dump, a `watchdog_dump` heartbeat and one line on stderr, then ends the process with
`os._exit(STALL_EXIT_CODE)`, not an exception: the main thread may be stuck in a collective that never
returns, and exit handlers may block on the same device. The non-zero exit lets a scheduler restart the
job from its last checkpoint.

Halts: `write_halt` (nsa_jax/rundir/files.py) writes `.anomaly_type` and `.HALT` (the trainer and
launch.watchdog share the format); `halt_requested` is the trainer's check for `.HALT`, agreed across
processes (nsa_jax/agreement.py), so all of them stop at the same step. Fatal signals (SIGSEGV, SIGABRT,
...) print every thread's stack to stderr through faulthandler once `Health.start` has run.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import pathlib
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable

import jax

from nsa_jax.agreement import agree_any
from nsa_jax.ops.wakeup import WakeupReader
from nsa_jax.rundir import files as rf
from nsa_jax.rundir.files import HALT_FILE

# EX_TEMPFAIL: a temporary failure, worth retrying; distinct from a crash (1) or bad input (2).
STALL_EXIT_CODE = rf.EXIT_STALL


def _noop_handler(signum, frame) -> None:
    """Python-level SIGUSR1 handler: the dump thread does the work (see the module docstring)."""


def format_stacks(header: str) -> str:
    """`header`, then each live thread's name and Python stack, the main thread first."""
    frames = sys._current_frames()
    threads = {t.ident: t for t in threading.enumerate()}
    me = threading.get_ident()
    order = sorted(frames, key=lambda ident: (ident != threading.main_thread().ident, ident))
    lines = [header.rstrip("\n"), f"threads: {len(frames)}", ""]
    for ident in order:
        t = threads.get(ident)
        name = t.name if t is not None else "<not started by threading>"
        tags = [f"ident {ident}"]
        if t is not None and t.daemon:
            tags.append("daemon")
        if ident == me:
            tags.append("this thread wrote the dump")
        lines.append(f"--- thread {name} ({', '.join(tags)}) ---")
        lines.extend(s.rstrip("\n") for s in traceback.format_stack(frames[ident]))
        lines.append("")
    return "\n".join(lines) + "\n"


def _timestamp() -> str:
    now = datetime.datetime.now(datetime.timezone.utc)
    return now.strftime("%Y%m%dT%H%M%S") + f".{now.microsecond // 1000:03d}Z"


def write_stack_dump(
    out_dir: str | os.PathLike, reason: str, *, rank: int = 0, step: int | None = None
) -> pathlib.Path:
    """Writes `<out_dir>/stackdump_<ts>_rank<rank>.txt` and returns its path."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"stackdump_{_timestamp()}_rank{rank}"
    path, n = out / f"{stem}.txt", 1
    while path.exists():
        n += 1
        path = out / f"{stem}-{n}.txt"
    header = (
        f"stack dump: {reason}\n"
        f"time: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='milliseconds')}  "
        f"pid: {os.getpid()}  rank: {rank}  last finished step: {step}"
    )
    text = format_stacks(header)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # a reader never sees half a dump
    return path


def halt_requested(out_dir: str | os.PathLike, step: int, every: int) -> bool:
    """<out_dir>/.HALT present; with several processes agreed every `every` steps, so all stop together."""
    if jax.process_count() == 1:
        return (pathlib.Path(out_dir) / HALT_FILE).exists()
    if step % every:
        return False
    return agree_any((pathlib.Path(out_dir) / HALT_FILE).exists())


class Health:
    """The stall watchdog and SIGUSR1 dumps of one process; `start()` ... `close()`.

    event(name, step, msg, **fields) writes a heartbeat; the loop calls
    `step_ended(step)` after each finished step and may wrap known long pauses
    (a checkpoint save) in `with health.paused():`.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        *,
        rank: int = 0,
        stall_seconds: float = 0.0,
        sigusr1: bool = True,
        event: Callable[..., Any] | None = None,
        exit_fn: Callable[[int], Any] = os._exit,
    ):
        self.out = pathlib.Path(out_dir)
        self.rank = rank
        self.stall_seconds = float(stall_seconds)
        self.sigusr1 = sigusr1
        self._event = event
        self._exit = exit_fn
        self.step = 0  # last finished step
        self._last = time.monotonic()
        self._paused = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one dump at a time
        self._threads: list[threading.Thread] = []
        self._wakeup: WakeupReader | None = None
        self._prev_handler: Any = None
        self._faulthandler_enabled = False
        self.dumps: list[pathlib.Path] = []
        self.notes: list[str] = []

    # -- lifecycle --------------------------------------------------------------

    def start(self) -> "Health":
        if not faulthandler.is_enabled():
            faulthandler.enable(all_threads=True)
            self._faulthandler_enabled = True
        if self.sigusr1 and hasattr(signal, "SIGUSR1"):
            self._install_sigusr1()
        self._last = time.monotonic()
        if self.stall_seconds > 0:
            self._spawn(self._watch, "nsa-stall-watchdog")
        return self

    def close(self) -> None:
        self._stop.set()
        if self._wakeup is not None:
            wakeup, self._wakeup = self._wakeup, None
            try:
                wakeup.stop()  # ends the dump thread whatever happens to the fd's owner
                signal.signal(signal.SIGUSR1, self._prev_handler)
            except ValueError:  # not the main thread; the process is ending anyway
                pass
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=2.0)
        if self._faulthandler_enabled:
            faulthandler.disable()
            self._faulthandler_enabled = False

    def __enter__(self) -> "Health":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- called by the loop -------------------------------------------------------

    def step_ended(self, step: int) -> None:
        self.step = int(step)
        self._last = time.monotonic()

    @contextlib.contextmanager
    def paused(self):
        """The stall clock stops inside, and restarts from zero after."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self._last = time.monotonic()

    def dump(self, reason: str) -> pathlib.Path:
        with self._lock:
            path = write_stack_dump(self.out, reason, rank=self.rank, step=self.step)
            self.dumps.append(path)
        return path

    # -- internals ----------------------------------------------------------------

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _emit(self, *args: Any, **fields: Any) -> None:
        if self._event is None:
            return
        try:
            self._event(*args, **fields)
        except Exception as e:  # noqa: BLE001 - a dump must not fail on a closed heartbeat
            print(f"health: heartbeat not written ({e})", file=sys.stderr, flush=True)

    def _install_sigusr1(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            # signal handlers and the wakeup fd belong to the main thread (e.g. a Trainer in a worker thread).
            self.notes.append("SIGUSR1 dumps off: not started from the main thread")
            return
        self._prev_handler = signal.signal(signal.SIGUSR1, _noop_handler)
        self._wakeup = WakeupReader((signal.SIGUSR1,), self._on_sigusr1, "nsa-sigusr1-dump")
        self._wakeup.start()
        self._threads.append(self._wakeup.thread)

    def _on_sigusr1(self, numbers: list[int]) -> bool:
        """The dump thread's work: one dump for the SIGUSR1s of one read; training goes on."""
        path = self.dump("SIGUSR1 (training continues)")
        self._emit("watchdog_dump", self.step, f"SIGUSR1: stacks in {path.name}", reason="sigusr1", path=str(path))
        print(f"health: SIGUSR1: wrote {path}", file=sys.stderr, flush=True)
        return True

    def _watch(self) -> None:
        period = min(1.0, max(0.05, self.stall_seconds / 10))
        while not self._stop.wait(period):
            if self._paused:
                continue
            idle = time.monotonic() - self._last
            if idle >= self.stall_seconds:
                self._fire(idle)
                return

    def _fire(self, idle: float) -> None:
        reason = f"stall: no training step ended for {idle:.0f}s (ops.stall_seconds={self.stall_seconds:g})"
        path = self.dump(reason)
        self._emit(
            "watchdog_dump",
            self.step,
            f"{reason}; stacks in {path.name}",
            reason="stall",
            path=str(path),
            idle_s=idle,
            stall_seconds=self.stall_seconds,
        )
        print(
            f"watchdog: {reason} after step {self.step}; stacks of every thread in {path}; "
            f"exiting with status {STALL_EXIT_CODE} so the job can be restarted",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        self._exit(STALL_EXIT_CODE)
