"""Run reports and sweeps: `launch.report`, `launch.sweep`, `nsa_jax.report`.

The real artifacts come from one short sweep (two 6-step tiny runs and one variant
that fails at config time), run once per module; edge cases use hand-written artifacts.
Expected figures are recomputed here from the files with csv/json/numpy only.
"""

from __future__ import annotations

import csv
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from launch import report as R
from launch import sweep as SW
from nsa_jax.config import load_config
from nsa_jax.report import criteria as C
from nsa_jax.report import plots as P
from nsa_jax.report import reading as RD

from helpers import TINY_RUN, cpu_env, set_flags

ROOT = pathlib.Path(__file__).resolve().parent.parent

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TINY = ["--config", "cpu_tiny", "--steps", "6"] + set_flags(
    [*TINY_RUN, "train.log_every=1", "train.eval_every=3", "train.eval_batches=1"]
)
LAST = 4


def _env(cache_dir: pathlib.Path) -> dict[str, str]:
    # One CPU device; the persistent compilation cache lets the second variant (and
    # later test sessions) skip XLA compilation of the identical step.
    return cpu_env(1, cache_dir)


@pytest.fixture(scope="module")
def sweep(request, tmp_path_factory):
    try:
        cache = request.config.cache.mkdir("nsa_jax_compile_cache")
    except AttributeError:  # cache provider disabled
        cache = tmp_path_factory.mktemp("compile_cache")
    root = tmp_path_factory.mktemp("sweep")
    cmd = [
        sys.executable,
        "-m",
        "launch.sweep",
        "--set-values",
        "train.seed=1,bad,2",
        "--out-root",
        str(root),
        "--last",
        str(LAST),
        "--",
        *TINY,
    ]
    r = subprocess.run(cmd, cwd=ROOT, env=_env(cache), capture_output=True, text=True, timeout=600)
    return root, r


@pytest.fixture
def run_dir(sweep) -> pathlib.Path:
    root, r = sweep
    d = root / "train.seed=1"
    assert (d / "training.csv").is_file(), r.stdout[-3000:] + r.stderr[-3000:]
    return d


