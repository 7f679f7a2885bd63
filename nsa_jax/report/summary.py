"""A run's artifacts -> the figures and go/no-go criteria an operator judges it by.

Reads what `nsa_jax.train.artifacts` writes into a run's out dir:
  training.csv              one row per step (header row; a header-less file is read
                            in the documented column order)
  val.csv                   optional: step and val_loss (or loss) per evaluation; without
                            it validation comes from the val_loss column of training.csv
  heartbeat_rank<r>.jsonl   events with step, ts and memory (bytes_in_use per process)
  env.json                  the configuration (train.steps, logging.*) and process count
  .HALT, .anomaly_type      written by the trainer (or a watchdog) to stop a run
and turns them into the runbooks' hand judgements, each with GO / NO-GO / N/A:
  files        every artifact read cleanly: a malformed or cut-off line, an unreadable
               env.json is a problem, and a problem is NO-GO (the figures below rest
               on what could be read); the last line of a run still writing is a note
  completion   the run reached train.steps without a halt
  throughput   mean and population stdev of toks_per_s over the last N steps
  loss         every loss finite; mean of the last k steps below the mean of the first k
  step time    coefficient of variation (pstdev / mean) of step_time_s over the last N
  memory       per-rank bytes_in_use growth across the window, and the peak, from heartbeats
  gates        gate entropy and the largest branch gate mean (aux columns) over the window
  anomalies    .HALT, .anomaly_type, stackdump_*.txt, anomaly / halt / watchdog_dump /
               loader_timeout events, skipped (non-finite) updates
  heartbeats   every rank's file present with step_end events, progress on rank 0, no
               long silence between events

Everything here is plain Python over files: no jax, no plotting. Missing or partial
artifacts (a run still writing, a run that died) are named in `Run.missing`,
`Run.problems` and `Run.notes` (then `Summary.problems` / `Summary.notes`, which
`warning_lines` words for stderr); nothing in this module raises on bad file
contents. The verdict is GO only when no criterion is NO-GO, files included: a
`problem` never stands next to a GO. `resolve_run_dir(path, require_run=True)`
refuses a folder that holds no run (naming the runs inside it, if any).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import statistics
import time
from typing import Any, Iterable, Sequence

from nsa_jax.rundir import files as rf

# The file schema (columns, event names) is nsa_jax/rundir/files.py, shared with the trainer.
CSV_COLUMNS = rf.DOCUMENTED_COLUMNS
GATE_COLUMNS = rf.GATE_COLUMNS
ANOMALY_EVENTS = rf.ANOMALY_EVENTS
GO, NO_GO, NA = "GO", "NO-GO", "N/A"
GIB = 2**30
# Beyond this many malformed lines per file the rest are counted, not listed.
_MAX_PROBLEM_LINES = 5


class RunPathError(ValueError):
    """A run path that does not exist or is not a run directory."""


# How many runs a refusal names before it counts the rest.
_MAX_RUNS_NAMED = 6
_INCOMPLETE = "last line incomplete"


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """Limits of the go/no-go criteria; each is a `launch.report` flag of the same name."""

    min_toks_per_s: float = 0.0
    min_loss_drop: float = 0.0
    max_step_cv: float = 0.25
    max_mem_growth: float = 0.05
    max_mem_gib: float = 60.0
    min_gate_entropy: float = 0.5
    max_gate_mean: float = 0.95
    max_heartbeat_gap_s: float = 600.0


# ---------------------------------------------------------------------------
# reading


@dataclasses.dataclass
class Run:
    """What one out dir holds, as parsed; `missing` and `problems` say what is absent or damaged."""

    path: pathlib.Path
    label: str
    rows: list[dict[str, float | None]] = dataclasses.field(default_factory=list)
    columns: list[str] = dataclasses.field(default_factory=list)
    # Where the per-step rows came from: training.csv, or rank 0's step_end heartbeats.
    series_path: pathlib.Path | None = None
    val: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    val_source: str | None = None
    # The last row of long_eval.csv (eval.suites): step and each suite's figures.
    long_eval: dict[str, float] = dataclasses.field(default_factory=dict)
    heartbeats: dict[int, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)
    env: dict[str, Any] | None = None
    halt: str | None = None
    anomaly_type: str | None = None
    missing: list[str] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)
    # Remarks on the files that are no damage (a training.csv with its header alone).
    notes: list[str] = dataclasses.field(default_factory=list)
    # Files whose last line had no newline (ignored): a run still writing them, or cut off.
    partial: list[str] = dataclasses.field(default_factory=list)
    # Files read (their names), and whether val.csv held only its header (no evaluation yet).
    read: list[str] = dataclasses.field(default_factory=list)
    val_empty: bool = False

    @property
    def csv_path(self) -> pathlib.Path:
        return self.path / rf.TRAINING_CSV

    def config(self, section: str, key: str, default: Any = None) -> Any:
        try:
            return self.env["config"][section][key]  # type: ignore[index]
        except (TypeError, KeyError):
            return default

    def series(self, column: str, rows: Sequence[dict] | None = None) -> tuple[list[int], list[float]]:
        """(steps, values) of a column, leaving out empty cells."""
        steps, values = [], []
        for r in self.rows if rows is None else rows:
            v = r.get(column)
            if v is not None:
                steps.append(int(r["step"]))
                values.append(v)
        return steps, values

    def has_column(self, column: str) -> bool:
        return any(r.get(column) is not None for r in self.rows)


def is_run_dir(path: str | os.PathLike) -> bool:
    """Whether a folder holds a run: any file the trainer writes (training.csv, env.json,
    heartbeats, ...) or a checkpoints/ folder."""
    p = pathlib.Path(path)
    return p.is_dir() and (bool(rf.run_files(p)) or (p / rf.CHECKPOINT_DIR).is_dir())


def runs_inside(path: str | os.PathLike, depth: int = 2) -> list[pathlib.Path]:
    """The run folders below `path`, from the shallowest level that holds any (at most `depth` down)."""
    level = [pathlib.Path(path)]
    for _ in range(depth):
        found, deeper = [], []
        for d in level:
            try:
                children = sorted(c for c in d.iterdir() if c.is_dir() and not c.name.startswith("."))
            except OSError:
                continue
            for c in children:
                (found if is_run_dir(c) else deeper).append(c)
        if found:
            return found
        level = deeper
    return []


def not_a_run_message(p: pathlib.Path) -> str:
    """Why `p` is refused, and what to pass instead."""
    head = f"{p} is not a run folder (no {rf.TRAINING_CSV}, {rf.ENV_JSON} or {rf.HEARTBEAT_GLOB})"
    runs = runs_inside(p)
    if not runs:
        return f"{head} and holds no run: pass the out dir of a launch.train run (--out-dir, train.out_dir)"
    named = ", ".join(str(r) for r in runs[:_MAX_RUNS_NAMED])
    more = f" and {len(runs) - _MAX_RUNS_NAMED} more" if len(runs) > _MAX_RUNS_NAMED else ""
    which = "pass it" if len(runs) == 1 else "pass one of them, or several to compare them"
    return f"{head}; runs inside it: {named}{more}: {which}"


def resolve_run_dir(path: str | os.PathLike, require_run: bool = False) -> pathlib.Path:
    """The run directory a command-line path names (a training.csv names its directory).

    `require_run`: a folder that holds no run is refused too (RunPathError naming the runs inside it).
    """
    p = pathlib.Path(path)
    if p.is_file() and p.name == rf.TRAINING_CSV:
        return p.parent
    if not p.exists():
        raise RunPathError(f"no such run directory: {p}")
    if not p.is_dir():
        raise RunPathError(f"not a run directory: {p}")
    if require_run and not is_run_dir(p):
        raise RunPathError(not_a_run_message(p))
    return p


def _problem_lines(problems: list[str], name: str, bad: list[str]) -> None:
    problems.extend(f"{name}: {b}" for b in bad[:_MAX_PROBLEM_LINES])
    if len(bad) > _MAX_PROBLEM_LINES:
        problems.append(f"{name}: {len(bad) - _MAX_PROBLEM_LINES} more malformed lines skipped")


def read_csv(path: pathlib.Path, problems: list[str]) -> tuple[list[str], list[dict[str, float | None]]]:
    """(columns, rows) of a step CSV; malformed or incomplete lines are skipped and named in `problems`."""
    return rf.read_csv(path, problems)


def read_jsonl(path: pathlib.Path, problems: list[str]) -> list[dict[str, Any]]:
    """Events of a heartbeat file; lines that are not JSON objects are skipped and named."""
    lines, partial = rf.read_lines(path)
    if partial:
        problems.append(f"{path.name}: last line incomplete (no newline: still being written or cut off); ignored")
    events, bad = [], []
    for n, line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            bad.append(f"line {n} is not valid JSON; skipped")
            continue
        if not isinstance(rec, dict):
            bad.append(f"line {n} is not a JSON object; skipped")
            continue
        events.append(rec)
    _problem_lines(problems, path.name, bad)
    return events


def _sort_problems(run: Run, found: list[str]) -> bool:
    """Problems of one file into the run's: an incomplete last line goes to `partial` (judged
    later). True when that was the file's only kind of problem."""
    clean = True
    for p in found:
        name, _, what = p.partition(": ")
        if what.startswith(_INCOMPLETE):
            run.partial.append(name)
        else:
            run.problems.append(p)
            clean = False
    return clean


