"""launch.watchdog: hand-written artifacts for each anomaly, file-tailing edge cases, and a real run."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

from launch.watchdog import GATE_COLUMNS, LineTail
from nsa_jax.rundir.files import AUX_COLUMNS, TRAIN_COLUMNS

from helpers import LAUNCH_TRAIN, TINY_RUN, set_flags

ROOT = pathlib.Path(__file__).resolve().parent.parent

HEADER = list(TRAIN_COLUMNS + AUX_COLUMNS)
FAST = ["--interval", "0.1"]


def watchdog(run: pathlib.Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "launch.watchdog", "--dir", str(run), *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def beat(run: pathlib.Path, rank: int, event: str, step: int, ts: float | None = None, newline: bool = True, **kw):
    rec = {
        "ts": time.time() if ts is None else ts,
        "iso": "",
        "pid": 1,
        "rank": rank,
        "step": step,
        "event": event,
        "msg": "",
        "memory": {"source": "process_rss", "bytes_in_use": 1},
        **kw,
    }
    with open(run / f"heartbeat_rank{rank}.jsonl", "a") as f:
        f.write(json.dumps(rec) + ("\n" if newline else ""))


def csv_rows(run: pathlib.Path, rows: list[dict], header: list[str] | None = HEADER, mode: str = "w"):
    cols = header or ["step", "loss", "lr", "toks_per_s"]
    with open(run / "training.csv", mode) as f:
        if header is not None and mode == "w":
            f.write(",".join(cols) + "\n")
        for r in rows:
            f.write(",".join("" if r.get(c) is None else str(r[c]) for c in cols) + "\n")


def healthy_row(step: int, **over) -> dict:
    row = {
        "step": step,
        "loss": 3.0,
        "lr": 1e-3,
        "toks_per_s": 1000.0 + step,
        "grad_norm": 0.8,
        "step_time_s": 0.1,
        "tokens": step * 256,
        "elapsed_s": step * 0.1,
        "skipped": 0,
        "val_loss": None,
        "gate_cmp": 0.5,
        "gate_slc": 0.45,
        "gate_win": 0.55,
        "gate_entropy": 1.09,
        "sel_far_frac": 0.2,
    }
    row.update(over)
    return row


def fresh_run(tmp_path: pathlib.Path, rows: list[dict], ranks=(0,)) -> pathlib.Path:
    run = tmp_path / "run"
    run.mkdir(parents=True)
    for r in ranks:
        beat(run, r, "boot", 0)
        for row in rows:
            beat(run, r, "step_end", row["step"])
    csv_rows(run, rows)
    return run


def halt_files(run: pathlib.Path) -> tuple[str, str]:
    return (run / ".anomaly_type").read_text().strip(), (run / ".HALT").read_text().strip()


def test_watchdog_reads_the_columns_the_trainer_writes():
    assert {"toks_per_s", "grad_norm", "gate_entropy", *GATE_COLUMNS} <= set(HEADER)
    assert HEADER[3] == "toks_per_s"  # torch runbook scripts read column 3


@pytest.mark.slow
def test_stalled_heartbeat_halts(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    old = time.time() - 120
    for r in (0, 1):
        beat(run, r, "boot", 0, ts=old - 10)
    beat(run, 0, "step_end", 1, ts=old)
    beat(run, 0, "step_start", 2, ts=time.time())  # rank 0 lives
    beat(run, 1, "step_end", 1, ts=old)  # rank 1: stuck since two minutes
    beat(run, 1, "step_start", 2, ts=old, newline=False)  # half-written last line
    # A long startup grace: only the events' own timestamps can reveal the stall, so the
    # heartbeat files must really be read (the torch watchdog never saw them).
    r = watchdog(run, "--halt", "1", "--stall-seconds", "30", "--startup-grace", "3600", *FAST)
    assert r.returncode == 1, r.stdout + r.stderr
    kind, why = halt_files(run)
    assert kind == "heartbeat_stall"
    assert why.startswith("watchdog: rank 1: no heartbeat for 1") and "step_end" in why, why


@pytest.mark.slow
def test_no_stall_while_heartbeats_are_fresh(tmp_path):
    run = fresh_run(tmp_path, [healthy_row(s) for s in range(1, 20)], ranks=(0, 1))
    r = watchdog(run, "--halt", "1", "--stall-seconds", "30", "--once")
    assert r.returncode == 0, r.stdout + r.stderr
    assert not (run / ".HALT").exists() and "ok: rank 0 step 19" in r.stdout


@pytest.mark.slow
def test_trainer_stall_dump_is_a_stall_at_once(tmp_path):
    run = fresh_run(tmp_path, [healthy_row(s) for s in range(1, 5)])
    beat(run, 0, "watchdog_dump", 4, reason="stall", path="x")
    r = watchdog(run, "--halt", "1", "--stall-seconds", "600", *FAST)
    assert r.returncode == 1 and halt_files(run)[0] == "heartbeat_stall", r.stdout
    assert "stall watchdog fired after step 4" in halt_files(run)[1]


@pytest.mark.parametrize(
    "tail,expect",
    [
        ([0.0, 0.0, 0.0], "toks_per_s under 1"),
        ([50.0, 40.0, 45.0], "under 0.1 x the median"),
    ],
)
@pytest.mark.slow
def test_throughput_flatline_halts(tmp_path, tail, expect):
    rows = [healthy_row(s) for s in range(1, 31)]
    rows += [healthy_row(31 + i, toks_per_s=v) for i, v in enumerate(tail)]
    run = fresh_run(tmp_path, rows)
    r = watchdog(run, "--halt", "1", *FAST)
    assert r.returncode == 1, r.stdout + r.stderr
    kind, why = halt_files(run)
    assert kind == "throughput_flatline" and expect in why, why


@pytest.mark.slow
def test_throughput_dip_shorter_than_patience_is_ignored(tmp_path):
    rows = [healthy_row(s) for s in range(1, 31)]
    rows[-2]["toks_per_s"] = 0.0  # one slow step (an evaluation, a checkpoint save)
    run = fresh_run(tmp_path, rows)
    assert watchdog(run, "--halt", "1", "--once").returncode == 0
    assert not (run / ".HALT").exists()


@pytest.mark.parametrize(
    "over,expect",
    [
        ({"gate_entropy": 0.05}, "gate_entropy under 0.2"),
        ({"gate_slc": 0.999}, "largest gate mean over 0.99"),
    ],
)
@pytest.mark.slow
def test_gate_collapse_halts(tmp_path, over, expect):
    rows = [healthy_row(s) for s in range(1, 10)] + [healthy_row(s, **over) for s in range(10, 13)]
    run = fresh_run(tmp_path, rows)
    r = watchdog(run, "--halt", "1", *FAST)
    assert r.returncode == 1
    kind, why = halt_files(run)
    assert kind == "gate_collapse" and expect in why, why


@pytest.mark.slow
def test_zero_grad_norm_halts_and_report_only_mode_does_not(tmp_path):
    rows = [healthy_row(s) for s in range(1, 5)] + [healthy_row(s, grad_norm=0.0) for s in range(5, 8)]
    run = fresh_run(tmp_path, rows)
    r = watchdog(run, "--halt", "0", "--once")
    assert r.returncode == 1 and "ANOMALY zero_grad_norm" in r.stdout and not (run / ".HALT").exists()
    r = watchdog(run, "--halt", "1", *FAST)
    assert r.returncode == 1 and halt_files(run)[0] == "zero_grad_norm"


@pytest.mark.slow
def test_csv_is_read_by_column_name(tmp_path):
    # Columns in another order, extra ones: a zero grad norm must still be found by name...
    header = ["step", "grad_norm", "loss", "lr", "toks_per_s", "extra"]
    rows = [healthy_row(s) for s in range(1, 4)] + [healthy_row(s, grad_norm=0.0) for s in range(4, 7)]
    run = fresh_run(tmp_path, [])
    csv_rows(run, rows, header=header)
    assert watchdog(run, "--halt", "1", *FAST).returncode == 1 and halt_files(run)[0] == "zero_grad_norm"
    # ...and the torch trainer's header-less file has toks_per_s in column 3.
    legacy = fresh_run(tmp_path / "legacy", [])
    csv_rows(
        legacy,
        [healthy_row(s) for s in range(1, 20)] + [healthy_row(20 + i, toks_per_s=0) for i in range(3)],
        header=None,
    )
    assert watchdog(legacy, "--halt", "1", *FAST).returncode == 1
    assert halt_files(legacy)[0] == "throughput_flatline"


@pytest.mark.slow
def test_halt_written_by_the_trainer_ends_the_watch(tmp_path):
    run = fresh_run(tmp_path, [healthy_row(1)])
    (run / ".anomaly_type").write_text("nan_loss\n")
    (run / ".HALT").write_text("step 2: non-finite loss\n")
    r = watchdog(run, "--halt", "1", *FAST)
    assert r.returncode == 0 and "anomaly type: nan_loss" in r.stdout, r.stdout


def test_line_tail_partial_lines_truncation_and_rotation(tmp_path):
    path = tmp_path / "f.jsonl"
    tail = LineTail(path)
    assert tail.read() == ([], False)  # not there yet
    path.write_text('{"a": 1}\n{"b"')
    assert tail.read() == (['{"a": 1}'], False)
    with open(path, "a") as f:
        f.write(": 2}\n")
    assert tail.read() == (['{"b": 2}'], False)
    path.write_text('{"c": 3}\n')  # truncated and rewritten, shorter
    assert tail.read() == (['{"c": 3}'], True)
    new = tmp_path / "g.jsonl"
    new.write_text('{"d": 4}\n{"e": 5}\n')
    os.replace(new, path)  # rotated: a new file under the same name
    assert tail.read() == (['{"d": 4}', '{"e": 5}'], True)
    assert tail.read() == ([], False)


@pytest.mark.slow
def test_healthy_run_that_grows_and_ends_exits_0(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.watchdog", "--dir", str(run), "--halt", "1", "--stall-seconds", "20", *FAST],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        time.sleep(0.5)  # the directory does not exist yet
        run.mkdir()
        beat(run, 0, "boot", 0)
        csv_rows(run, [])
        for s in range(1, 8):
            csv_rows(run, [healthy_row(s)], mode="a")
            beat(run, 0, "step_end", s)
            time.sleep(0.05)
        # A restarted run replaces the heartbeat file: read again from its start.
        (run / "heartbeat_rank0.jsonl").unlink()
        beat(run, 0, "boot", 7)
        time.sleep(0.3)
        beat(run, 0, "done", 7, newline=False)
        assert proc.poll() is None  # the partial `done` line is not an event yet
        with open(run / "heartbeat_rank0.jsonl", "a") as f:
            f.write("\n")
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert "run ended: every rank wrote `done` (rank 0: step 7)" in out
    assert not (run / ".HALT").exists()


@pytest.mark.slow
def test_real_training_run(tmp_path):
    """The watchdog beside a real (tiny) training run: it sees the steps, the end, and no anomaly."""
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("NSA_")}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    dog = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launch.watchdog",
            "--dir",
            str(run),
            "--halt",
            "1",
            "--stall-seconds",
            "120",
            "--patience",
            "2",
            "--interval",
            "0.2",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    tiny = [*TINY_RUN, "train.log_every=2", "logging.tensorboard=false"]
    train = subprocess.run(
        [
            *LAUNCH_TRAIN,
            "--steps",
            "6",
            "--out-dir",
            str(run),
            *set_flags(tiny),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    try:
        out, _ = dog.communicate(timeout=30)
    finally:
        dog.kill()
    assert train.returncode == 0, train.stderr[-2000:]
    assert dog.returncode == 0, out
    assert "run ended: every rank wrote `done` (rank 0: step 6)" in out and not (run / ".HALT").exists()
    # The same artifacts without their end: now the heartbeat is stale, and the real format is read.
    stale = tmp_path / "stale"
    stale.mkdir()
    lines = (run / "heartbeat_rank0.jsonl").read_text().splitlines()
    (stale / "heartbeat_rank0.jsonl").write_text("\n".join(x for x in lines if '"event": "done"' not in x) + "\n")
    (stale / "training.csv").write_text((run / "training.csv").read_text())
    time.sleep(1.1)
    r = watchdog(stale, "--halt", "1", "--stall-seconds", "1", "--patience", "2", "--once")
    assert r.returncode == 1 and halt_files(stale)[0] == "heartbeat_stall", r.stdout
    assert "rank 0" in halt_files(stale)[1] and "at step 6" in halt_files(stale)[1]


@pytest.mark.slow
def test_a_resumed_run_appending_to_its_heartbeat_is_watched_again(tmp_path):
    old = time.time() - 60
    run = fresh_run(tmp_path, [])
    for s in (1, 2):
        beat(run, 0, "step_end", s, ts=old)
    beat(run, 0, "done", 2, ts=old)
    assert "run ended: every rank wrote `done`" in watchdog(run, "--once").stdout
    # A watchdog started just before the resumed run must not take the earlier end for this one's.
    r = watchdog(run, "--once", "--fresh")
    assert r.returncode == 0 and "run ended" not in r.stdout and "no event yet" in r.stdout, r.stdout
    beat(run, 0, "boot", 2)  # the resumed run appends
    beat(run, 0, "step_end", 3)
    r = watchdog(run, "--once", "--halt", "1", "--stall-seconds", "30")
    assert r.returncode == 0 and "run ended" not in r.stdout and "ok: rank 0 step 3" in r.stdout, r.stdout


@pytest.mark.slow
def test_a_crash_event_is_an_anomaly(tmp_path):
    run = fresh_run(tmp_path, [healthy_row(s) for s in range(1, 5)])
    beat(run, 0, "crash", 4, msg="RuntimeError: device lost")
    r = watchdog(run, "--halt", "1", "--stall-seconds", "600", *FAST)
    assert r.returncode == 1, r.stdout + r.stderr
    kind, why = halt_files(run)
    assert kind == "crash" and "rank 0: the trainer raised after step 4: RuntimeError: device lost" in why


@pytest.mark.slow
def test_a_trainer_that_raises_writes_crash_not_done(tmp_path):
    """In process: the data stream fails at the third batch; the heartbeat must end in `crash`."""
    from nsa_jax.config import load_config
    from nsa_jax.train.loop import Trainer

    cfg = load_config(
        "cpu_tiny",
        [
            *TINY_RUN,
            "train.global_batch=2",
            "train.steps=5",
            "logging.tensorboard=false",
            "checkpoint.enabled=false",
            f"train.out_dir={tmp_path / 'run'}",
        ],
    )
    trainer = Trainer(cfg, print_fn=lambda _: None)
    calls = {"n": 0}
    real_next = trainer._next_tokens

    def failing_next():
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("shard unreadable")
        return real_next()

    trainer._next_tokens = failing_next
    with pytest.raises(OSError, match="shard unreadable"):
        trainer.run()
    events = [json.loads(x) for x in (tmp_path / "run" / "heartbeat_rank0.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "crash" and events[-1]["msg"] == "OSError: shard unreadable"
    assert "done" not in {e["event"] for e in events}
    r = watchdog(tmp_path / "run", "--halt", "0", "--once")
    assert r.returncode == 1 and "crash" in r.stdout, r.stdout
