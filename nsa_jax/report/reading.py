"""Reading a run's files: what an out dir holds, parsed, with what is absent or damaged named.

Reads what `nsa_jax.train.artifacts` writes into a run's out dir (the schema:
nsa_jax/rundir/files.py):
  training.csv              one row per step (header row; a header-less file is read
                            in the documented column order)
  val.csv                   optional: step and val_loss (or loss) per evaluation; without
                            it validation comes from the val_loss column of training.csv
  long_eval.csv             optional: the eval.suites figures per evaluation
  heartbeat_rank<r>.jsonl   events with step, ts and memory (bytes_in_use per process)
  env.json                  the configuration (train.steps, logging.*) and process count
  .HALT, .anomaly_type      written by the trainer (or a watchdog) to stop a run

`load_run` never raises on bad file contents: missing or partial artifacts (a run
still writing, a run that died) are named in `Run.missing`, `Run.problems`,
`Run.notes` and `Run.partial`, which the judging (criteria.py) weighs.
`resolve_run_dir(path, require_run=True)` refuses a folder that holds no run (naming
the runs inside it, if any). Plain Python over files: no jax, no plotting.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any, Sequence

from nsa_jax.rundir import files as rf

# The file schema (columns, event names) is nsa_jax/rundir/files.py, shared with the trainer.
CSV_COLUMNS = rf.DOCUMENTED_COLUMNS
# Beyond this many malformed lines per file the rest are counted, not listed.
_MAX_PROBLEM_LINES = 5


class RunPathError(ValueError):
    """A run path that does not exist or is not a run directory."""


# How many runs a refusal names before it counts the rest.
_MAX_RUNS_NAMED = 6
_INCOMPLETE = "last line incomplete"


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


def memory_points(events: list[dict], step_end_only: bool = True) -> list[tuple[int, int, int]]:
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
    return {r: p for r, evs in sorted(run.heartbeats.items()) if (p := memory_points(evs))}
