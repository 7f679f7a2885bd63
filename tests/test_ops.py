"""nsa_jax.ops: multi-process settings, stack dumps, the stall watchdog, halts; and their wiring in the trainer."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from nsa_jax.agreement import agree_any
from nsa_jax.config import ConfigError, load_config
from nsa_jax.ops import distributed as D
from nsa_jax.ops import health as H
from nsa_jax.ops.wakeup import WakeupReader
from nsa_jax.runbook_env import env_overrides
from nsa_jax.rundir import files as rf

from helpers import LAUNCH_TRAIN, TINY_RUN, cpu_env, set_flags

ROOT = pathlib.Path(__file__).resolve().parent.parent

TINY = [*TINY_RUN, "logging.tensorboard=false", "model.nsa.branches=[cmp]"]
sets = set_flags


def heartbeat(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------
# distributed settings


def test_single_process_when_nothing_is_set():
    assert D.resolve(environ={}) is None
    assert D.resolve(num_processes=1, environ={}) is None
    assert D.resolve(environ={"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "n1"}) is None


def test_flags_override_env_field_by_field():
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    assert D.resolve(environ=env) == D.DistSpec("10.0.0.1:1234", 4, 3, "env")
    assert D.resolve(process_id=1, environ=env) == D.DistSpec("10.0.0.1:1234", 4, 1, "flags+env")
    assert D.resolve("h:9", 2, 0, environ=env) == D.DistSpec("h:9", 2, 0, "flags")


@pytest.mark.parametrize(
    "kwargs,env,match",
    [
        ({"num_processes": 2, "process_id": 0}, {}, "needs --coordinator"),
        ({"coordinator": "h:1", "num_processes": 2}, {}, "needs --process-id"),
        ({"coordinator": "h:1", "num_processes": 2, "process_id": 2}, {}, r"must lie in 0\.\.1"),
        ({"coordinator": "nohost", "num_processes": 2, "process_id": 0}, {}, "HOST:PORT"),
        ({}, {"JAX_NUM_PROCESSES": "two"}, "JAX_NUM_PROCESSES='two' must be an integer"),
        (
            {},
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[1-2]"},
            "ntasks-per-node=1",
        ),
    ],
)
def test_bad_settings_name_the_fix(kwargs, env, match):
    with pytest.raises(D.DistributedConfigError, match=match):
        D.resolve(**kwargs, environ=env)


def test_slurm_one_task_per_node():
    env = {
        "SLURM_PROCID": "1",
        "SLURM_NTASKS": "2",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_JOB_ID": "1000",
        "SLURM_STEP_NODELIST": "gpu[007-008]",
        "SLURM_LOCALID": "0",
    }
    spec = D.resolve(environ=env)
    assert spec == D.DistSpec(f"gpu007:{49152 + 1000 % 16384}", 2, 1, "slurm")
    assert D.resolve(environ={**env, "JAX_COORDINATOR_PORT": "4321"}).coordinator == "gpu007:4321"
    # The launcher's variables win over SLURM's.
    assert (
        D.resolve(
            environ={**env, "JAX_COORDINATOR_ADDRESS": "a:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"}
        ).source
        == "env"
    )


@pytest.mark.parametrize(
    "nodes,first",
    [
        ("node1", "node1"),
        ("node1,node2", "node1"),
        ("gpu[003-004,9],cpu1", "gpu003"),
        ("rack1-[12,15]", "rack1-12"),
        ("n[5]x", "n5x"),
    ],
)
def test_first_host_of_a_slurm_node_list(nodes, first):
    assert D.first_host(nodes) == first


@pytest.mark.slow
def test_launch_train_reports_incomplete_settings_in_one_line(tmp_path):
    r = subprocess.run(
        [
            *LAUNCH_TRAIN,
            "--num-processes",
            "2",
            "--out-dir",
            str(tmp_path / "x"),
        ],
        cwd=ROOT,
        env=cpu_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: a multi-process run needs --coordinator, --process-id")


@pytest.mark.parametrize(
    "name", ["a100_pcie", "a100_pcie_tuned", "a100_pcie_32k", "a100_pcie_64k", "a100_pcie_256k", "llama8b_64k"]
)
def test_gpu_configs_time_a_hang_out_after_fifteen_minutes(name):
    """torch's process-group timeout (15 minutes) as the GPU configs' default: a hung collective ends the run."""
    assert load_config(name).ops.stall_seconds == 900.0


def test_pg_timeout_maps_onto_the_stall_watchdog():
    overrides, applied = env_overrides({"NSA_PG_TIMEOUT_MIN": "30"})
    assert load_config("a100_pcie", overrides).ops.stall_seconds == 1800.0
    assert applied == {"NSA_PG_TIMEOUT_MIN": "ops.stall_seconds=1800.0"}
    with pytest.raises(ConfigError, match="ops.stall_seconds must be >= 0"):
        load_config(None, ["ops.stall_seconds=-1"])


# ---------------------------------------------------------------------------
# health, without a trainer

STUCK = textwrap.dedent("""
    import ctypes, json, pathlib, sys
    from nsa_jax.ops.health import Health
    out = pathlib.Path(sys.argv[1])
    log = open(out / "events.jsonl", "a", buffering=1)
    def event(name, step, msg="", **f):
        log.write(json.dumps({"event": name, "step": step, "msg": msg, **f}) + "\\n")
    health = Health(out, rank=3, stall_seconds=float(sys.argv[2]), event=event).start()
    health.step_ended(7)
    libc = ctypes.CDLL(None)
    mutex = ctypes.create_string_buffer(64)   # PTHREAD_MUTEX_INITIALIZER is all zeros
    libc.pthread_mutex_lock(mutex)
    print("stuck", flush=True)
    def deadlocked_in_c():
        libc.pthread_mutex_lock(mutex)   # relocking from the same thread never returns, signals or not
    deadlocked_in_c()