def _read_run_csv(run: Run, path: pathlib.Path) -> tuple[list[str], list[dict[str, float | None]], bool]:
    """(columns, rows, clean) of one of the run's CSVs, its problems sorted into the run's."""
    found: list[str] = []
    columns, rows = read_csv(path, found)
    run.read.append(path.name)
    return columns, rows, _sort_problems(run, found)


def _rows_from_heartbeats(events: list[dict[str, Any]]) -> list[dict[str, float | None]]:
    """Per-step rows from step_end events (when training.csv is off, as in the production smokes)."""
    tokens = next((e.get("tokens_per_step") for e in events if e.get("event") == "boot"), None)
    rows, seen = [], set()
    for e in events:
        if e.get("event") != "step_end" or e.get("step") in seen:
            continue
        seen.add(e.get("step"))
        st = _float(e.get("step_time_s"))
        toks = tokens / max(st, 1e-9) if (tokens and st is not None) else None
        rows.append(
            {
                "step": float(e["step"]),
                "loss": _float(e.get("loss")),
                "lr": _float(e.get("lr")),
                "step_time_s": st,
                "toks_per_s": toks,
            }
        )
    return rows


def _float(v: Any) -> float | None:
    try:
        return None if v is None else float(v)
    except (TypeError, ValueError):
        return None