def read_csv_dicts(path: pathlib.Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def col(rows: list[dict[str, str]], name: str) -> np.ndarray:
    return np.array([float(r[name]) for r in rows if r[name] != ""])


def assert_png_drawn(path: pathlib.Path) -> None:
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == PNG_SIGNATURE, path
    img = imread(path)[..., :3]
    assert img.shape[0] > 100 and img.shape[1] > 100
    # Not blank: a good share of non-white pixels and some of the first series colour (C0 = #1f77b4).
    assert (img.min(axis=-1) < 0.9).mean() > 0.01, path
    c0 = np.array([0x1F, 0x77, 0xB4]) / 255
    assert (np.abs(img - c0).max(axis=-1) < 0.08).sum() > 30, path


# ---------------------------------------------------------------------------
# hand-written artifacts


def write_run(
    d: pathlib.Path,
    n: int = 40,
    *,
    toks=None,
    step_time=None,
    loss=None,
    gates=True,
    mem=None,
    entropy=None,
    csv_rows: bool = True,
    heartbeats: bool = True,
    env: bool = True,
    done: bool = True,
    extra_events=(),
    header: bool = True,
) -> pathlib.Path:
    """A run of n steps in the trainer's formats; series default to a healthy run."""
    d.mkdir(parents=True, exist_ok=True)
    steps = list(range(1, n + 1))
    toks = toks or [1000.0 + (s % 3) for s in steps]
    step_time = step_time or [0.5 + 0.001 * (s % 2) for s in steps]
    loss = loss or [5.0 - 0.05 * s for s in steps]
    mem = mem or [2 * C.GIB] * n
    entropy = entropy or [1.08] * n
    cols = list(RD.CSV_COLUMNS if gates else RD.CSV_COLUMNS[:11])
    if csv_rows:
        lines = [",".join(cols)] if header else []
        for i, s in enumerate(steps):
            row = {
                "step": s,
                "loss": loss[i],
                "lr": 1e-3,
                "toks_per_s": toks[i],
                "grad_norm": 1.0,
                "step_time_s": step_time[i],
                "tokens": s * 512,
                "elapsed_s": s * 0.5,
                "skipped": int(not math.isfinite(loss[i])),
                "val_loss": "",
                "eval_s": "",
                "gate_cmp": 0.4,
                "gate_slc": 0.5,
                "gate_win": 0.6,
                "gate_entropy": entropy[i],
                "sel_far_frac": 0.3,
                "cmp_k_ratio": 0.8,
                "cmp_v_ratio": 0.5 + 0.01 * s,
            }
            lines.append(",".join(str(row[c]) for c in cols))
        (d / "training.csv").write_text("\n".join(lines) + "\n")
    if heartbeats:
        t = 1000.0
        evs = [{"event": "boot", "step": 0, "tokens_per_step": 512}, {"event": "compile", "step": 0}]
        for i, s in enumerate(steps):
            evs += [
                {"event": "step_start", "step": s},
                {"event": "step_end", "step": s, "loss": loss[i], "step_time_s": step_time[i], "_mem": mem[i]},
                {"event": "progress", "step": s},
            ]
        evs += list(extra_events)
        if done:
            evs.append({"event": "done", "step": n, "steps_done": n, "halted": None})
        with open(d / "heartbeat_rank0.jsonl", "w") as f:
            for e in evs:
                t += 0.5
                m = e.pop("_mem", 2 * C.GIB)
                f.write(
                    json.dumps(
                        {
                            "ts": t,
                            "iso": "x",
                            "pid": 1,
                            "rank": 0,
                            "msg": "",
                            "memory": {"source": "device", "bytes_in_use": m},
                            **e,
                        }
                    )
                    + "\n"
                )
    if env:
        (d / "env.json").write_text(json.dumps({"process_count": 1, "config": {"train": {"steps": n}}}))
    return d


def judge(d: pathlib.Path, last: int = 20, **th) -> C.Summary:
    return C.summarize(RD.load_run(d), last, C.Thresholds(**th))


def status(s: C.Summary) -> dict[str, str]:
    return {c.name: c.status for c in s.criteria}


# ---------------------------------------------------------------------------
# on a real run


def test_csv_columns_match_the_trainer():
    from nsa_jax.rundir.files import AUX_COLUMNS, TRAIN_COLUMNS
    from nsa_jax.train.artifacts import csv_columns

    cfg = load_config("cpu_tiny", [])
    assert RD.CSV_COLUMNS == TRAIN_COLUMNS + AUX_COLUMNS == csv_columns(cfg)


@pytest.mark.slow
def test_summary_figures_match_a_recomputation_from_the_files(run_dir):
    rows = read_csv_dicts(run_dir / "training.csv")
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5, 6]
    win = rows[-LAST:]
    toks, st = col(win, "toks_per_s"), col(win, "step_time_s")
    losses = col(rows, "loss")
    k = min(LAST, len(losses) // 2)
    s = C.summarize(RD.load_run(run_dir), LAST)
    f = s.figures
    assert f["window_n"] == LAST and (f["window_first_step"], f["window_last_step"]) == (3, 6)
    assert f["toks_mean"] == pytest.approx(toks.mean(), rel=1e-9)
    assert f["toks_pstdev"] == pytest.approx(toks.std(ddof=0), rel=1e-9)
    assert f["toks_median"] == pytest.approx(np.median(toks), rel=1e-9)
    # tokens over time: each row's tokens are toks_per_s x step_time_s
    assert f["toks_per_s"] == pytest.approx((toks * st).sum() / st.sum(), rel=1e-6)
    med = np.median(st)
    assert f["step_time_median"] == pytest.approx(med, rel=1e-9)
    assert f["step_time_cv"] == pytest.approx(1.4826 * np.median(np.abs(st - med)) / med, rel=1e-9)
    assert f["loss_first_mean"] == pytest.approx(losses[:k].mean(), rel=1e-9)
    assert f["loss_last_mean"] == pytest.approx(losses[-k:].mean(), rel=1e-9)
    assert f["loss_nonfinite"] == 0
    vals = [(int(r["step"]), float(r["val_loss"])) for r in rows if r["val_loss"]]
    assert [v[0] for v in vals] == [3, 6] == [v[0] for v in s.run.val]
    assert [v[1] for v in s.run.val] == pytest.approx([v[1] for v in vals], rel=1e-9)
    for b in ("cmp", "slc", "win"):
        assert f["gate_means"][b] == pytest.approx(col(win, f"gate_{b}").mean(), rel=1e-9)
    assert f["gate_entropy"] == pytest.approx(col(win, "gate_entropy").mean(), rel=1e-9)

    beats = [json.loads(x) for x in (run_dir / "heartbeat_rank0.jsonl").read_text().splitlines()]
    mem = [b["memory"]["bytes_in_use"] for b in beats if b["event"] == "step_end" and b["step"] >= 3]
    assert len(mem) == LAST
    growth = (np.mean(mem[2:]) - np.mean(mem[:2])) / np.mean(mem[:2])
    assert f["mem_growth"][0] == pytest.approx(growth, rel=1e-9)
    assert f["mem_peak_gib"][0] == pytest.approx(max(b["memory"]["bytes_in_use"] for b in beats) / 2**30)
    assert status(s)["completion"] == "GO" and status(s)["anomalies"] == "GO"
    assert s.state == "finished: 6 of 6 steps"


@pytest.mark.slow
def test_report_cli_prints_criteria_and_writes_plots(run_dir, tmp_path, capsys):
    out = tmp_path / "rep"
    assert R.main([str(run_dir), "--last", str(LAST), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"last {LAST} of 6 steps, steps 3-6, from {run_dir / 'training.csv'}" in text
    crit = [line for line in text.splitlines() if line.startswith("  ")]
    assert [line[9:].split("  ")[0].strip() for line in crit] == [
        "files",
        "completion",
        "throughput",
        "loss",
        "step time",
        "memory",
        "gates",
        "anomalies",
        "heartbeats",
    ]
    assert all(line.split()[0] in ("GO", "NO-GO", "N/A") for line in crit)
    assert "--max-step-cv" in text and text.splitlines()[-2].startswith("verdict: ")
    page = (out / "report.md").read_text()
    for name in ("loss", "throughput", "step_time", "memory", "gates", "selection"):
        assert f"]({name}.png)" in page
        assert_png_drawn(out / f"{name}.png")
    # The default report dir is <OUT>/report.
    assert R.main([str(run_dir / "training.csv")]) == 0
    assert (run_dir / "report" / "report.md").is_file()


@pytest.mark.slow
def test_figures_hold_the_expected_series(run_dir):
    rows = read_csv_dicts(run_dir / "training.csv")
    run = RD.load_run(run_dir)
    summ = C.summarize(run, LAST)
    figs, skipped = P.run_figures(run, summ)
    assert set(figs) == {"loss", "throughput", "step_time", "memory", "gates", "selection"} and not skipped
    (ax,) = figs["loss"].axes
    train, val = ax.lines
    assert list(train.get_xdata()) == [1, 2, 3, 4, 5, 6]
    assert np.allclose(train.get_ydata(), col(rows, "loss"))
    assert list(val.get_xdata()) == [3, 6] and np.allclose(val.get_ydata(), col(rows, "val_loss"))
    (ax,) = figs["throughput"].axes
    series, mean = ax.lines
    assert np.allclose(series.get_ydata(), col(rows, "toks_per_s"))
    win = rows[-LAST:]  # the window's rate: its tokens over its step time
    rate = (col(win, "toks_per_s") * col(win, "step_time_s")).sum() / col(win, "step_time_s").sum()
    assert np.allclose(mean.get_ydata(), rate, rtol=1e-5)
    top, bottom = figs["gates"].axes
    assert [ln.get_label() for ln in top.lines] == ["cmp", "slc", "win"] and len(bottom.lines) == 1
    assert np.allclose(top.lines[1].get_ydata(), col(rows, "gate_slc"))
    assert np.allclose(figs["step_time"].axes[0].lines[0].get_ydata(), col(rows, "step_time_s") * 1e3)
    assert len(figs["memory"].axes[0].lines) == 1 and len(figs["selection"].axes[0].lines) == 1


@pytest.mark.slow
def test_partial_run_reports_what_is_there(run_dir, tmp_path, capsys):
    d = tmp_path / "partial"
    shutil.copytree(run_dir, d, ignore=shutil.ignore_patterns("report", "tb"))
    text = (d / "training.csv").read_text()
    (d / "training.csv").write_text(text[: len(text) - len(text.splitlines()[-1]) // 2 - 1])  # cut mid-line
    for p in d.glob("heartbeat_rank*.jsonl"):
        p.unlink()
    (d / "env.json").unlink()
    assert R.main([str(d), "--last", str(LAST)]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in out
    assert "missing: env.json; heartbeat_rank*.jsonl" in out
    # No 'done' event: the cut line may still be being written, a note (stderr), no damage.
    assert f"note: {d}: training.csv: last line incomplete" in err
    assert "GO     files" in out and "problem" not in out
    assert f"last {LAST} of 5 steps, steps 2-5" in out
    s = C.summarize(RD.load_run(d), LAST)
    assert status(s)["heartbeats"] == "NO-GO" and status(s)["memory"] == "N/A"
    assert status(s)["completion"] == "NO-GO" and "no 'done' event" in s.state
    page = (d / "report" / "report.md").read_text()
    assert "memory (no heartbeat memory readings)" in page and (d / "report" / "loss.png").is_file()


@pytest.mark.slow
def test_rows_come_from_heartbeats_when_training_csv_is_off(run_dir, tmp_path):
    d = tmp_path / "nocsv"
    shutil.copytree(run_dir, d, ignore=shutil.ignore_patterns("report", "tb", "training.csv"))
    csv_rows = read_csv_dicts(run_dir / "training.csv")
    s = C.summarize(RD.load_run(d), LAST)
    assert s.run.series_path == d / "heartbeat_rank0.jsonl" and "training.csv" in s.run.missing
    assert s.figures["toks_mean"] == pytest.approx(col(csv_rows[-LAST:], "toks_per_s").mean(), rel=1e-4)
    assert status(s)["gates"] == "N/A"


@pytest.mark.slow
def test_missing_path_is_one_error_line(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "launch.report", str(tmp_path / "nope")],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [f"error: no such run directory: {tmp_path / 'nope'}"]


# ---------------------------------------------------------------------------
# verdicts on hand-written artifacts


def test_healthy_run_is_go_on_every_criterion(tmp_path, capsys):
    d = write_run(tmp_path / "ok")
    assert R.main([str(d), "--last", "20", "--strict"]) == 0
    assert R.main([str(d), "--last", "20", "--strict", "--min-toks-per-s", "5000"]) == 1
    assert "NO-GO  throughput" in capsys.readouterr().out
    s = judge(d)
    assert set(status(s).values()) == {"GO"} and s.verdict == "GO"
    toks = [1000.0 + (x % 3) for x in range(21, 41)]
    assert s.figures["toks_mean"] == pytest.approx(np.mean(toks)) and s.figures["toks_n"] == 20


def test_header_less_csv_is_read_in_the_documented_order(tmp_path):
    s = judge(write_run(tmp_path / "nohead", header=False))
    assert s.figures["toks_mean"] == pytest.approx(np.mean([1000.0 + (x % 3) for x in range(21, 41)]))


def test_halts_anomalies_and_non_finite_loss_are_no_go(tmp_path):
    loss = [5.0 - 0.05 * s for s in range(1, 41)]
    loss[30] = math.nan
    extra = [
        {"event": "anomaly", "step": 31, "anomaly_type": "nan_loss", "msg": "non-finite loss"},
        {"event": "watchdog_dump", "step": 31, "msg": "stack dump"},
    ]
    d = write_run(tmp_path / "bad", loss=loss, extra_events=extra, done=False)
    (d / ".HALT").write_text("step 31: non-finite loss\n")
    (d / ".anomaly_type").write_text("nan_loss\n")
    (d / "stackdump_20250101T000000_rank0.txt").write_text("Thread 1\n")
    s = judge(d)
    st = status(s)
    assert st["loss"] == st["anomalies"] == st["completion"] == "NO-GO" and s.verdict == "NO-GO"
    detail = next(c.detail for c in s.criteria if c.name == "anomalies")
    for piece in (
        ".HALT present",
        ".anomaly_type nan_loss",
        "anomaly nan_loss at step 31",
        "watchdog_dump",
        "1 skipped update",
        "1 stack dump: stackdump_20250101T000000_rank0.txt",
    ):
        assert piece in detail


def test_a_stack_dump_asked_for_by_sigusr1_is_a_note_and_a_stall_dump_an_anomaly(tmp_path):
    """The playbook's "attach a stackdump" (SIGUSR1) keeps a healthy run GO, named in the detail; a
    stall's dump (the watchdog's) still turns it NO-GO."""
    asked = [{"event": "watchdog_dump", "step": 20, "msg": "SIGUSR1: stacks in x", "reason": "sigusr1"}]
    d = write_run(tmp_path / "asked", extra_events=asked)
    name = "stackdump_20250101T000000_rank0.txt"
    (d / name).write_text("stack dump: SIGUSR1 (training continues)\ntime: ...\n")
    s = judge(d)
    detail = next(c.detail for c in s.criteria if c.name == "anomalies")
    assert status(s)["anomalies"] == "GO" and s.verdict == "GO", detail
    assert detail.endswith(f"; noted: 1 SIGUSR1 stack dump: {name}"), detail
    stall = [{"event": "watchdog_dump", "step": 20, "msg": "stall", "reason": "stall"}]
    d = write_run(tmp_path / "stall", extra_events=stall)
    (d / name).write_text("stack dump: stall: no training step ended for 900s (ops.stall_seconds=900)\n")
    s = judge(d)
    detail = next(c.detail for c in s.criteria if c.name == "anomalies")
    assert status(s)["anomalies"] == "NO-GO" and "rank0 watchdog_dump at step 20" in detail
    assert f"1 stack dump: {name}" in detail


def test_memory_growth_gates_and_step_time_follow_their_flags(tmp_path):
    mem = [int(2 * C.GIB * (1 + 0.01 * s)) for s in range(1, 41)]  # ~+10% across the last 20 steps
    st = [0.3 if s % 2 else 0.9 for s in range(40)]  # every other step three times as long
    d = write_run(tmp_path / "grow", mem=mem, step_time=st)
    csv_path = d / "training.csv"
    csv_path.write_text(csv_path.read_text().replace(",0.4,0.5,0.6,1.08,", ",0.02,0.97,0.01,0.1,"))
    s = judge(d)
    assert status(s)["memory"] == status(s)["gates"] == status(s)["step time"] == "NO-GO"
    w = mem[20:]
    assert s.figures["mem_growth"][0] == pytest.approx((np.mean(w[10:]) - np.mean(w[:10])) / np.mean(w[:10]))
    loose = judge(d, max_mem_growth=0.5, max_step_cv=10, min_gate_entropy=0.05, max_gate_mean=0.99)
    assert set(status(loose).values()) == {"GO"}
    # The compressed/selection scale is reported (the largest in the window: step 40's 0.9x), not judged.
    assert loose.figures["cmp_v_ratio_max"] == pytest.approx(0.9) and loose.figures["cmp_k_ratio_max"] == 0.8
    gates = next(c for c in loose.criteria if c.name == "gates")
    assert "keys 0.80x, values 0.90x" in gates.detail and "above" not in gates.detail
    assert judge(d, max_mem_gib=1.0).criteria[4].status == "NO-GO"
    assert status(judge(d, min_toks_per_s=5000))["throughput"] == "NO-GO"
    # The halves differ by 0.2 GiB: a leak above a 0.1 GiB floor, none under a 0.3 GiB one.
    assert status(judge(d, mem_growth_floor_gib=0.3))["memory"] == "GO"


def test_a_small_process_drifting_tens_of_mib_is_no_leak(tmp_path):
    # A CPU run's 0.5 GiB of RSS growing 10% (50 MiB) across the window: allocator drift, under the 0.1 GiB floor.
    small = [int(0.5 * C.GIB * (1 + 0.01 * s)) for s in range(1, 41)]
    s = judge(write_run(tmp_path / "small", mem=small))
    assert s.figures["mem_growth"][0] > 0.05 and status(s)["memory"] == "GO"
    assert "0.1 GiB (--mem-growth-floor-gib)" in next(c.detail for c in s.criteria if c.name == "memory")
    assert status(judge(write_run(tmp_path / "big", mem=[4 * m for m in small])))["memory"] == "NO-GO"


def test_a_few_odd_steps_do_not_move_the_step_time_and_throughput_figures(tmp_path):
    # 2 of 40 steps 10x slower (an evaluation compile, say) and one 100x faster: median-based
    # figures stay those of the typical step, tokens / time counts every step once.
    st = [0.5] * 40
    st[25], st[30], st[35] = 5.0, 5.0, 0.005
    d = write_run(tmp_path / "odd", step_time=st, toks=[512 / t for t in st])
    s = judge(d)
    assert status(s)["step time"] == "GO"
    assert s.figures["step_time_median"] == pytest.approx(0.5) and s.figures["step_time_max"] == pytest.approx(5.0)
    rows = read_csv_dicts(d / "training.csv")[-20:]
    toks, times = col(rows, "toks_per_s"), col(rows, "step_time_s")
    assert s.figures["toks_per_s"] == pytest.approx((toks * times).sum() / times.sum(), rel=1e-6)
    assert s.figures["toks_per_s"] < s.figures["toks_median"] < s.figures["toks_mean"]


def test_pause_before_a_resume_is_no_stall_but_a_silence_mid_run_is(tmp_path):
    d = write_run(tmp_path / "resumed", n=10)
    beats = [json.loads(x) for x in (d / "heartbeat_rank0.jsonl").read_text().splitlines()]
    later = [{**b, "ts": b["ts"] + 5000} for b in beats]  # the same run resumed 5000 s later
    (d / "heartbeat_rank0.jsonl").write_text("".join(json.dumps(b) + "\n" for b in beats + later))
    assert status(judge(d))["heartbeats"] == "GO"
    later[10]["ts"] += 1000  # a step that took 1000 s after the resume
    (d / "heartbeat_rank0.jsonl").write_text("".join(json.dumps(b) + "\n" for b in beats + later))
    s = judge(d)
    assert status(s)["heartbeats"] == "NO-GO" and s.figures["heartbeat_max_gap_s"] == pytest.approx(1000.5)


def test_malformed_lines_are_skipped_and_named(tmp_path):
    d = write_run(tmp_path / "mal", n=10)
    lines = (d / "training.csv").read_text().splitlines()
    lines[4] = "4,5.0,oops"
    (d / "training.csv").write_text("\n".join(lines) + "\n")
    with open(d / "heartbeat_rank0.jsonl", "a") as f:
        f.write('{"event": "step_end", "st\n')
    run = RD.load_run(d)
    assert [int(r["step"]) for r in run.rows] == [1, 2, 3, 5, 6, 7, 8, 9, 10]
    assert any("line 5 has 3 fields" in p for p in run.problems)
    assert any("heartbeat_rank0.jsonl: line" in p and "not valid JSON" in p for p in run.problems)


def test_ranking_prefers_higher_mean_and_breaks_ties_on_spread(tmp_path, capsys):
    a = write_run(tmp_path / "a", toks=[1005.0 + (10 if s % 2 else -10) for s in range(40)])  # mean 1005, sd 10
    b = write_run(tmp_path / "b", toks=[1000.0 + (1 if s % 2 else -1) for s in range(40)])  # mean 1000, sd 1
    c = write_run(tmp_path / "c", toks=[900.0] * 40)

    def order(*flags):
        assert R.main([str(a), str(b), str(c), "--last", "20", *flags]) == 0
        text = capsys.readouterr().out
        table = text[text.index("rank  run") :].splitlines()[2:5]
        return [line.split()[1] for line in table], text

    ranked, text = order()
    assert ranked == ["b", "a", "c"]  # within 1%: lower spread first
    assert "best: b" in text and (tmp_path / "comparison" / "comparison.md").is_file()
    assert order("--tie-pct", "0")[0] == ["a", "b", "c"]


def _tree(root: pathlib.Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_a_folder_that_is_not_a_run_is_refused_and_nothing_is_written(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert R.main([str(empty)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        f"error: {empty} is not a run folder (no training.csv, env.json or heartbeat_rank*.jsonl) and holds no "
        "run: pass the out dir of a launch.train run (--out-dir, train.out_dir)"
    ]
    assert not any(empty.iterdir())
    # The parent of runs: the error names them; a run given next to it does not make it pass.
    parent = tmp_path / "runs"
    a, b = write_run(parent / "a", n=10), write_run(parent / "b", n=10)
    before = _tree(tmp_path)
    for argv in ([str(parent)], [str(a), str(parent)], [str(parent), "--out", str(tmp_path / "rep")]):
        assert R.main(argv) == 2, argv
        out, err = capsys.readouterr()
        assert out == "" and err.splitlines() == [
            f"error: {parent} is not a run folder (no training.csv, env.json or heartbeat_rank*.jsonl); "
            f"runs inside it: {a}, {b}: pass one of them, or several to compare them"
        ], argv
    assert _tree(tmp_path) == before
    # One run two levels down (a sweep's root under a folder) is found and named.
    assert R.main([str(tmp_path)]) == 2
    assert f"runs inside it: {a}, {b}: pass one" in capsys.readouterr().err
    only = write_run(tmp_path / "solo" / "deeper" / "r", n=10)
    assert R.main([str(tmp_path / "solo")]) == 2
    assert capsys.readouterr().err.strip().endswith(f"runs inside it: {only}: pass it")
    # A run folder passes: a folder with a run file or checkpoints/ is a run.
    assert R.main([str(a), "--last", "5"]) == 0
    assert (a / "report" / "report.md").is_file()
    ckpt_only = tmp_path / "ckpt_only"
    (ckpt_only / "checkpoints").mkdir(parents=True)
    assert RD.is_run_dir(ckpt_only) and not RD.is_run_dir(empty)


def _problem_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(("problem", "warning"))]


def test_a_problem_reading_the_files_is_never_next_to_go(tmp_path, capsys):
    # A run that never evaluated (val.csv holds its header alone) is no problem: GO.
    d = write_run(tmp_path / "noeval")
    (d / "val.csv").write_text("step,tokens,val_loss,val_ppl,retrieval_acc,answers,elapsed_s,eval_s\n")
    env = json.loads((d / "env.json").read_text())
    env["config"]["train"]["eval_every"] = 100
    (d / "env.json").write_text(json.dumps(env))
    assert R.main([str(d), "--last", "20", "--strict"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and not _problem_lines(out) and out.splitlines()[-2] == "verdict: GO"
    assert "no evaluation yet (val.csv has no rows; train.eval_every=100)" in out
    # A malformed line: a warning on stderr, `files` NO-GO, so the verdict is NO-GO.
    lines = (d / "training.csv").read_text().splitlines()
    lines[4] = "4,5.0,oops"
    (d / "training.csv").write_text("\n".join(lines) + "\n")
    assert R.main([str(d), "--last", "20", "--strict"]) == 1
    out, err = capsys.readouterr()
    assert err.splitlines() == [f"warning: {d}: training.csv: line 5 has 3 fields, header 18; skipped"]
    assert not _problem_lines(out)  # the problem is on stderr and in the files criterion
    assert "  NO-GO  files       1 problem reading training.csv (each listed as a problem)" in out
    assert out.splitlines()[-2] == "verdict: NO-GO (files)"
    s = judge(d)
    assert s.verdict == "NO-GO" and s.failing() == ["files"] and status(s)["throughput"] == "GO"
    page = (d / "report" / "report.md").read_text()
    assert "- problem: training.csv: line 5 has 3 fields" in page and "**NO-GO**" in page
    # A cut-off last line: a note while the run goes on, a problem once it has finished.
    for done, want in ((False, "note"), (True, "problem")):
        r = write_run(tmp_path / f"cut_{done}", done=done)
        text = (r / "training.csv").read_text()
        (r / "training.csv").write_text(text[:-10])
        s = judge(r)
        assert status(s)["files"] == ("NO-GO" if done else "GO"), (done, s.criteria[0])
        assert (s.problems, s.notes)[want == "note"][0].startswith("training.csv: last line ")
        assert not (s.problems if want == "note" else s.notes)
    # Every summary: a problem line implies a NO-GO verdict.
    for run in tmp_path.iterdir():
        s = judge(run)
        assert not s.problems or s.verdict == "NO-GO", run


def test_plot_axes_read_as_values(tmp_path):
    """No offset notation ('1e-5+1.0985') on any axis; a series flat up to float noise is drawn flat."""
    n = 40
    ent = [1.0986 + 1e-6 * (s % 3) for s in range(n)]  # the gate entropy at ln 3, float noise around it
    mem = [int(2 * C.GIB) + 4096 * (s % 2) for s in range(n)]  # a constant memory reading, to 4 KiB
    d = write_run(tmp_path / "flat", n=n, entropy=ent, mem=mem)
    run = RD.load_run(d)
    figs, _ = P.run_figures(run, C.summarize(run, 20))
    compared, _ = P.comparison_figures([run, RD.load_run(write_run(tmp_path / "b"))])
    figs.update({f"cmp_{k}": f for k, f in compared.items()})
    res = {"by_length": {"128": {"edges": [0, 1, 2, 4, 128], "loss": [2.0000001, 2.0000002, 2.0, 2.0000001]}}}
    figs["loss_by_position"] = P.loss_by_position_figure(res)
    for name, fig in figs.items():
        fig.canvas.draw()
        for ax in fig.axes:
            for axis in (ax.xaxis, ax.yaxis):
                assert axis.get_offset_text().get_text() == "", (name, axis.get_offset_text().get_text())
            labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
            assert len(set(labels)) == len(labels) > 1, (name, labels)
            lo, hi = ax.get_ylim()
            assert hi - lo >= 0.01 * abs(lo + hi) / 2, (name, lo, hi)
    entropy_ax = figs["gates"].axes[1]
    labels = [float(t.get_text().replace("\u2212", "-")) for t in entropy_ax.get_yticklabels()]
    assert np.allclose(labels, entropy_ax.get_yticks(), rtol=0, atol=1e-9)  # the labels are the values
    # Late steps of a resumed run and tiny values: no '+1e5' offset, no '1e-6' factor either.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure()
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.plot(np.arange(100_000, 100_040), 1e-7 * np.arange(40))
    P.readable(fig).canvas.draw()
    assert ax.xaxis.get_offset_text().get_text() == ax.yaxis.get_offset_text().get_text() == ""
    assert "100000" in [t.get_text() for t in ax.get_xticklabels()]


# ---------------------------------------------------------------------------
# sweep


@pytest.mark.slow
def test_sweep_runs_variants_and_ends_with_the_ranked_table(sweep):
    root, r = sweep
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]  # one variant failed
    out = r.stdout
    assert "Traceback" not in out
    for name in ("train.seed=1", "train.seed=2"):
        assert (root / name / "training.csv").is_file() and (root / "logs" / f"{name}.log").is_file()
    assert not (root / "train.seed=bad").exists()
    # The failing middle variant did not stop the third one.
    assert out.index("== [2/3] train.seed=bad: failed (exit 2)") < out.index("== [3/3] train.seed=2:")
    table = out[out.index("rank  run") :].splitlines()
    body = [line.split() for line in table[2:5]]
    means = {}  # tokens over step time of the window: each row's tokens are toks_per_s x step_time_s
    for n in ("train.seed=1", "train.seed=2"):
        rows = read_csv_dicts(root / n / "training.csv")[-LAST:]
        toks, st = col(rows, "toks_per_s"), col(rows, "step_time_s")
        means[n] = (toks * st).sum() / st.sum()
    expect = sorted(means, key=lambda n: -means[n])
    if abs(means[expect[0]] - means[expect[1]]) <= 0.01 * means[expect[0]]:
        pytest.skip("rates tie within 1%; order then depends on the spread")
    assert [b[1] for b in body[:2]] == expect and [b[0] for b in body[:2]] == ["1", "2"]
    assert float(body[0][3].replace(",", "")) == pytest.approx(means[expect[0]], abs=0.06)
    assert body[2][:4] == ["-", "train.seed=bad", "failed", "(exit"]
    assert "train.seed=bad: exit 2: error: config: train.seed must be an integer" in out
    page = (root / "comparison" / "comparison.md").read_text()
    assert "| rank | run |" in page and "](throughput.png)" in page
    assert_png_drawn(root / "comparison" / "throughput.png")
    figs, _ = P.comparison_figures([RD.load_run(root / n, n) for n in expect])
    assert [ln.get_label() for ln in figs["throughput"].axes[0].lines] == expect


def test_sweep_argument_errors_are_one_line(tmp_path, capsys):
    for argv in (
        ["--set-values", "train.seed", "--", "--config", "cpu_tiny"],
        ["--set-values", "train.seed=1,1"],
        ["--set-values", "train.seed=1,2", "--", "--out-dir", str(tmp_path)],
        ["--set-values", "train.seed=1,2", "--", "--set", "train.out_dir=x"],
    ):
        assert SW.main(argv) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), (argv, err)
    assert (
        SW.main(
            [
                "--set-values",
                "parallel.bucket_mb=25,50",
                "--out-root",
                str(tmp_path),
                "--dry-run",
                "--",
                "--config",
                "cpu_tiny",
            ]
        )
        == 0
    )
    cmds = capsys.readouterr().out.splitlines()
    assert len(cmds) == 2 and cmds[1].endswith(
        f"-m launch.train --config cpu_tiny --set parallel.bucket_mb=50 --out-dir {tmp_path / 'parallel.bucket_mb=50'}"
    )


def test_sweep_comparison_puts_problems_on_stderr(tmp_path, capsys):
    good = write_run(tmp_path / "a")
    bad = write_run(tmp_path / "b")
    lines = (bad / "training.csv").read_text().splitlines()
    lines[4] = "4,5.0,oops"
    (bad / "training.csv").write_text("\n".join(lines) + "\n")
    entries = [C.Entry(d.name, C.summarize(RD.load_run(d, d.name), 20)) for d in (good, bad)]
    SW.print_comparison(entries, 20, 1.0)
    out, err = capsys.readouterr()
    assert err.splitlines() == [f"warning: {bad}: training.csv: line 5 has 3 fields, header 18; skipped"]
    assert "rank  run" in out and "warning:" not in out


def test_the_heartbeat_memory_keeps_each_device_where_the_backend_reports_it(monkeypatch):
    """Two GPUs of different use: the max (what the gates read) and each device's bytes (the balance)."""
    import nsa_jax.train.artifacts as A

    class Dev:
        def __init__(self, used):
            self.used = used

        def memory_stats(self):
            return {"bytes_in_use": self.used, "peak_bytes_in_use": 2 * self.used}

    monkeypatch.setattr(A.jax, "local_devices", lambda: [Dev(3 << 30), Dev(5 << 30)])
    snap = A.memory_snapshot()
    assert snap == {
        "source": "device", "bytes_in_use": 5 << 30, "peak_bytes_in_use": 10 << 30, "per_device": [3 << 30, 5 << 30]
    }  # fmt: skip
    monkeypatch.setattr(A.jax, "local_devices", lambda: [type("Cpu", (), {"memory_stats": lambda self: None})()])
    assert A.memory_snapshot()["source"] == "process_rss"


def test_gates_started_on_purpose_are_shown_not_judged(tmp_path):
    """launch.convert's NSA start (gate biases [-6, 6, -6]: the selection branch carries the dense
    attention) is far past the collapse limits by design: the gates line says so and stays out of the
    verdict; without gate_bias_init the same gates are NO-GO."""
    d = write_run(tmp_path / "converted")
    csv_path = d / "training.csv"
    csv_path.write_text(csv_path.read_text().replace(",0.4,0.5,0.6,1.08,", ",0.0025,0.995,0.0025,0.04,"))
    assert status(judge(d))["gates"] == "NO-GO"
    nsa = {"gate_bias_init": [-6.0, 6.0, -6.0], "branches": ["cmp", "slc", "win"]}
    env = {"process_count": 1, "config": {"train": {"steps": 40}, "model": {"nsa": nsa}}}
    (d / "env.json").write_text(json.dumps(env))
    s = judge(d)
    gates = next(c for c in s.criteria if c.name == "gates")
    assert gates.status == "N/A" and s.verdict == "GO", gates.detail
    assert gates.detail.startswith("started on purpose at cmp 0.002, slc 0.998, win 0.002 (model.nsa.gate_bias_init)")
    assert "window means cmp 0.003, slc 0.995, win 0.003" in gates.detail