""")


@pytest.mark.slow
def test_dumps_while_the_main_thread_is_stuck_in_c_then_exits_on_stall(tmp_path):
    script = tmp_path / "stuck.py"
    script.write_text(STUCK)
    p = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), "3"],
        env=cpu_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert p.stdout.readline().strip() == "stuck"
    time.sleep(0.3)
    p.send_signal(signal.SIGUSR1)
    deadline = time.time() + 10
    while not list(tmp_path.glob("stackdump_*.txt")) and time.time() < deadline:
        time.sleep(0.05)
    assert p.poll() is None  # SIGUSR1 did not end it
    _, err = p.communicate(timeout=30)
    assert p.returncode == H.STALL_EXIT_CODE, err
    assert "watchdog: stall: no training step ended for 3s (ops.stall_seconds=3) after step 7" in err
    dumps = sorted(tmp_path.glob("stackdump_*_rank3.txt"))
    assert len(dumps) == 2
    first, second = (d.read_text() for d in dumps)
    assert first.startswith("stack dump: SIGUSR1") and "last finished step: 7" in first
    for text in (first, second):
        main = text.split("--- thread MainThread")[1].split("--- thread")[0]
        assert "in deadlocked_in_c" in main and "pthread_mutex_lock(mutex)" in main
    assert second.startswith("stack dump: stall") and "--- thread nsa-stall-watchdog" in second
    events = heartbeat(tmp_path / "events.jsonl")
    assert [(e["event"], e["reason"], e["step"]) for e in events] == [
        ("watchdog_dump", "sigusr1", 7),
        ("watchdog_dump", "stall", 7),
    ]


def test_pause_holds_the_stall_clock_and_close_restores_signals(tmp_path):
    exits = []
    before = signal.getsignal(signal.SIGUSR1)
    health = H.Health(tmp_path, stall_seconds=0.3, exit_fn=exits.append).start()
    try:
        with health.paused():
            time.sleep(0.8)
        assert exits == []
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.time() + 5
        while not health.dumps and time.time() < deadline:
            time.sleep(0.02)
        assert len(health.dumps) == 1 and "SIGUSR1" in health.dumps[0].read_text()
        deadline = time.time() + 5
        while not exits and time.time() < deadline:
            time.sleep(0.02)
        assert exits == [H.STALL_EXIT_CODE]
    finally:
        health.close()
    assert signal.getsignal(signal.SIGUSR1) is before
    assert signal.set_wakeup_fd(-1) == -1  # ours was taken back


def test_wakeup_reader_takes_its_signals_passes_the_others_on_and_gives_the_fd_back():
    """Two owners in turn, as the trainer's SIGUSR1 dumps over its Ctrl-C guard: the newer one's
    thread gets its signal; another signal reaches the former owner's pipe; stop restores that fd."""
    r0, w0 = os.pipe()
    os.set_blocking(w0, False)
    os.set_blocking(r0, False)  # a read with nothing passed on fails instead of waiting
    handlers = {s: signal.signal(s, lambda *a: None) for s in (signal.SIGUSR1, signal.SIGUSR2)}
    outer = signal.set_wakeup_fd(w0, warn_on_full_buffer=False)
    got = []
    reader = WakeupReader((signal.SIGUSR1,), lambda numbers: got.append(numbers) or True, "test-wakeup")
    try:
        reader.start()
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR2)
        deadline = time.time() + 5
        while not got and time.time() < deadline:
            time.sleep(0.02)
        assert got == [[signal.SIGUSR1]]
        time.sleep(0.2)
        assert os.read(r0, 64) == bytes([signal.SIGUSR2])  # passed on, and SIGUSR1 was not
        reader.stop()
        reader.thread.join(5)
        assert not reader.thread.is_alive()  # the pipe's EOF ended it
        assert signal.set_wakeup_fd(w0) == w0  # the former owner has the fd again
    finally:
        signal.set_wakeup_fd(outer)
        for s, h in handlers.items():
            signal.signal(s, h)
        os.close(r0)
        os.close(w0)