def load_run(path: str | os.PathLike, label: str | None = None) -> Run:
    """Parses every artifact present in a run directory; never raises on bad contents."""
    root = resolve_run_dir(path)
    run = Run(path=root, label=label or root.name or str(root))
    env_path = root / rf.ENV_JSON
    if env_path.is_file():
        run.read.append(rf.ENV_JSON)
        try:
            env = json.loads(env_path.read_text(errors="replace"))
            run.env = env if isinstance(env, dict) else None
            if run.env is None:
                run.problems.append(f"{rf.ENV_JSON}: not a JSON object; ignored")
        except json.JSONDecodeError as e:
            run.problems.append(f"{rf.ENV_JSON}: not valid JSON ({e.msg} at line {e.lineno}); ignored")
    else:
        run.missing.append(rf.ENV_JSON)

    def disabled(key: str) -> bool:
        return run.config("logging", key, True) is False

    if run.csv_path.is_file():
        run.columns, run.rows, _ = _read_run_csv(run, run.csv_path)
        run.series_path = run.csv_path
        if not run.rows:
            run.notes.append(f"{rf.TRAINING_CSV}: no complete step rows yet")
    else:
        run.missing.append(f"{rf.TRAINING_CSV} (off: logging.csv=false)" if disabled("csv") else rf.TRAINING_CSV)

    for f in sorted(root.glob(rf.HEARTBEAT_GLOB)):
        rank = rf.heartbeat_rank(f.name)
        if rank is not None:
            found = []
            run.heartbeats[rank] = read_jsonl(f, found)
            _sort_problems(run, found)
            run.read.append(f.name)
    expected = run.env.get("process_count") if run.env else None
    if not run.heartbeats:
        run.missing.append(
            f"{rf.HEARTBEAT_GLOB} (off: logging.heartbeat=false)" if disabled("heartbeat") else rf.HEARTBEAT_GLOB
        )
    elif isinstance(expected, int):
        run.missing.extend(rf.heartbeat_name(r) for r in range(expected) if r not in run.heartbeats)

    if not run.rows and run.heartbeats.get(0):
        rows = _rows_from_heartbeats(run.heartbeats[0])
        if rows:
            run.rows = rows
            run.columns = ["step", "loss", "lr", "step_time_s", "toks_per_s"]
            run.series_path = root / rf.heartbeat_name(0)

    val_path = root / rf.VAL_CSV
    if val_path.is_file():
        _, vrows, clean = _read_run_csv(run, val_path)
        key = next((k for k in ("val_loss", "loss") if any(r.get(k) is not None for r in vrows)), None)
        if key:
            run.val = [(int(r["step"]), r[key]) for r in vrows if r.get(key) is not None]
            run.val_source = rf.VAL_CSV
        elif not vrows and clean:
            run.val_empty = True  # the header alone: no evaluation has run yet
        else:
            run.problems.append(f"{rf.VAL_CSV}: no val_loss or loss values")
    if not run.val:
        steps, vals = run.series("val_loss")
        if steps:
            run.val = list(zip(steps, vals))
            run.val_source = "training.csv val_loss"

    long_path = root / rf.LONG_EVAL_CSV
    if long_path.is_file():
        _, lrows, _ = _read_run_csv(run, long_path)
        if lrows:
            run.long_eval = {k: v for k, v in lrows[-1].items() if v is not None and k != "tokens"}

    for name, attr in ((rf.HALT_FILE, "halt"), (rf.ANOMALY_FILE, "anomaly_type")):
        f = root / name
        if f.is_file():
            setattr(run, attr, f.read_text(errors="replace").strip() or "(empty)")
    return run


# ---------------------------------------------------------------------------
# judging


@dataclasses.dataclass
class Criterion:
    name: str
    status: str  # GO, NO-GO or N/A
    detail: str


@dataclasses.dataclass
class Summary:
    run: Run
    last: int
    thresholds: Thresholds
    state: str
    window: str
    criteria: list[Criterion]
    figures: dict[str, Any]
    # What went wrong reading the files (each makes `files` NO-GO), and remarks that do not.
    problems: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def verdict(self) -> str:
        """NO-GO if any criterion is (files too: a problem reading them); GO if none is and throughput
        and loss were judged; else INCOMPLETE."""
        by_name = {c.name: c.status for c in self.criteria}
        if NO_GO in by_name.values():
            return NO_GO
        if by_name.get("throughput") == GO and by_name.get("loss") == GO:
            return GO
        return "INCOMPLETE"

    def failing(self) -> list[str]:
        return [c.name for c in self.criteria if c.status == NO_GO]


def _finite(values: Iterable[float | None]) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


def _halves(values: list[float]) -> tuple[list[float], list[float]]:
    """First and last half of equal length (the middle value of an odd count is in neither)."""
    h = len(values) // 2
    return values[:h], values[len(values) - h :]


