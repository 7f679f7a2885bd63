"""launch.spawn: a real 2-process training run (gloo on CPU), failure propagation, signal forwarding."""

from __future__ import annotations

import csv
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

from launch.spawn import child_env, exit_status

from helpers import TINY_RUN, set_flags

ROOT = pathlib.Path(__file__).resolve().parent.parent

TINY = [*TINY_RUN, "train.log_every=1", "logging.tensorboard=false", "model.nsa.branches=[cmp]"]


def env() -> dict[str, str]:
    e = {
        k: v for k, v in os.environ.items() if not k.startswith(("NSA_", "JAX_COORD", "JAX_NUM", "JAX_PROC", "SLURM_"))
    }
    # One CPU device per process, as one process per host would have its own GPUs.
    e.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    return e


def spawn(*args: str, timeout: float = 400, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "launch.spawn", *args],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


@pytest.mark.slow
def test_two_process_training_run(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "launch.train", "--config", "cpu_tiny", "--steps", "3", "--out-dir", str(out)]
    cmd += ["--profile-steps", "2:3"]
    r = spawn("--nproc", "2", "--grace", "5", "--", *cmd, *set_flags(TINY))
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    # Both ranks joined one run, and each line says whose it is.
    for rank in (0, 1):
        assert f"[{rank}] dist: process {rank} of 2, coordinator 127.0.0.1:" in r.stdout
    assert "[0] boot: 2 processes, 2 cpu devices on the data axis" in r.stdout
    assert "[0] done: 3 steps" in r.stdout and "[1] done" not in r.stdout  # process 0 prints
    assert "[spawn] exit status 0" in r.stderr

    beats = {
        rank: [json.loads(x) for x in (out / f"heartbeat_rank{rank}.jsonl").read_text().splitlines()] for rank in (0, 1)
    }
    for rank, events in beats.items():
        assert {e["rank"] for e in events} == {rank}
        assert [e["step"] for e in events if e["event"] == "step_end"] == [1, 2, 3]
        boot = next(e for e in events if e["event"] == "boot")
        assert boot["processes"] == 2 and boot["devices"] == 2
        assert events[-1]["event"] == "done"
    # The loss is the global one: both processes log the same numbers.
    losses = [[e["loss"] for e in beats[r] if e["event"] == "step_end"] for r in (0, 1)]
    assert losses[0] == losses[1]
    with open(out / "training.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(x["step"]) for x in rows] == [1, 2, 3]
    assert all(abs(float(x["loss"]) - v) < 1e-4 and 0 < v < 10 for x, v in zip(rows, losses[0]))
    env_json = json.loads((out / "env.json").read_text())
    assert env_json["process_count"] == 2 and env_json["mesh"]["shape"] == {"data": 2, "seq": 1}
    _check_trace_summaries(out)


def _check_trace_summaries(out):
    """Each rank traced steps 2-3 (its own device), and launch.trace_summary made its summary.csv / .html:
    the categories add up to the device's window read from the raw trace (first op to last) within 5%,
    and the gradient all-reduce shows as a collective."""
    from nsa_jax.report import traces as ts

    beats = [json.loads(x) for x in (out / "heartbeat_rank1.jsonl").read_text().splitlines()]
    assert [(e["event"], e["step"]) for e in beats if e["event"].startswith("profile_")] == [
        ("profile_start", 2), ("profile_stop", 3)]  # fmt: skip
    r = subprocess.run(
        [sys.executable, "-m", "launch.trace_summary", str(out)], cwd=ROOT, env=env(), capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr[-2000:]
    for rank in (0, 1):
        raw = ts.read_trace(ts.find_trace(out / "traces" / f"rank{rank}"))
        thunks = [e for e in raw if e.get("ph") == "X" and "hlo_op" in (e.get("args") or {})]
        window_ms = (max(e["ts"] + e["dur"] for e in thunks) - min(e["ts"] for e in thunks)) / 1e3
        rows = list(csv.DictReader(open(out / "trace_summary" / f"rank{rank}" / "summary.csv")))
        cats = {x["name"]: float(x["ms"]) for x in rows if x["section"] == "category" and x["name"] != "wall"}
        assert set(cats) == {"compute", "collective (exposed)", "memory copy (exposed)", "idle"}
        assert abs(sum(cats.values()) - window_ms) <= 0.05 * window_ms, (cats, window_ms)
        collective = [x for x in rows if x["section"] == "overlap"]
        assert len(collective) == 1 and float(collective[0]["ms"]) > 0
        assert "<svg" in (out / "trace_summary" / f"rank{rank}" / "summary.html").read_text()
        assert f"rank {rank} CPU:" in r.stdout


@pytest.mark.slow
def test_a_bad_flag_fails_the_spawn():
    r = spawn("--nproc", "2", "--", sys.executable, "-m", "launch.train", "--bogus", timeout=120)
    assert r.returncode == 2, r.stderr
    # Whichever rank fails first is reported; the spawner then stops the other, which may
    # not have printed its own error yet.
    assert re.search(r"\[[01]\] error: unrecognized arguments: --bogus", r.stderr), r.stderr


@pytest.mark.slow
def test_one_failing_child_stops_the_others():
    code = (
        "import os, sys, time\n"
        "if os.environ['JAX_PROCESS_ID'] == '1':\n"
        "    print('rank 1 fails', flush=True); sys.exit(3)\n"
        "time.sleep(120)\n"
    )
    t0 = time.monotonic()
    r = spawn("--nproc", "3", "--grace", "5", "--", sys.executable, "-c", code, timeout=60)
    assert r.returncode == 3, r.stderr
    assert time.monotonic() - t0 < 30  # the sleepers were stopped, not waited for
    assert "[1] rank 1 fails" in r.stdout
    assert "[spawn] rank 1 exited with status 3; stopping ranks [0, 2]" in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("rank1_exit", [0, 3])
def test_sigterm_is_forwarded_to_every_child(tmp_path, rank1_exit):
    code = (
        "import os, signal, sys, time\n"
        "def bye(sig, frame):\n"
        f"    print('got', sig, flush=True); sys.exit(0 if os.environ['JAX_PROCESS_ID'] == '0' else {rank1_exit})\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    p = subprocess.Popen(
        [sys.executable, "-m", "launch.spawn", "--nproc", "2", "--", sys.executable, "-c", code],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ready = set()
    while len(ready) < 2:
        line = p.stdout.readline()
        assert line, p.stderr.read()
        if line.strip().endswith("ready"):
            ready.add(line.split()[0])
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=30)
    assert {ln for ln in out.splitlines() if "got" in ln} == {"[0] got 15", "[1] got 15"}
    # Every child stopped cleanly (exit 0, as launch.train after saving): so does spawn; else a child's status.
    assert p.returncode == rank1_exit, err
    assert "SIGTERM: forwarded to 2 children" in err


def test_child_env_and_exit_status():
    e = child_env({"A": "1"}, 1, 2, "127.0.0.1:5")
    assert (e["JAX_COORDINATOR_ADDRESS"], e["JAX_NUM_PROCESSES"], e["JAX_PROCESS_ID"], e["A"]) == (
        "127.0.0.1:5",
        "2",
        "1",
        "1",
    )
    assert exit_status(-9) == 137 and exit_status(3) == 3


# launch.train with training.csv refusing the row of step 3 (ENOSPC), as a disk that fills
# between two saves; only process 0 writes the CSVs.
CSV_FULL = r"""
import errno, sys
from nsa_jax.rundir import files as runfiles
write = runfiles.CsvWriter.write
def _write(self, row):
    if self.path.name == "training.csv" and row.get("step") == 3:
        raise OSError(errno.ENOSPC, "No space left on device")
    return write(self, row)
runfiles.CsvWriter.write = _write
from launch.train import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_full_disk_on_process_0_stops_every_process_at_the_same_step(tmp_path):
    """Process 0 alone sees the refused row; both processes agree before the step-4 save and stop
    there (no hang in the save's collectives, no save of a step whose row is missing), exit 74."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        coordinator = f"127.0.0.1:{s.getsockname()[1]}"
    out = tmp_path / "run"
    cmd = [sys.executable, "-c", CSV_FULL, "--config", "cpu_tiny", "--steps", "8", "--out-dir", str(out)]
    cmd += set_flags([*TINY, "checkpoint.save_every=2"])
    procs = [
        subprocess.Popen(
            cmd, cwd=ROOT, env=child_env(env(), rank, 2, coordinator), stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for rank in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    errs = [e.decode() for _, e in outs]
    assert [p.returncode for p in procs] == [74, 74], errs
    assert errs[0].startswith("error: training.csv could not be written: disk full"), errs[0]
    assert errs[1].startswith("error: process 0 could not write its run files"), errs[1]
    assert all("newest committed checkpoint is step 2" in e for e in errs), errs
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == [2]
    stops = []
    for rank in (0, 1):
        beats = [json.loads(x) for x in (out / f"heartbeat_rank{rank}.jsonl").read_text().splitlines()]
        stops.append([b["step"] for b in beats if b["event"] == "output_failed"])
    assert stops[0] == stops[1] and len(stops[0]) == 1, stops
