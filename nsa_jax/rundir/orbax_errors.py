"""What a failed checkpoint save says: orbax's background errors as one line.

A save that fails in the background (disk full, permission) is raised by orbax from
its writer threads with a traceback per layer it passes through, and the writes of
that save still in flight end later on an event loop orbax has closed, each printing
`Event loop is closed`; asyncio logs the failed writes nobody awaited. Here:
`OrbaxErrorTrap` keeps the errors orbax logs instead of printing them,
`silence_closed_loop_callbacks` drops the closed-loop and unretrieved-write tracebacks
(process-wide), and `save_failure_cause` names the cause in one line (`disk full
(OSError: [Errno 28] ...)`), so a full disk reads as the one line that says so
(checkpoint.py CheckpointSaveError).
"""

from __future__ import annotations

import errno
import logging
import re
import sys
import traceback

from nsa_jax.rundir.resume import TMP_MARKER


class OrbaxErrorTrap(logging.Filter):
    """Keeps the errors orbax logs from its save threads and drops their tracebacks from the output.

    A failed background save is logged by orbax (absl logging) with a traceback per
    layer it passes through, hundreds of lines; the Checkpointer reports it as one
    line instead (CheckpointSaveError), so those records are kept here, not printed.
    """

    def __init__(self):
        super().__init__()
        self.errors: list[BaseException] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None and "orbax" in (record.pathname or ""):
            self.errors.append(record.exc_info[1])
            return False
        return True


def is_closed_loop_callback(exc: BaseException | None, tb) -> bool:
    """A write of a failed save finishing after orbax closed that save's event loop.

    orbax runs a save's writes as one asyncio.gather on a loop of its own and closes
    the loop as soon as the first write fails (a full disk); the writes still in flight
    in tensorstore finish afterwards, and each one's completion callback then raises
    `RuntimeError: Event loop is closed` from `call_soon_threadsafe`, printed as a
    traceback (hundreds on a large state). Nothing is lost: the failure itself is
    reported once, as a CheckpointSaveError.
    """
    if not isinstance(exc, RuntimeError) or str(exc) != "Event loop is closed":
        return False
    frames = [f.f_code.co_name for f, _ in traceback.walk_tb(tb)]
    return bool(frames) and frames[0] == "call_soon_threadsafe"


# asyncio's words for a task or future (Task, Future, _GatheringFuture, ...) whose exception nobody awaited.
_UNRETRIEVED = re.compile(r"\w+ exception was never retrieved")


def _is_unretrieved_orbax_write(record: logging.LogRecord) -> bool:
    """asyncio's report of a failed orbax write whose exception nobody awaited.

    When several writes of a save fail (a full disk fails them all), orbax's gather
    raises the first and leaves the others unretrieved; asyncio logs each one when its
    task or future (a gather's own future too) is collected, which can be after the manager is closed: a task's
    with a traceback through orbax's code, a future's (tensorstore's write, set without
    a traceback) with an error naming the save's temporary directory. The failure itself
    is reported once, as a CheckpointSaveError.
    """
    if not _UNRETRIEVED.match(record.getMessage()):
        return False
    exc = record.exc_info[1] if record.exc_info else None
    if exc is None:
        return False
    if TMP_MARKER in str(exc):  # orbax writes a save under <step>.orbax-checkpoint-tmp, then renames it
        return True
    return any("orbax" in f.f_code.co_filename for f, _ in traceback.walk_tb(exc.__traceback__))


class _UnretrievedWriteFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not _is_unretrieved_orbax_write(record)


def silence_closed_loop_callbacks() -> None:
    """Drops the tracebacks of `is_closed_loop_callback` and `_is_unretrieved_orbax_write`
    (process-wide, idempotent): they are printed through sys.excepthook (a callback error
    inside tensorstore), sys.unraisablehook or the asyncio logger, and can arrive until the
    process exits, after the manager is closed."""
    if getattr(sys.excepthook, "_nsa_quiet", False):
        return
    logging.getLogger("asyncio").addFilter(_UnretrievedWriteFilter())
    prev_except, prev_unraisable = sys.excepthook, sys.unraisablehook

    def excepthook(kind, exc, tb):
        if not is_closed_loop_callback(exc, tb):
            prev_except(kind, exc, tb)

    def unraisablehook(u):
        if not is_closed_loop_callback(u.exc_value, u.exc_traceback):
            prev_unraisable(u)

    excepthook._nsa_quiet = True
    sys.excepthook, sys.unraisablehook = excepthook, unraisablehook


_ERRNO_CAUSES = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only file system",
    errno.EIO: "I/O error",
}
_TEXT_CAUSES = {
    "No space left on device": "disk full",
    "Disk quota exceeded": "disk quota exceeded",
    "Permission denied": "permission denied",
    "Read-only file system": "read-only file system",
}


def _chain(e: BaseException | None):
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        for inner in getattr(e, "exceptions", ()):  # ExceptionGroup of asyncio.gather
            yield from _chain(inner)
        e = e.__cause__ or e.__context__


def save_failure_cause(e: BaseException) -> str:
    """One line: 'disk full (OSError: [Errno 28] No space left on device: ...)' and the like."""
    for x in _chain(e):
        if isinstance(x, OSError) and x.errno in _ERRNO_CAUSES:
            return f"{_ERRNO_CAUSES[x.errno]} ({one_line(x)})"
    for x in _chain(e):
        for text, cause in _TEXT_CAUSES.items():
            if text in str(x):
                return f"{cause} ({one_line(x)})"
    return one_line(e)


def one_line(e: BaseException) -> str:
    """`Type: the first line of the message` (at most 300 characters of it)."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__