def _age(ts: float | None) -> str:
    if ts is None:
        return "?"
    s = max(0.0, time.time() - ts)
    return f"{s:.0f}s" if s < 120 else (f"{s / 60:.0f}min" if s < 7200 else f"{s / 3600:.1f}h")


def _state(run: Run) -> tuple[str, dict[str, Any]]:
    """One line on where the run stands, and its step counts."""
    target = run.config("train", "steps")
    hb0 = run.heartbeats.get(0, [])
    done = next((e for e in reversed(hb0) if e.get("event") == "done"), None)
    last_row = int(run.rows[-1]["step"]) if run.rows else None
    ends = [e.get("step") for e in hb0 if e.get("event") == "step_end" and isinstance(e.get("step"), int)]
    last_step = max([s for s in (last_row, max(ends, default=None)) if s is not None], default=None)
    of = f" of {target}" if target else ""
    info = {
        "target_steps": target,
        "last_step": last_step,
        "finished": done is not None,
        "halted": done.get("halted") if done else None,
    }
    if done is not None:
        steps_done = done.get("steps_done", last_step)
        info["last_step"] = steps_done
        if done.get("halted"):
            return f"halted ({done['halted']}) after step {steps_done}{of}", info
        return f"finished: {steps_done}{of} steps", info
    if last_step is None and not hb0:
        return "no steps recorded", info
    last_ts = max((e.get("ts") for e in hb0 if isinstance(e.get("ts"), (int, float))), default=None)
    where = f"last step {last_step}{of}" if last_step is not None else "no step finished"
    hb = f"; last heartbeat {_age(last_ts)} ago" if last_ts else ""
    return f"not finished ({where}{hb}; no 'done' event: still running, or stopped without one)", info


def summarize(run: Run, last: int = 50, thresholds: Thresholds | None = None) -> Summary:
    """Judges a parsed run over its last `last` steps."""
    th = thresholds or Thresholds()
    last = max(1, int(last))
    window_rows = run.rows[-last:]
    fig: dict[str, Any] = {"rows": len(run.rows), "window_n": len(window_rows)}
    src = run.series_path
    if window_rows:
        a, b = int(window_rows[0]["step"]), int(window_rows[-1]["step"])
        fig.update(window_first_step=a, window_last_step=b)
        short = f" (fewer than --last {last})" if len(window_rows) < last else ""
        window = f"last {len(window_rows)} of {len(run.rows)} steps{short}, steps {a}-{b}, from {src}"
    else:
        window = "no step rows (training.csv and step_end heartbeats absent or empty)"
    state, info = _state(run)
    fig.update(info)
    files, problems, notes = _files(run, info)
    criteria = [
        files,
        _completion(run, info),
        _throughput(window_rows, th, fig, window),
        _loss(run, last, th, fig),
        _step_time(window_rows, th, fig),
        _memory(run, fig, last, th),
        _gates(run, window_rows, th, fig),
        _anomalies(run, fig),
        _heartbeat_health(run, th, fig),
    ]
    return Summary(run, last, th, state, window, criteria, fig, problems, notes)


def _files(run: Run, info: dict[str, Any]) -> tuple[Criterion, list[str], list[str]]:
    """(criterion, problems, notes): every file read cleanly, or what was skipped.

    A last line without its newline is a note while the run has not finished (it is
    still writing), and a problem once it has (the line was cut off).
    """
    problems, notes = list(run.problems), list(run.notes)
    for name in run.partial:
        if info["finished"]:
            problems.append(f"{name}: last line cut off (no newline after the run finished); ignored")
        else:
            notes.append(f"{name}: last line incomplete (the run is still writing it, or it was cut off); ignored")
    if not run.read:
        return Criterion("files", NA, "no run files read"), problems, notes
    if problems:
        names = sorted({p.partition(": ")[0] for p in problems})
        detail = (
            f"{len(problems)} problem(s) reading {', '.join(names)} (each listed as a problem); "
            f"the other criteria judge what could be read"
        )
        return Criterion("files", NO_GO, detail), problems, notes
    note = f"; {len(notes)} note(s), listed as notes" if notes else ""
    return Criterion("files", GO, f"read cleanly: {', '.join(run.read)}{note}"), problems, notes


def _completion(run: Run, info: dict[str, Any]) -> Criterion:
    target, last, halted = info["target_steps"], info["last_step"], info["halted"]
    if halted:
        return Criterion("completion", NO_GO, f"halted ({halted}) after step {last}")
    if info["finished"]:
        if target is None:
            return Criterion("completion", GO, f"finished at step {last} (target unknown: env.json missing)")
        ok = last is not None and last >= target
        return Criterion("completion", GO if ok else NO_GO, f"{last} of {target} steps")
    if last is None:
        return Criterion("completion", NA, "no step recorded")
    if target is not None and last >= target and not run.heartbeats:
        return Criterion("completion", GO, f"{last} of {target} steps in training.csv (no heartbeats)")
    of = f" of {target}" if target else ""
    return Criterion("completion", NO_GO, f"not finished: {last}{of} steps, no 'done' event")