def test_write_halt_and_single_process_agreement(tmp_path):
    rf.write_halt(tmp_path, "nan_loss", "step 4: non-finite loss")
    assert (tmp_path / ".anomaly_type").read_text() == "nan_loss\n"
    assert (tmp_path / ".HALT").read_text() == "step 4: non-finite loss\n"
    assert agree_any(True) is True and agree_any(False) is False


# ---------------------------------------------------------------------------
# the trainer

HANGS = textwrap.dedent("""
    import sys, threading, time
    from nsa_jax.train import loop

    _compile = loop.Trainer.compile

    def compile_with_hangs(self, batch):
        run = _compile(self, batch)
        out = self.out
        def step(state, batch):
            done = int(state.step)
            if done == 2:   # before step 3: tell the test, then wait for its SIGUSR1 dump
                (out / "waiting").touch()
                while not list(out.glob("stackdump_*.txt")):
                    time.sleep(0.05)
            if done == 4:   # before step 5: hang as on a lost collective
                threading.Event().wait()
            return run(state, batch)
        return step

    loop.Trainer.compile = compile_with_hangs
    from launch.train import main
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.slow
def test_trainer_sigusr1_dump_then_stall_exit(tmp_path):
    """SIGUSR1 while a step is blocked: dump, training goes on; then a hang: dump, watchdog_dump, exit 75.

    The stall limit is far below the compile time, so this also shows the clock waits for the first step.
    """
    script, run = tmp_path / "hangs.py", tmp_path / "run"
    script.write_text(HANGS)
    p = subprocess.Popen(
        [
            sys.executable,
            str(script),
            "--config",
            "cpu_tiny",
            "--steps",
            "8",
            "--out-dir",
            str(run),
            *sets(TINY + ["ops.stall_seconds=4", "train.log_every=1"]),
        ],
        cwd=ROOT,
        env=cpu_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        hb = run / "heartbeat_rank0.jsonl"
        deadline = time.time() + 240
        while time.time() < deadline and p.poll() is None:
            # The marker, not the first step_end: only then is the main thread surely in the wait loop.
            if (run / "waiting").exists():
                break
            time.sleep(0.1)
        assert p.poll() is None, p.communicate()[1][-3000:]
        time.sleep(0.2)  # from touch() into the loop
        p.send_signal(signal.SIGUSR1)
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == H.STALL_EXIT_CODE, err[-3000:]
    assert "watchdog: stall: no training step ended for 4s (ops.stall_seconds=4) after step 3" in err
    events = heartbeat(hb)
    assert [e["step"] for e in events if e["event"] == "step_end"] == [1, 2, 3]
    dumps = [(e["reason"], e["step"], pathlib.Path(e["path"])) for e in events if e["event"] == "watchdog_dump"]
    assert [(r, s) for r, s, _ in dumps] == [("sigusr1", 1), ("stall", 3)]
    assert "done" not in {e["event"] for e in events}  # ended by os._exit, as a stuck process must be
    sigusr1, stall = (path.read_text() for _, _, path in dumps)
    main = sigusr1.split("--- thread MainThread")[1].split("--- thread")[0]
    assert "hangs.py" in main and ("out.glob" in main or "time.sleep(0.05)" in main), main
    assert "threading.Event().wait()" in stall.split("--- thread MainThread")[1].split("--- thread")[0]
    assert sorted(q.name for q in run.glob("stackdump_*_rank0.txt")) == sorted(path.name for _, _, path in dumps)


@pytest.mark.slow
def test_trainer_counts_skipped_updates_then_halts_at_max_skips(tmp_path):
    run = tmp_path / "run"
    r = subprocess.run(
        [
            *LAUNCH_TRAIN,
            "--steps",
            "5",
            "--out-dir",
            str(run),
            *sets(TINY + ["model.init_std=.nan", "ops.nan_policy=skip", "ops.max_skips=2"]),
        ],
        cwd=ROOT,
        env=cpu_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 1, r.stderr[-3000:]
    # A remark: on stderr, where launch.train says its warnings (the step lines stay on stdout).
    assert "warning: non-finite loss at step 1; update skipped (ops.nan_policy=skip; 1 skipped so far)" in r.stderr
    assert "warning:" not in r.stdout
    assert (run / ".anomaly_type").read_text() == "nan_loss\n"
    assert (run / ".HALT").read_text().startswith("step 2: non-finite loss at step 2; update skipped; 2 updates")
    rows = (run / "training.csv").read_text().splitlines()
    col = rows[0].split(",").index("skipped")
    assert [row.split(",")[col] for row in rows[1:]] == ["1", "1"]
    events = heartbeat(run / "heartbeat_rank0.jsonl")
    assert [(e["step"], e.get("skipped_steps")) for e in events if e["event"] == "anomaly"] == [(1, 1), (2, None)]
    done = [e for e in events if e["event"] == "done"]
    assert done[0]["skipped_steps"] == 2 and done[0]["halted"] == "nan_loss" and done[0]["steps_done"] == 2


# ---------------------------------------------------------------------------
# the production script

SCRIPT = ROOT / "launch" / "run_2xa100_production.sh"


def test_production_script_parses_and_dry_runs_every_phase(tmp_path):
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    env = {k: v for k, v in cpu_env().items() if not k.startswith("NCCL_")}
    env.update(DRY_RUN="1", OUT=str(tmp_path / "out"), PYTHON=sys.executable, INTERCONNECT="pcie")
    r = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    cmds = [ln for ln in r.stderr.splitlines() if ln.startswith("+ ")]
    trains = [c for c in cmds if "-m launch.train --config a100_pcie" in c]
    assert len(trains) == 4
    for c in cmds:
        for var in (
            "NCCL_ALGO=Ring",
            "NCCL_PROTO=Simple",
            "NCCL_IB_DISABLE=1",
            "NSA_DDP_BUCKET_MB=25",
            "NSA_DDP_COMPRESS=bf16",
        ):
            assert var in c, c
    assert "--dataset synthetic --steps 1" in trains[0] and "/phase0" in trains[0]
    assert "--dataset fineweb_edu --loader-timeout 120" in trains[1] and "--steps 300" in trains[1]
    assert "--steps 1000" in trains[2] and "--steps" not in trains[3]
    assert any("-m launch.watchdog --dir " + str(tmp_path / "out") + " --halt 1" in c for c in cmds)
    assert not (tmp_path / "out").exists()  # a dry run touches nothing
    one = subprocess.run(
        ["bash", str(SCRIPT)],
        env={**env, "PHASE": "2", "NCCL_ALGO": "Tree"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = [ln for ln in one.stderr.splitlines() if ln.startswith("+ ")]
    assert len(lines) == 1 and "--steps 1000" in lines[0] and "NCCL_ALGO=Tree" in lines[0]
    bad = subprocess.run(["bash", str(SCRIPT)], env={**env, "PHASE": "7"}, capture_output=True, text=True)
    assert bad.returncode == 2


@pytest.mark.slow
def test_production_script_phase_1_is_judged_by_launch_report(tmp_path):
    """A real phase 1 (cpu_tiny at T = 128, synthetic, 12 steps): the gate is launch.report --strict over
    the last LAST steps (the runbook's 50; 10 here), with REPORT_FLAGS passed on to it, and the summary
    prints the per-step mean and stdev of toks_per_s the runbook's table names. The step-time spread's
    limit is loosened through REPORT_FLAGS: 0.7 s steps beside the other test worker spread past 0.25."""
    config = tmp_path / "tiny.yaml"
    config.write_text((ROOT / "configs" / "cpu_tiny.yaml").read_text().replace("seq_len: 256", "seq_len: 128"))
    env = {k: v for k, v in cpu_env().items() if not k.startswith("NCCL_")}
    env.update(PHASE="1", CONFIG=str(config), DATASET="synthetic", STEPS1="12", LAST="10", OUT=str(tmp_path / "out"))
    env.update(PYTHON=sys.executable, INTERCONNECT="pcie", REPORT_FLAGS="--max-step-cv 5 --max-heartbeat-gap-s 900")
    r = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "limit 5, --max-step-cv)" in r.stdout and "limit 900s (--max-heartbeat-gap-s)" in r.stdout
    assert "verdict: GO" in r.stdout and "reached step 12 on every rank; launch.report: GO" in r.stderr
    assert "toks_per_s last 10:" in r.stdout and "over 10 steps" in r.stdout
    assert "per-step mean" in r.stdout and "stdev" in r.stdout
    assert (tmp_path / "out" / "phase1" / "report" / "report.md").exists()
