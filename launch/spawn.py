"""`python -m launch.spawn --nproc N [--port P] [--grace S] -- COMMAND ...`: N local processes.

The local counterpart of `torchrun --nproc_per_node`: starts COMMAND N times with
JAX_COORDINATOR_ADDRESS (a free loopback port unless --port), JAX_NUM_PROCESSES and
JAX_PROCESS_ID set, which launch.train reads (nsa_jax/ops/distributed.py). On one
GPU host a single process already drives every GPU, so N > 1 is for CPU tests of
the multi-process paths and for emulating several hosts on one machine.

- Each child's stdout and stderr lines are printed on ours, prefixed `[rank] `.
- SIGINT and SIGTERM are forwarded to every child (each runs in its own process
  group, so a terminal's Ctrl-C reaches them once, through here).
- When a child exits non-zero the others get SIGTERM, then SIGKILL after --grace
  seconds (a peer left alone would wait in a collective forever), and spawn exits
  with the first failing child's status (128 + N for a child killed by signal N).
  If spawn itself dies, the children get SIGTERM (Linux parent-death signal).
- After a SIGINT or SIGTERM it forwarded, spawn exits 0 when every child exited 0 (launch.train
  saves and exits 0 on SIGTERM), else with the first non-zero child status (130 after Ctrl-C).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from nsa_jax.words import count

_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the coordinator binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def child_env(base: dict[str, str], rank: int, nproc: int, coordinator: str) -> dict[str, str]:
    env = dict(base)
    env.update(
        JAX_COORDINATOR_ADDRESS=coordinator,
        JAX_NUM_PROCESSES=str(nproc),
        JAX_PROCESS_ID=str(rank),
        PYTHONUNBUFFERED="1",
    )
    return env


def exit_status(returncode: int) -> int:
    """Popen's -N (killed by signal N) -> the shell's 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def _child_setup() -> None:
    os.setpgid(0, 0)
    try:  # Linux: the child gets SIGTERM when spawn dies, even by SIGKILL
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


class Spawner:
    """Starts, relays and supervises the children of one spawn."""

    def __init__(self, cmd: list[str], nproc: int, coordinator: str, grace: float, out=None, err=None):
        self.cmd, self.nproc, self.coordinator, self.grace = cmd, nproc, coordinator, grace
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.procs: list[subprocess.Popen] = []
        self._print_lock = threading.Lock()
        self._readers: list[threading.Thread] = []
        self._signalled: int | None = None
        self._kill_at: float | None = None

    def say(self, msg: str) -> None:
        with self._print_lock:
            print(f"[spawn] {msg}", file=self.err, flush=True)

    def _relay(self, rank: int, pipe, stream) -> None:
        prefix = f"[{rank}] "
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            with self._print_lock:
                stream.write(prefix + line + "\n")
                stream.flush()
        pipe.close()

    def start(self) -> None:
        for rank in range(self.nproc):
            env = child_env(dict(os.environ), rank, self.nproc, self.coordinator)
            self.procs.append(
                subprocess.Popen(
                    self.cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_child_setup
                )
            )
        # Reader threads only after every fork: preexec_fn is unsafe once threads run.
        for rank, p in enumerate(self.procs):
            for pipe, stream in ((p.stdout, self.out), (p.stderr, self.err)):
                t = threading.Thread(target=self._relay, args=(rank, pipe, stream), daemon=True)
                t.start()
                self._readers.append(t)

    def signal_all(self, sig: int, only_running: bool = True) -> None:
        for p in self.procs:
            if p.poll() is None or not only_running:
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass

    def on_signal(self, signum, frame) -> None:
        """SIGINT/SIGTERM: forward once; a second one escalates to SIGKILL."""
        if self._signalled is not None:
            self.say(f"{signal.Signals(signum).name} again: killing the children")
            self.signal_all(signal.SIGKILL)
            return
        self._signalled = signum
        self.say(f"{signal.Signals(signum).name}: forwarded to {self.nproc} children")
        self.signal_all(signum)
        self._kill_at = time.monotonic() + self.grace

    def wait(self) -> int:
        """Supervises until every child has exited; returns spawn's exit status."""
        first_failure: tuple[int, int] | None = None  # (rank, status)
        reported: set[int] = set()
        while True:
            codes = [p.poll() for p in self.procs]
            for rank, code in enumerate(codes):
                if code is None or rank in reported:
                    continue
                reported.add(rank)
                if code != 0 and first_failure is None and self._signalled is None:
                    first_failure = (rank, exit_status(code))
                    running = [r for r, c in enumerate(codes) if c is None]
                    self.say(
                        f"rank {rank} exited with status {exit_status(code)}"
                        + (f"; stopping ranks {running} (SIGTERM, SIGKILL after {self.grace:g}s)" if running else "")
                    )
                    self.signal_all(signal.SIGTERM)
                    self._kill_at = time.monotonic() + self.grace
            if all(c is not None for c in codes):
                break
            if self._kill_at is not None and time.monotonic() >= self._kill_at:
                self.say(f"ranks still running after {self.grace:g}s: SIGKILL")
                self.signal_all(signal.SIGKILL)
                self._kill_at = None
            time.sleep(0.05)
        for t in self._readers:
            t.join(timeout=5.0)
        if first_failure is not None:
            return first_failure[1]
        # After a forwarded stop signal: the children's own answer (0 when each saved and exited 0).
        return next((s for s in (exit_status(p.returncode) for p in self.procs) if s), 0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m launch.spawn", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nproc", type=int, required=True, help="number of processes")
    p.add_argument("--host", default="127.0.0.1", help="coordinator host (default: loopback)")
    p.add_argument("--port", type=int, default=0, help="coordinator port (default: a free one)")
    p.add_argument(
        "--grace",
        type=float,
        default=30.0,
        help="seconds between SIGTERM and SIGKILL when stopping children (default 30)",
    )
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        print(
            "error: no command; usage: python -m launch.spawn --nproc N -- python -m launch.train ...", file=sys.stderr
        )
        return 2
    if args.nproc < 1:
        print(f"error: --nproc must be >= 1, got {args.nproc}", file=sys.stderr)
        return 2
    coordinator = f"{args.host}:{args.port or free_port(args.host)}"
    sp = Spawner(cmd, args.nproc, coordinator, args.grace)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, sp.on_signal)
    sp.say(f"{count(args.nproc, 'process', 'processes')}, coordinator {coordinator}: {' '.join(cmd)}")
    try:
        sp.start()
    except OSError as e:
        print(f"error: cannot start {cmd[0]}: {e}", file=sys.stderr)
        sp.signal_all(signal.SIGKILL)
        return 2
    status = sp.wait()
    sp.say(f"exit status {status}")
    return status


if __name__ == "__main__":
    sys.exit(main())