def _throughput(rows: list[dict], th: Thresholds, fig: dict, window: str) -> Criterion:
    """Tokens over the steps' own time (total tokens / total step time), and the median step's rate.

    Both are robust to a few odd steps: a mean of per-step rates is not (one step that
    took no time would dominate it).
    """
    vals = _finite(r.get("toks_per_s") for r in rows)
    if not vals:
        return Criterion("throughput", NA, "no toks_per_s values")
    pairs = [
        (r["toks_per_s"] * r["step_time_s"], r["step_time_s"])
        for r in rows
        if r.get("toks_per_s") is not None
        and r.get("step_time_s") is not None
        and math.isfinite(r["toks_per_s"])
        and math.isfinite(r["step_time_s"])
        and r["step_time_s"] > 0
    ]
    median = statistics.median(vals)
    overall = sum(t for t, _ in pairs) / sum(s for _, s in pairs) if pairs else median
    mean, sd = statistics.fmean(vals), statistics.pstdev(vals)
    fig.update(toks_per_s=overall, toks_median=median, toks_mean=mean, toks_pstdev=sd, toks_n=len(vals))
    ok = overall > 0 and overall >= th.min_toks_per_s
    floor = f"floor {th.min_toks_per_s:g} (--min-toks-per-s)"
    how = "total tokens / total step time" if pairs else "median"
    return Criterion(
        "throughput",
        GO if ok else NO_GO,
        f"{overall:,.1f} tok/s ({how}), median step {median:,.1f} tok/s over {len(vals)} steps; {floor}",
    )


