"""`python -m launch.watchdog --dir OUT [--halt 1] [--interval 30] [thresholds]`: an external run watchdog.

Tails a run's artifacts (file names and columns: nsa_jax/rundir/files.py) and watches for:
  crash                a rank's trainer raised: its heartbeat ends with a `crash` event
                       (the error) instead of `done`
  checkpoint_failed    a checkpoint save failed (disk full, permission): the trainer
                       stopped with status 74 after a `checkpoint_failed` event
  heartbeat_stall      a rank's newest heartbeat event is older than --stall-seconds
                       (--startup-grace until the rank's first step_end: boot and compile);
                       no heartbeat file at all within --startup-grace counts too
  throughput_flatline  toks_per_s under --toks-floor for the last --patience rows, or
                       their median under --flatline-fraction x the median of the
                       --flatline-window rows before them
  gate_collapse        gate_entropy under --gate-entropy-min, or the largest of
                       gate_cmp/gate_slc/gate_win over --gate-max, for --patience rows
  zero_grad_norm       grad_norm <= --grad-norm-floor for --patience rows
With --halt 1 the first anomaly writes <dir>/.anomaly_type and <dir>/.HALT (the
trainer stops at its next step boundary) and the watchdog exits 1. With --halt 0 it
reports each kind once and keeps watching.

Exit status: 0 when the run ended cleanly (every rank wrote `done`, or someone else
wrote .HALT: the trainer on a NaN, or an operator); 1 when this watchdog found an
anomaly; 2 on bad usage.

Reading: files are read forward from offset 0 and their offsets remembered; a
partial last line waits for its newline; a file that shrinks or is replaced
(truncation, rotation, a restarted run) is read again from the start. training.csv
is read by its header's column names (a header-less file is read with the torch
trainer's layout: step, loss, lr, toks_per_s); toks_per_s is the step's own rate (the
trainer leaves evaluation and checkpoint time out of it). Heartbeat ages use the events' `ts`
field, so on a shared filesystem the hosts' clocks must agree (NTP).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import pathlib
import statistics
import sys
import time

from nsa_jax.rundir import files as rf
from nsa_jax.rundir.files import ANOMALY_FILE, GATE_COLUMNS, HALT_FILE, write_halt
from nsa_jax.words import count

LEGACY_CSV = rf.LEGACY_COLUMNS
# Events that show the watchdog of the trainer speaking, not the trainer making progress.
NOT_PROGRESS = {"watchdog_dump"}


class LineTail:
    """New complete lines of a growing text file, from its start; survives truncation and rotation."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self.offset = 0
        self.inode: int | None = None
        self.partial = b""
        self.resets = 0

    def read(self) -> tuple[list[str], bool]:
        """(new complete lines, whether the file was reset since the last read)."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return [], False
        reset = False
        if self.inode is not None and (st.st_ino != self.inode or st.st_size < self.offset):
            self.offset, self.partial, reset = 0, b"", True
            self.resets += 1
        self.inode = st.st_ino
        if st.st_size == self.offset:
            return [], reset
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        *complete, self.partial = (self.partial + data).split(b"\n")
        return [line.decode("utf-8", errors="replace") for line in complete if line.strip()], reset


@dataclasses.dataclass
class RankState:
    tail: LineTail
    first_seen: float
    last_ts: float | None = None
    last_step: int = 0
    last_event: str = ""
    stepped: bool = False  # a step_end was seen
    done: bool = False
    dumped_on_stall: bool = False  # the trainer's own stall watchdog fired (and ended the process)
    crash: str | None = None  # the error of a `crash` event
    save_failed: str | None = None  # the cause of a `checkpoint_failed` event
    bad_lines: int = 0


@dataclasses.dataclass(frozen=True)
class Anomaly:
    kind: str
    detail: str


class Watchdog:
    """The state of one watched run directory; `poll()` once per interval."""

    def __init__(self, out: pathlib.Path, args: argparse.Namespace, now: float | None = None):
        self.out, self.a = out, args
        self.started = time.time() if now is None else now
        self.ranks: dict[int, RankState] = {}
        self.csv = LineTail(out / rf.TRAINING_CSV)
        # Header-less: the torch trainer's layout. Text cells count as malformed lines.
        self.parser = rf.CsvRows(headerless=LEGACY_CSV)
        keep = args.flatline_window + args.patience
        self.rows: collections.deque[dict[str, float | None]] = collections.deque(maxlen=max(keep, 1))
        self.rows_seen = 0

    # -- reading ------------------------------------------------------------------

    def _read_heartbeats(self, now: float) -> None:
        for path in sorted(self.out.glob(rf.HEARTBEAT_GLOB)):
            rank = rf.heartbeat_rank(path.name)
            if rank is None:
                continue
            st = self.ranks.get(rank)
            if st is None:
                st = self.ranks[rank] = RankState(LineTail(path), first_seen=now)
            lines, reset = st.tail.read()
            if reset:  # a new run in the same directory
                self.ranks[rank] = st = RankState(st.tail, first_seen=now)
            for line in lines:
                try:
                    ev = json.loads(line)
                except json.JSONDecodeError:
                    st.bad_lines += 1
                    continue
                if not isinstance(ev, dict):
                    st.bad_lines += 1
                    continue
                name = str(ev.get("event", ""))
                ts = ev.get("ts")
                if self.a.fresh and (not isinstance(ts, (int, float)) or ts < self.started):
                    continue
                if name == "boot":  # a resumed run appends to the same file: its earlier end no longer holds
                    st.done = st.stepped = st.dumped_on_stall = False
                    st.crash = st.save_failed = None
                if name == "done":
                    st.done = True
                if name == "crash":
                    st.crash = str(ev.get("msg") or "unknown error")
                if name == "checkpoint_failed":
                    st.save_failed = str(ev.get("msg") or "unknown cause")
                if name == "step_end":
                    st.stepped = True
                if name == "watchdog_dump" and ev.get("reason") == "stall":
                    st.dumped_on_stall = True
                if isinstance(ev.get("step"), int):
                    st.last_step = max(st.last_step, ev["step"])
                if name not in NOT_PROGRESS and isinstance(ts, (int, float)):
                    st.last_ts = float(ts) if st.last_ts is None else max(st.last_ts, float(ts))
                    st.last_event = name

    def _read_csv(self) -> None:
        lines, reset = self.csv.read()
        if reset:
            self.parser.reset()
            self.rows_seen = 0
            self.rows.clear()
        for line in lines:
            row = self.parser.feed(line)
            if row is None:
                continue
            self.rows.append(row)
            self.rows_seen += 1

    @property
    def columns(self) -> tuple[str, ...] | None:
        return self.parser.columns

    # -- checks -------------------------------------------------------------------

    def ended(self) -> str | None:
        halt = self.out / HALT_FILE
        if halt.exists():
            kind = (self.out / ANOMALY_FILE).read_text().strip() if (self.out / ANOMALY_FILE).exists() else "none"
            return f"{HALT_FILE} present ({halt.read_text().strip() or 'empty'}; anomaly type: {kind})"
        failed = any(st.save_failed for st in self.ranks.values())
        if self.ranks and all(st.done for st in self.ranks.values()) and not failed:
            steps = ", ".join(f"rank {r}: step {st.last_step}" for r, st in sorted(self.ranks.items()))
            return f"every rank wrote `done` ({steps})"
        return None

    def _heartbeat_anomaly(self, now: float) -> Anomaly | None:
        a = self.a
        if not self.ranks:
            waited = now - self.started
            if waited > a.startup_grace:
                return Anomaly("heartbeat_stall", f"no heartbeat_rank*.jsonl in {self.out} after {waited:.0f}s")
            return None
        for rank, st in sorted(self.ranks.items()):
            if st.crash is not None:
                return Anomaly("crash", f"rank {rank}: the trainer raised after step {st.last_step}: {st.crash}")
            if st.save_failed is not None:
                return Anomaly("checkpoint_failed", f"rank {rank}: {st.save_failed}")
            if st.done:
                continue
            if st.dumped_on_stall:
                return Anomaly(
                    "heartbeat_stall",
                    f"rank {rank}: the trainer's stall watchdog fired after step "
                    f"{st.last_step} (stackdump_*_rank{rank}.txt) and ended the process",
                )
            limit = a.stall_seconds if st.stepped else max(a.stall_seconds, a.startup_grace)
            age = now - (st.last_ts if st.last_ts is not None else st.first_seen)
            if age > limit:
                what = f"last event {st.last_event!r} at step {st.last_step}" if st.last_ts else "no event yet"
                return Anomaly(
                    "heartbeat_stall", f"rank {rank}: no heartbeat for {age:.0f}s (limit {limit:g}s); {what}"
                )
        return None

    def _recent(self, column: str) -> list[float] | None:
        """The last --patience values of `column`, or None if any is missing."""
        p = self.a.patience
        if len(self.rows) < p:
            return None
        vals = [row.get(column) for row in list(self.rows)[-p:]]
        if any(v is None or math.isnan(v) for v in vals):
            return None
        return vals

    def _csv_anomaly(self) -> Anomaly | None:
        a = self.a
        toks = self._recent("toks_per_s")
        if toks is not None:
            if all(v < a.toks_floor for v in toks):
                return Anomaly(
                    "throughput_flatline",
                    f"toks_per_s under {a.toks_floor:g} for the last {count(a.patience, 'row')}: {toks}",
                )
            ref = [row.get("toks_per_s") for row in list(self.rows)[: -a.patience]]
            ref = [v for v in ref if v is not None and math.isfinite(v)]
            if len(ref) >= max(a.patience, 10):
                base, now_med = statistics.median(ref), statistics.median(toks)
                if base > 0 and now_med < a.flatline_fraction * base:
                    return Anomaly(
                        "throughput_flatline",
                        f"toks_per_s median {now_med:.4g} over the last {count(a.patience, 'row')} is under "
                        f"{a.flatline_fraction:g} x the median {base:.4g} of the {count(len(ref), 'row')} before",
                    )
        ent = self._recent("gate_entropy")
        if ent is not None and all(v < a.gate_entropy_min for v in ent):
            return Anomaly(
                "gate_collapse", f"gate_entropy under {a.gate_entropy_min:g} for {count(a.patience, 'row')}: {ent}"
            )
        gates = [self._recent(c) for c in GATE_COLUMNS]
        if all(g is not None for g in gates):
            peaks = [max(vals) for vals in zip(*gates)]
            if all(v > a.gate_max for v in peaks):
                return Anomaly(
                    "gate_collapse", f"largest gate mean over {a.gate_max:g} for {count(a.patience, 'row')}: {peaks}"
                )
        gn = self._recent("grad_norm")
        if gn is not None and all(v <= a.grad_norm_floor for v in gn):
            return Anomaly("zero_grad_norm", f"grad_norm <= {a.grad_norm_floor:g} for {count(a.patience, 'row')}: {gn}")
        return None

    def poll(self, now: float | None = None) -> tuple[str | None, Anomaly | None]:
        """Reads what is new; (why the run has ended or None, the first anomaly or None)."""
        now = time.time() if now is None else now
        self._read_heartbeats(now)
        self._read_csv()
        end = self.ended()
        if end is not None:
            return end, None
        return None, self._heartbeat_anomaly(now) or self._csv_anomaly()

    def status(self, now: float) -> str:
        parts = []
        for rank, st in sorted(self.ranks.items()):
            age = f"{now - st.last_ts:.0f}s ago" if st.last_ts is not None else "no event yet"
            parts.append(f"rank {rank} step {st.last_step} ({st.last_event or '-'} {age})")
        if self.rows:
            last = self.rows[-1]
            parts.append(f"csv step {last.get('step')}, toks_per_s {last.get('toks_per_s')}")
        return "; ".join(parts) or "waiting for artifacts"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m launch.watchdog", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--dir", required=True, help="the run's out_dir")
    p.add_argument(
        "--halt",
        type=int,
        choices=(0, 1),
        default=0,
        help="1: write .anomaly_type and .HALT on the first anomaly and exit 1; 0: report only",
    )
    p.add_argument("--interval", type=float, default=30.0, help="seconds between polls (default 30)")
    p.add_argument("--once", action="store_true", help="poll once and exit (0 ended or healthy, 1 anomaly)")
    p.add_argument(
        "--fresh",
        action="store_true",
        help="ignore heartbeat events written before the watchdog started (start it just before a "
        "run that resumes in the same directory, whose files still hold the earlier run's end)",
    )
    p.add_argument(
        "--stall-seconds",
        type=float,
        default=600.0,
        help="heartbeat age that counts as a stall once the rank has finished a step (default 600)",
    )
    p.add_argument(
        "--startup-grace",
        type=float,
        default=1800.0,
        help="the same limit before a rank's first step_end, for boot and compile (default 1800)",
    )
    p.add_argument("--patience", type=int, default=3, help="CSV rows a condition must hold for (default 3)")
    p.add_argument("--toks-floor", type=float, default=1.0, help="toks_per_s under this is a flatline (default 1)")
    p.add_argument("--flatline-window", type=int, default=50, help="reference rows for the median (default 50)")
    p.add_argument(
        "--flatline-fraction",
        type=float,
        default=0.1,
        help="recent median under this fraction of the reference median is a flatline (default 0.1)",
    )
    p.add_argument(
        "--gate-entropy-min",
        type=float,
        default=0.2,
        help="gate_entropy (nats; ln 3 = 1.0986 is uniform) under this is a collapse (default 0.2)",
    )
    p.add_argument(
        "--gate-max", type=float, default=0.99, help="a gate_cmp/slc/win mean over this is a collapse (default 0.99)"
    )
    p.add_argument(
        "--grad-norm-floor", type=float, default=0.0, help="grad_norm at or under this counts as zero (default 0)"
    )
    return p


def _say(msg: str) -> None:
    stamp = time.strftime("%H:%M:%S")
    print(f"[watchdog {stamp}] {msg}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.patience < 1 or args.interval <= 0 or args.flatline_window < 1:
        print("error: --patience and --flatline-window must be >= 1 and --interval > 0", file=sys.stderr)
        return 2
    out = pathlib.Path(args.dir)
    if out.exists() and not out.is_dir():
        print(f"error: --dir {out} is not a directory", file=sys.stderr)
        return 2
    dog = Watchdog(out, args)
    _say(f"watching {out} every {args.interval:g}s (halt={'on' if args.halt else 'off'})")
    seen: dict[str, Anomaly] = {}
    while True:
        now = time.time()
        end, anomaly = dog.poll(now) if out.is_dir() else (None, dog._heartbeat_anomaly(now))
        if end is not None:
            _say(f"run ended: {end}")
            if seen:
                _say(f"anomalies seen: {', '.join(seen)}")
            return 1 if seen else 0
        if anomaly is not None and anomaly.kind not in seen:
            seen[anomaly.kind] = anomaly
            if args.halt:
                out.mkdir(parents=True, exist_ok=True)
                write_halt(out, anomaly.kind, f"watchdog: {anomaly.detail}")
                _say(f"ANOMALY {anomaly.kind}: {anomaly.detail}; wrote {out / ANOMALY_FILE} and {out / HALT_FILE}")
                return 1
            _say(f"ANOMALY {anomaly.kind}: {anomaly.detail} (report only: --halt 0)")
        elif anomaly is None:
            _say(f"ok: {dog.status(now)}")
        if args.once:
            return 1 if seen else 0
        time.sleep(args.interval)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
