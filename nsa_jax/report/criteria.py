"""Judging a run: the runbooks' hand judgements over its parsed files, each GO / NO-GO / N/A.

  files        every artifact read cleanly: a malformed or cut-off line, an unreadable
               env.json is a problem, and a problem is NO-GO (the figures below rest
               on what could be read); the last line of a run still writing is a note
  completion   the run reached train.steps without a halt
  throughput   total tokens over total step time, and the median step, over the last N steps
  loss         every loss finite; mean of the last k steps below the mean of the first k
  step time    robust coefficient of variation (1.4826 MAD / median) of step_time_s over the last N
  memory       per-rank bytes_in_use growth across the window, and the peak, from heartbeats
  gates        gate entropy and the largest branch gate mean (aux columns) over the window
  anomalies    .HALT, .anomaly_type, stackdump_*.txt, anomaly / halt / watchdog_dump /
               loader_timeout events, skipped (non-finite) updates
  heartbeats   every rank's file present with step_end events, progress on rank 0, no
               long silence between events

`summarize(run)` judges one run read by reading.py `load_run`; the verdict is GO only when no criterion
is NO-GO, files included: a `problem` never stands next to a GO. `rank_entries` orders several runs by
throughput; text.py writes the result. Plain Python: no jax, no plotting.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import statistics
import time
from typing import Any, Iterable, Sequence

from nsa_jax.report.reading import Run, memory_points, memory_series
from nsa_jax.rundir import files as rf
from nsa_jax.words import count

GATE_COLUMNS = rf.GATE_COLUMNS
ANOMALY_EVENTS = rf.ANOMALY_EVENTS
GO, NO_GO, NA = "GO", "NO-GO", "N/A"
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """Limits of the go/no-go criteria; each is a `launch.report` flag of the same name."""

    min_toks_per_s: float = 0.0
    min_loss_drop: float = 0.0
    max_step_cv: float = 0.25
    max_mem_growth: float = 0.05
    # A few tens of MiB of allocator drift is 5% of a small process (a CPU run's 0.5 GiB of RSS) but no leak.
    mem_growth_floor_gib: float = 0.1
    max_mem_gib: float = 60.0
    min_gate_entropy: float = 0.5
    max_gate_mean: float = 0.95
    max_heartbeat_gap_s: float = 600.0


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


def _steps_of(n: int, target: int | None) -> str:
    """'40 of 200 steps', or '40 steps' without a target."""
    return f"{n} of {count(target, 'step')}" if target else count(n, "step")


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
        return f"finished: {_steps_of(steps_done, target)}", info
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
        window = f"last {len(window_rows)} of {count(len(run.rows), 'step')}{short}, steps {a}-{b}, from {src}"
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
            f"{count(len(problems), 'problem')} reading {', '.join(names)} (each listed as a problem); "
            f"the other criteria judge what could be read"
        )
        return Criterion("files", NO_GO, detail), problems, notes
    note = f"; {count(len(notes), 'note')}, listed as notes" if notes else ""
    return Criterion("files", GO, f"read cleanly: {', '.join(run.read)}{note}"), problems, notes


def _completion(run: Run, info: dict[str, Any]) -> Criterion:
    target, last, halted = info["target_steps"], info["last_step"], info["halted"]
    if halted:
        return Criterion("completion", NO_GO, f"halted ({halted}) after step {last}")
    if info["finished"]:
        if target is None:
            return Criterion("completion", GO, f"finished at step {last} (target unknown: env.json missing)")
        ok = last is not None and last >= target
        return Criterion("completion", GO if ok else NO_GO, _steps_of(last, target))
    if last is None:
        return Criterion("completion", NA, "no step recorded")
    if target is not None and last >= target and not run.heartbeats:
        return Criterion("completion", GO, f"{_steps_of(last, target)} in training.csv (no heartbeats)")
    return Criterion("completion", NO_GO, f"not finished: {_steps_of(last, target)}, no 'done' event")


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
        f"{overall:,.1f} tok/s ({how}), median step {median:,.1f} tok/s over {count(len(vals), 'step')}; {floor}",
    )


def _loss(run: Run, last: int, th: Thresholds, fig: dict) -> Criterion:
    losses = [r.get("loss") for r in run.rows]
    losses = [v for v in losses if v is not None]
    bad = [int(r["step"]) for r in run.rows if r.get("loss") is not None and not math.isfinite(r["loss"])]
    fig["loss_nonfinite"] = len(bad)
    val = ""
    if run.val:
        fig.update(val_first=run.val[0][1], val_last=run.val[-1][1], val_n=len(run.val))
        val = f"; val {run.val[0][1]:.4f} -> {run.val[-1][1]:.4f} ({count(len(run.val), 'eval')}, {run.val_source})"
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
        f"mean of first {count(k, 'step')} {m0:.4f} -> last {k} {m1:.4f} "
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
        f"{count(slow, 'step')} over 2x median",
    )


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
        peak = max(p[2] for p in memory_points(run.heartbeats[rank], step_end_only=False)) / GIB
        peaks[rank] = peak
        src = next((e["memory"].get("source") for e in run.heartbeats[rank] if isinstance(e.get("memory"), dict)), "?")
        a, b = _halves([p[1] for p in win])
        if not a:
            parts.append(
                f"rank{rank}: {count(len(win), 'reading')} in the window, too few for a trend; peak {peak:.2f} GiB"
            )
            ok = ok and peak <= th.max_mem_gib
            continue
        m0, m1 = statistics.fmean(a), statistics.fmean(b)
        growth = (m1 - m0) / m0 if m0 > 0 else math.inf
        growths[rank] = growth
        leaking = growth > th.max_mem_growth and (m1 - m0) / GIB > th.mem_growth_floor_gib
        ok = ok and not leaking and peak <= th.max_mem_gib
        parts.append(f"rank{rank} ({src}): {m0 / GIB:.2f} -> {m1 / GIB:.2f} GiB ({growth:+.1%}), peak {peak:.2f} GiB")
    fig.update(mem_growth=growths, mem_peak_gib=peaks)
    if not growths and all(p <= th.max_mem_gib for p in peaks.values()):
        status = NA
    else:
        status = GO if ok else NO_GO
    limits = (
        f"limits growth {th.max_mem_growth:.0%} (--max-mem-growth) and {th.mem_growth_floor_gib:g} GiB "
        f"(--mem-growth-floor-gib), peak {th.max_mem_gib:g} GiB (--max-mem-gib)"
    )
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
    text = (
        f"window means {branch}; entropy {e:.3f} nats (max ln3 = {math.log(3):.3f}; "
        f"floor {th.min_gate_entropy:g}, --min-gate-entropy); largest mean {gmax:.3f} "
        f"(limit {th.max_gate_mean:g}, --max-gate-mean){sel}{scale}{bad}"
    )
    nsa = run.config("model", "nsa") or {}
    if nsa.get("gate_bias_init"):
        # A start chosen on purpose (launch.convert's: a dense model's attention through the selection
        # branch, the others gated near 0): the collapse limits are for a run from the default start.
        start = ", ".join(
            f"{b} {1 / (1 + math.exp(-x)):.3f}" for b, x in zip(nsa.get("branches", ()), nsa["gate_bias_init"])
        )
        return Criterion(
            "gates",
            NO_GO if n_bad else NA,
            f"started on purpose at {start} (model.nsa.gate_bias_init), so the collapse limits do not apply; {text}",
        )
    return Criterion("gates", GO if ok else NO_GO, text)


def _asked_for(dump: pathlib.Path) -> bool:
    """Whether a stack dump was asked for (SIGUSR1: the playbook's "attach a stackdump"), not a stall's."""
    try:
        with open(dump, errors="replace") as f:
            return "SIGUSR1" in f.readline()
    except OSError:
        return False


def _anomalies(run: Run, fig: dict) -> Criterion:
    """Anomalies turn a run NO-GO; a stack dump an operator asked for (SIGUSR1) is only noted."""
    found, noted = [], []
    if run.halt is not None:
        found.append(f".HALT present ({run.halt})")
    if run.anomaly_type is not None:
        found.append(f".anomaly_type {run.anomaly_type}")
    for rank, evs in sorted(run.heartbeats.items()):
        for e in evs:
            if e.get("event") == "watchdog_dump" and e.get("reason") == "sigusr1":
                continue  # the dump itself is noted below
            if e.get("event") in ANOMALY_EVENTS:
                kind = f" {e['anomaly_type']}" if e.get("anomaly_type") else ""
                msg = f": {e['msg']}" if e.get("msg") else ""
                found.append(f"rank{rank} {e['event']}{kind} at step {e.get('step')}{msg}")
    all_dumps = sorted(run.path.glob("stackdump_*.txt"))
    for dumps, into, what in (
        ([p.name for p in all_dumps if not _asked_for(p)], found, "stack dump"),
        ([p.name for p in all_dumps if _asked_for(p)], noted, "SIGUSR1 stack dump"),
    ):
        if dumps:
            into.append(f"{count(len(dumps), what)}: {', '.join(dumps[:3])}{'...' if len(dumps) > 3 else ''}")
    skipped = [int(r["step"]) for r in run.rows if r.get("skipped")]
    if skipped:
        found.append(
            f"{count(len(skipped), 'skipped update')} at steps {skipped[:5]}{'...' if len(skipped) > 5 else ''}"
        )
    fig.update(anomalies=len(found), skipped=len(skipped))
    if found:
        shown = found[:6] + ([f"... {len(found) - 6} more"] if len(found) > 6 else [])
        return Criterion("anomalies", NO_GO, "; ".join(shown))
    checked = (
        ".HALT, .anomaly_type, stackdump_*.txt"
        + (", heartbeat events" if run.heartbeats else "")
        + (", skipped column" if run.has_column("skipped") else "")
    )
    return Criterion("anomalies", GO, f"none ({checked})" + (f"; noted: {'; '.join(noted)}" if noted else ""))


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
# several runs


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