def _loss(run: Run, last: int, th: Thresholds, fig: dict) -> Criterion:
    losses = [r.get("loss") for r in run.rows]
    losses = [v for v in losses if v is not None]
    bad = [int(r["step"]) for r in run.rows if r.get("loss") is not None and not math.isfinite(r["loss"])]
    fig["loss_nonfinite"] = len(bad)
    val = ""
    if run.val:
        fig.update(val_first=run.val[0][1], val_last=run.val[-1][1], val_n=len(run.val))
        val = f"; val {run.val[0][1]:.4f} -> {run.val[-1][1]:.4f} ({len(run.val)} evals, {run.val_source})"
    elif run.val_empty:
        every = run.config("train", "eval_every")
        val = f"; no evaluation yet ({rf.VAL_CSV} has no rows" + (f"; train.eval_every={every})" if every else ")")
    if not losses:
        return Criterion("loss", NA, "no loss values")
    nonfinite = f"non-finite at steps {bad[:5]}{'...' if len(bad) > 5 else ''}" if bad else f"all {len(losses)} finite"
    if len(losses) < 2:
        return Criterion("loss", NO_GO if bad else NA, f"{nonfinite}; one step is too few to see a trend{val}")
    k = min(last, len(losses) // 2)
    first, end = _finite(losses[:k]), _finite(losses[-k:])
    if not first or not end:
        return Criterion("loss", NO_GO, f"{nonfinite}{val}")
    m0, m1 = statistics.fmean(first), statistics.fmean(end)
    fig.update(loss_k=k, loss_first_mean=m0, loss_last_mean=m1, loss_last=losses[-1])
    falling = m1 < m0 - th.min_loss_drop
    trend = (
        f"mean of first {k} steps {m0:.4f} -> last {k} {m1:.4f} "
        f"(drop {m0 - m1:+.4f}; needs > {th.min_loss_drop:g}, --min-loss-drop)"
    )
    return Criterion("loss", GO if falling and not bad else NO_GO, f"{nonfinite}; {trend}{val}")


def _step_time(rows: list[dict], th: Thresholds, fig: dict) -> Criterion:
    """Spread of step times: the median absolute deviation over the median (robust CV).

    MAD / median x 1.4826 equals pstdev / mean for normally distributed times, and a
    few slow steps (a first evaluation's compile, a checkpoint's copy) do not move it.
    """
    vals = _finite(r.get("step_time_s") for r in rows)
    if len(vals) < 2:
        return Criterion("step time", NA, "fewer than 2 step times in the window")
    med = statistics.median(vals)
    mad = statistics.median(abs(v - med) for v in vals)
    cv = 1.4826 * mad / med if med > 0 else math.inf
    mean, sd = statistics.fmean(vals), statistics.pstdev(vals)
    fig.update(
        step_time_median=med,
        step_time_mean=mean,
        step_time_pstdev=sd,
        step_time_cv=cv,
        step_time_max=max(vals),
    )
    slow = sum(v > 2 * med for v in vals)
    return Criterion(
        "step time",
        GO if cv <= th.max_step_cv else NO_GO,
        f"median {med * 1e3:,.1f} ms, robust CV {cv:.3f} (1.4826 MAD / median; limit {th.max_step_cv:g}, "
        f"--max-step-cv), slowest {max(vals) * 1e3:,.1f} ms = {max(vals) / med:.1f}x median, "
        f"{slow} step(s) over 2x median",
    )


def _memory_points(events: list[dict], step_end_only: bool = True) -> list[tuple[int, int, int]]:
    """(step, bytes_in_use, peak) of step_end events (of every event when none ended a step, or not
    `step_end_only`)."""

    def pts(evs):
        out = []
        for e in evs:
            m = e.get("memory")
            if (
                isinstance(m, dict)
                and isinstance(m.get("bytes_in_use"), (int, float))
                and isinstance(e.get("step"), int)
            ):
                peak = m.get("peak_bytes_in_use")
                out.append(
                    (
                        e["step"],
                        int(m["bytes_in_use"]),
                        int(max(m["bytes_in_use"], peak if isinstance(peak, (int, float)) else 0)),
                    )
                )
        return out

    ends = pts([e for e in events if e.get("event") == "step_end"]) if step_end_only else []
    return ends or pts(events)


def memory_series(run: Run) -> dict[int, list[tuple[int, int, int]]]:
    """rank -> [(step, bytes_in_use, peak bytes)] from heartbeats."""
    return {r: p for r, evs in sorted(run.heartbeats.items()) if (p := _memory_points(evs))}


def _memory(run: Run, fig: dict, last: int, th: Thresholds) -> Criterion:
    series = memory_series(run)
    if not series:
        why = "no heartbeats" if not run.heartbeats else "heartbeats carry no memory readings"
        return Criterion("memory", NA, why)
    first_step = fig.get("window_first_step")
    parts, ok, growths, peaks = [], True, {}, {}
    for rank, pts in series.items():
        if first_step is None:
            win = pts[-last:]
        else:
            win = [p for p in pts if p[0] >= first_step]
        # Peak over every event (progress and done events come after a step's reading too).
        peak = max(p[2] for p in _memory_points(run.heartbeats[rank], step_end_only=False)) / GIB
        peaks[rank] = peak
        src = next((e["memory"].get("source") for e in run.heartbeats[rank] if isinstance(e.get("memory"), dict)), "?")
        a, b = _halves([p[1] for p in win])
        if not a:
            parts.append(f"rank{rank}: {len(win)} reading(s) in the window, too few for a trend; peak {peak:.2f} GiB")
            ok = ok and peak <= th.max_mem_gib
            continue
        m0, m1 = statistics.fmean(a), statistics.fmean(b)
        growth = (m1 - m0) / m0 if m0 > 0 else math.inf
        growths[rank] = growth
        ok = ok and growth <= th.max_mem_growth and peak <= th.max_mem_gib
        parts.append(f"rank{rank} ({src}): {m0 / GIB:.2f} -> {m1 / GIB:.2f} GiB ({growth:+.1%}), peak {peak:.2f} GiB")
    fig.update(mem_growth=growths, mem_peak_gib=peaks)
    if not growths and all(p <= th.max_mem_gib for p in peaks.values()):
        status = NA
    else:
        status = GO if ok else NO_GO
    limits = f"limits growth {th.max_mem_growth:.0%} (--max-mem-growth), peak {th.max_mem_gib:g} GiB (--max-mem-gib)"
    return Criterion("memory", status, "; ".join(parts) + f"; first vs last half of the window; {limits}")


def _gates(run: Run, rows: list[dict], th: Thresholds, fig: dict) -> Criterion:
    if not all(run.has_column(c) for c in GATE_COLUMNS + ("gate_entropy",)):
        return Criterion(
            "gates", NA, "no gate columns in training.csv (logging.aux_stats off, e.g. NSA_DISABLE_AUX_STATS=1)"
        )
    means = {c[5:]: _finite(r.get(c) for r in rows) for c in GATE_COLUMNS}
    ent = _finite(r.get("gate_entropy") for r in rows)
    n_bad = sum(
        1 for r in rows for c in GATE_COLUMNS + ("gate_entropy",) if r.get(c) is not None and not math.isfinite(r[c])
    )
    if not ent or not all(means.values()):
        return Criterion("gates", NO_GO if n_bad else NA, "no finite gate values in the window")
    g = {b: statistics.fmean(v) for b, v in means.items()}
    e = statistics.fmean(ent)
    gmax = max(g.values())
    far = _finite(r.get("sel_far_frac") for r in rows)
    fig.update(gate_means=g, gate_entropy=e, gate_max_mean=gmax, sel_far_frac=statistics.fmean(far) if far else None)
    ok = e >= th.min_gate_entropy and gmax <= th.max_gate_mean and not n_bad
    branch = ", ".join(f"{b} {v:.3f}" for b, v in g.items())
    sel = f"; selected blocks beyond the window {fig['sel_far_frac']:.1%}" if far else ""
    bad = f"; {n_bad} non-finite values" if n_bad else ""
    ratios = {c: _finite(r.get(c) for r in rows) for c in rf.SCALE_COLUMNS}
    scale = ""
    if all(ratios.values()):
        rk, rv = max(ratios["cmp_k_ratio"]), max(ratios["cmp_v_ratio"])
        fig.update(cmp_k_ratio_max=rk, cmp_v_ratio_max=rv)
        big = f" (above {rf.CMP_SCALE_WARN:g}: see the branch_scale event)" if max(rk, rv) > rf.CMP_SCALE_WARN else ""
        scale = f"; compressed / selection RMS up to keys {rk:.2f}x, values {rv:.2f}x{big}"
    return Criterion(
        "gates",
        GO if ok else NO_GO,
        f"window means {branch}; entropy {e:.3f} nats (max ln3 = {math.log(3):.3f}; "
        f"floor {th.min_gate_entropy:g}, --min-gate-entropy); largest mean {gmax:.3f} "
        f"(limit {th.max_gate_mean:g}, --max-gate-mean){sel}{scale}{bad}",
    )


def _anomalies(run: Run, fig: dict) -> Criterion:
    found = []
    if run.halt is not None:
        found.append(f".HALT present ({run.halt})")
    if run.anomaly_type is not None:
        found.append(f".anomaly_type {run.anomaly_type}")
    for rank, evs in sorted(run.heartbeats.items()):
        for e in evs:
            if e.get("event") in ANOMALY_EVENTS:
                kind = f" {e['anomaly_type']}" if e.get("anomaly_type") else ""
                msg = f": {e['msg']}" if e.get("msg") else ""
                found.append(f"rank{rank} {e['event']}{kind} at step {e.get('step')}{msg}")
    dumps = sorted(p.name for p in run.path.glob("stackdump_*.txt"))
    if dumps:
        found.append(f"{len(dumps)} stack dump(s): {', '.join(dumps[:3])}{'...' if len(dumps) > 3 else ''}")
    skipped = [int(r["step"]) for r in run.rows if r.get("skipped")]
    if skipped:
        found.append(f"{len(skipped)} skipped update(s) at steps {skipped[:5]}{'...' if len(skipped) > 5 else ''}")
    fig.update(anomalies=len(found), skipped=len(skipped))
    if found:
        shown = found[:6] + ([f"... {len(found) - 6} more"] if len(found) > 6 else [])
        return Criterion("anomalies", NO_GO, "; ".join(shown))
    checked = (
        ".HALT, .anomaly_type, stackdump_*.txt"
        + (", heartbeat events" if run.heartbeats else "")
        + (", skipped column" if run.has_column("skipped") else "")
    )
    return Criterion("anomalies", GO, f"none ({checked})")


def _segments(events: list[dict]) -> list[list[dict]]:
    """Events split at each boot: a resumed run appends to the same file after a pause that is no stall."""
    segs: list[list[dict]] = [[]]
    for e in events:
        if e.get("event") == "boot" and segs[-1]:
            segs.append([])
        segs[-1].append(e)
    return segs


def _longest_gap(events: list[dict]) -> float:
    """Longest time between consecutive events from the first step_start on (compilation comes before)."""
    start = next((i for i, e in enumerate(events) if e.get("event") == "step_start"), None)
    if start is None:
        return 0.0
    ts = [e["ts"] for e in events[start:] if isinstance(e.get("ts"), (int, float))]
    return max((b - a for a, b in zip(ts, ts[1:])), default=0.0)


def _heartbeat_health(run: Run, th: Thresholds, fig: dict) -> Criterion:
    if not run.heartbeats:
        if run.config("logging", "heartbeat", True) is False:
            return Criterion("heartbeats", NA, "off (logging.heartbeat=false)")
        return Criterion("heartbeats", NO_GO, f"no {rf.HEARTBEAT_GLOB}")
    issues, parts, worst = [], [], 0.0
    expected = run.env.get("process_count") if run.env else None
    if isinstance(expected, int):
        absent = [r for r in range(expected) if r not in run.heartbeats]
        if absent:
            issues.append(f"ranks {absent} have no heartbeat file")
    for rank, evs in sorted(run.heartbeats.items()):
        kinds = [e.get("event") for e in evs]
        n_end = kinds.count("step_end")
        if not n_end:
            issues.append(f"rank{rank} has no step_end")
        if rank == 0 and "progress" not in kinds:
            issues.append("rank0 has no progress event")
        gap = max((_longest_gap(seg) for seg in _segments(evs)), default=0.0)
        worst = max(worst, gap)
        parts.append(f"rank{rank} {n_end} step_end, longest silence {gap:.1f}s")
    fig["heartbeat_max_gap_s"] = worst
    if worst > th.max_heartbeat_gap_s:
        issues.append(f"silence of {worst:.0f}s")
    limit = f"limit {th.max_heartbeat_gap_s:g}s (--max-heartbeat-gap-s)"
    return Criterion("heartbeats", NO_GO if issues else GO, "; ".join(issues + parts) + f"; {limit}")


# ---------------------------------------------------------------------------
# text


def long_eval_line(run: Run) -> str | None:
    """'long eval (step 400): needle_acc_L1024 0.910, ...' from long_eval.csv's last row."""
    if not run.long_eval:
        return None
    figures = {k: v for k, v in run.long_eval.items() if k not in ("step", "long_eval_s")}
    return f"long eval (step {int(run.long_eval['step'])}): " + ", ".join(f"{k} {v:.3f}" for k, v in figures.items())


def format_summary(s: Summary) -> str:
    run = s.run
    out = [f"run: {run.path} ({s.state})", f"window: {s.window}"]
    if run.missing:
        out.append("missing: " + "; ".join(run.missing))
    width = max(len(c.name) for c in s.criteria)
    for c in s.criteria:
        out.append(f"  {c.status:<6} {c.name:<{width}}  {c.detail}")
    if long_eval_line(run):
        out.append(long_eval_line(run))
    fail = s.failing()
    out.append(f"verdict: {s.verdict}" + (f" ({', '.join(fail)})" if fail else ""))
    return "\n".join(out)


def warning_lines(s: Summary) -> list[str]:
    """The run's problems and notes as lines for stderr ('warning: RUN: ...', 'note: RUN: ...')."""
    return [f"warning: {s.run.path}: {p}" for p in s.problems] + [f"note: {s.run.path}: {n}" for n in s.notes]


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_summary(s: Summary, images: dict[str, str], skipped: dict[str, str], level: int = 1) -> str:
    """A report page; `images` maps plot name -> relative PNG path, `skipped` plot name -> why not drawn."""
    h = "#" * level
    run = s.run
    lines = [
        f"{h} Run report: {run.label}",
        "",
        f"- directory: `{run.path}`",
        f"- state: {s.state}",
        f"- window: {s.window}",
        f"- verdict: **{s.verdict}**",
    ]
    if run.missing:
        lines.append("- missing: " + "; ".join(f"`{m}`" for m in run.missing))
    lines += [f"- problem: {_md_escape(p)}" for p in s.problems]
    lines += [f"- note: {_md_escape(n)}" for n in s.notes]
    if long_eval_line(run):
        lines.append(f"- {long_eval_line(run)}")
    lines += ["", "| criterion | verdict | detail |", "|---|---|---|"]
    lines += [f"| {c.name} | {c.status} | {_md_escape(c.detail)} |" for c in s.criteria]
    lines.append("")
    for name, rel in images.items():
        lines += [f"{h}# {name.replace('_', ' ')}", "", f"![{name}]({rel})", ""]
    if skipped:
        lines.append("Plots not drawn: " + "; ".join(f"{k} ({v})" for k, v in skipped.items()))
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# comparison


@dataclasses.dataclass
class Entry:
    """One run of a comparison; `failed` runs (a sweep variant that exited non-zero) are not ranked."""

    label: str
    summary: Summary | None
    failed: bool = False
    status: str = "ok"
    error: str = ""


def rank_entries(entries: Sequence[Entry], tie_pct: float = 1.0) -> list[tuple[int | None, Entry]]:
    """Highest tok/s (total tokens / total step time) first; rates within `tie_pct` percent of a
    group's leader go to the lower pstdev.

    Runs that failed or have no throughput come last, unranked (None).
    """
    ok = [e for e in entries if not e.failed and e.summary and e.summary.figures.get("toks_per_s") is not None]
    rest = [e for e in entries if e not in ok]
    ok.sort(key=lambda e: -e.summary.figures["toks_per_s"])
    ordered: list[Entry] = []
    i = 0
    while i < len(ok):
        lead = ok[i].summary.figures["toks_per_s"]
        j = i
        while j < len(ok) and ok[j].summary.figures["toks_per_s"] >= lead * (1 - tie_pct / 100):
            j += 1
        ordered += sorted(ok[i:j], key=lambda e: (e.summary.figures["toks_pstdev"], -e.summary.figures["toks_per_s"]))
        i = j
    return [(n + 1, e) for n, e in enumerate(ordered)] + [(None, e) for e in rest]


_TABLE_HEAD = ("rank", "run", "status", "tok/s", "pstdev", "n", "step-time CV", "last loss", "verdict")


def table_rows(ranked: list[tuple[int | None, Entry]]) -> list[tuple[str, ...]]:
    out = []
    for rank, e in ranked:
        f = e.summary.figures if e.summary else {}

        def num(key: str, spec: str) -> str:
            v = f.get(key)
            return "-" if v is None else format(v, spec)

        out.append(
            (
                str(rank) if rank else "-",
                e.label,
                e.status,
                num("toks_per_s", ",.1f"),
                num("toks_pstdev", ",.1f"),
                str(f.get("toks_n", "-")),
                num("step_time_cv", ".3f"),
                num("loss_last", ".4f"),
                e.summary.verdict if e.summary else "-",
            )
        )
    return out


def format_table(ranked: list[tuple[int | None, Entry]], last: int, tie_pct: float) -> str:
    rows = [_TABLE_HEAD] + table_rows(ranked)
    widths = [max(len(r[i]) for r in rows) for i in range(len(_TABLE_HEAD))]
    right = {0, 3, 4, 5, 6, 7}
    lines = [
        "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
        for r in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(_ranking_note(ranked, last, tie_pct))
    lines += [f"{e.label}: {e.error}" for _, e in ranked if e.error]
    return "\n".join(lines)


def _ranking_note(ranked: list[tuple[int | None, Entry]], last: int, tie_pct: float) -> str:
    best = next((e.label for r, e in ranked if r == 1), None)
    rule = (
        f"ranked by tok/s (total tokens / total step time) over the last {last} steps; "
        f"within {tie_pct:g}% go to the lower pstdev"
    )
    return f"best: {best} ({rule})" if best else f"no run to rank ({rule})"


def markdown_table(ranked: list[tuple[int | None, Entry]], last: int, tie_pct: float) -> str:
    lines = ["| " + " | ".join(_TABLE_HEAD) + " |", "|" + "---|" * len(_TABLE_HEAD)]
    lines += ["| " + " | ".join(_md_escape(c) for c in r) + " |" for r in table_rows(ranked)]
    lines += ["", _ranking_note(ranked, last, tie_pct)]
    lines += [f"- `{e.label}`: {_md_escape(e.error)}" for _, e in ranked if e.error]
    return "\n".join(lines)
