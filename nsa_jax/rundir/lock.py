"""One trainer per out_dir: an exclusive lock held for the whole run; no jax.

`acquire(out_dir, command)` takes an exclusive `flock` on `<out_dir>/.lock` and keeps the file open until
the process exits; the kernel drops the lock when the process dies, however it dies (exit, crash,
SIGKILL, reboot), so no stale lock survives and nothing ever has to delete it. The holder writes who it
is into the file (pid, host, UTC start time, command line); a second trainer that finds the lock taken
reads that and stops with `OutDirLocked`, one line naming the holder and what to do instead, having
written nothing: it opens the existing file read-only, and a missing file means there is no holder to
wait for.

Multi-process runs lock once, in process 0 (launch/train.py). Readers (launch.report, launch.generate,
launch.watchdog) never take the lock. A file system that refuses the lock (ENOLCK, EOPNOTSUPP) is a
warning, not an error: the run goes on unlocked. Which file systems hold the lock, and across hosts
(local ones; NFS when its server supports locking; not a `nolock` mount or some FUSE and object-store
mounts): docs/RUNBOOK.md, "Restarts and the compilation cache".
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import pathlib
import socket
import sys
import time

from nsa_jax.config import ConfigError
from nsa_jax.rundir import resume

LOCK_FILE = ".lock"

_held: dict[str, int] = {}  # lock file path -> the open descriptor holding it (closed at exit)
_created: dict[str, bool] = {}  # lock file path this process created -> whether it created the folder too


class OutDirLocked(ConfigError):
    """Another live process holds the out_dir's lock; one line naming it and the fix."""


def holder(out_dir: str | os.PathLike) -> dict | None:
    """The holder recorded in the lock file (pid, host, started, command), None when unreadable."""
    path = pathlib.Path(out_dir) / LOCK_FILE
    # The holder writes its record right after taking the lock: a reader that comes in
    # between sees an empty file for a moment.
    for _ in range(20):
        try:
            text = path.read_text()
        except OSError:
            return None
        if text.strip():
            try:
                data = json.loads(text)
            except ValueError:
                data = None
            return data if isinstance(data, dict) else None
        time.sleep(0.02)
    return None


def _refusal(out: pathlib.Path) -> OutDirLocked:
    h = holder(out) or {}
    pid, host = h.get("pid", "?"), h.get("host", "?")
    who = f"pid {pid} on {host}, started {h.get('started', '?')}"
    if h.get("command"):
        who += f": {h['command']}"
    return OutDirLocked(
        f"{out} is in use by another trainer ({who}); choose another directory with --out-dir, or stop that run "
        f"first (kill -TERM {pid} on {host} saves a checkpoint and exits) and run this command again to resume"
    )


def acquire(out_dir: str | os.PathLike, command: str = "") -> bool:
    """Locks `out_dir` for this process's lifetime; True when locked, False when the file
    system refuses locks (a warning is printed). OutDirLocked when another process holds it;
    OSError when the folder cannot be created or the lock file written."""
    out = pathlib.Path(out_dir)
    path = out / LOCK_FILE
    key = os.path.realpath(path)
    if key in _held:
        return True  # this process holds it already (flock would refuse a second descriptor)
    try:
        # An existing lock file is opened without creating or changing anything, so a
        # refused launch leaves the folder exactly as it found it.
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        try:
            new_dir = not out.exists()
            out.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            _created[key] = new_dir
        except OSError:
            resume.check_writable(out)  # raises OutDirError naming the cause
            raise
    except OSError:
        resume.check_writable(out)
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        _created.pop(key, None)
        raise _refusal(out) from None
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            print(
                f"warning: the file system of {out} does not support locks ({e.strerror}); nothing stops a second "
                "trainer from using this out_dir at the same time - make sure only one does",
                file=sys.stderr,
                flush=True,
            )
            return False
        raise
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": command,
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    _held[os.path.realpath(path)] = fd  # never closed here: closing would release the lock
    return True


def discard_created(out_dir: str | os.PathLike) -> None:
    """A run refused after it locked `out_dir` (a bad setting found once jax started): the lock file this
    process created goes, and the folder too when this process created it and nothing else is in it, so
    the refusal leaves no new folder behind. The lock is released with it (the process is ending)."""
    out = pathlib.Path(out_dir)
    key = os.path.realpath(out / LOCK_FILE)
    if key not in _created:
        return
    new_dir = _created.pop(key)
    fd = _held.pop(key, None)
    try:
        os.unlink(key)
        if new_dir:
            out.rmdir()  # only when empty: what the refused attempt wrote stays
    except OSError:
        pass
    if fd is not None:
        os.close(fd)


def release_all() -> None:
    """Drops every lock this process holds (tests; a trainer keeps its lock until it exits)."""
    _created.clear()
    while _held:
        os.close(_held.popitem()[1])
