"""Ctrl-C and long steps: a stop saves, says how to resume, and the same command resumes.

The runs are launch.train subprocesses on TINY_SAVING_RUN. A subprocess started from a
script that runs in the background inherits SIGINT ignored; each run starts through a
small exec wrapper that restores the default action, as an interactive shell gives it
(no preexec_fn: forking a process that has jax loaded is unsafe). The long-step runs make their steps
long with train.accumulate (the micro-batch loop is inside the compiled step) and send
themselves SIGINT from a driver, so the step in flight at the signal is known.
"""

from __future__ import annotations

import csv
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from nsa_jax.config import load_config
from nsa_jax.ops import preemption
from nsa_jax.progress_text import fmt_duration
from nsa_jax.rundir import resume
from nsa_jax.step import optimizer as O
from nsa_jax.step import schedule
from nsa_jax.train import loop, progress

from helpers import TINY_SAVING_RUN, cpu_env, set_flags

ROOT = pathlib.Path(__file__).resolve().parent.parent

# exec keeps a default disposition: the trainer starts with SIGINT as a terminal gives it.
WITH_SIGINT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.executable, sys.argv[1:])"
)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> pathlib.Path:
    """One compilation cache for the module's runs: the same program compiles once."""
    return tmp_path_factory.mktemp("compile_cache")


class Run:
    """A launch.train subprocess whose output lines are read as they come, with their times."""

    def __init__(self, args: list[str], cache: pathlib.Path, driver: str | None = None, **env: str):
        cmd = [sys.executable, "-c", driver, *args] if driver else [sys.executable, "-m", "launch.train", *args]
        cmd = [sys.executable, "-c", WITH_SIGINT, *cmd]
        self.t0 = time.monotonic()
        self.p = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=cpu_env(1, cache=cache, **env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[tuple[float, str]] = []
        self.err: list[str] = []
        self._err_reader = threading.Thread(target=self._read_err, daemon=True)
        self._err_reader.start()

    def _read_err(self) -> None:
        self.err.extend(self.p.stderr)

    def until(self, prefix: str, timeout: float = 180) -> float:
        """Reads stdout until a line starts with `prefix`; the time it came."""
        deadline = time.monotonic() + timeout
        for line in self.p.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))
            if line.startswith(prefix):
                return self.lines[-1][0]
            if time.monotonic() > deadline:
                break
        raise AssertionError(f"no line {prefix!r} in:\n" + self.out + "".join(self.err))

    def finish(self, timeout: float = 180) -> int:
        for line in self.p.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))
        rc = self.p.wait(timeout)
        self._err_reader.join(10)  # stderr read to its end: the last line is there to assert on
        return rc

    @property
    def out(self) -> str:
        return "\n".join(line for _, line in self.lines)

    @property
    def stderr(self) -> str:
        return "".join(self.err)


def train_args(out: pathlib.Path, steps: int, *sets: str) -> list[str]:
    return ["--config", "cpu_tiny", "--steps", str(steps), "--out-dir", str(out), *set_flags([*TINY_SAVING_RUN, *sets])]


def csv_steps(out: pathlib.Path) -> list[int]:
    with open(out / "training.csv") as f:
        return [int(r["step"]) for r in csv.DictReader(f)]


# A launch.train process that sends itself SIGINT (COUNT times, 0.2 s apart) DELAY seconds after
# step AT is logged; LONG_STEP_S and QUIET_S override the loop's and its progress lines'.
DRIVER = r"""
import os, signal, sys, threading, time
from nsa_jax.train import loop, progress
for module, name in ((loop, "LONG_STEP_S"), (progress, "QUIET_S")):
    if os.environ.get(name):
        setattr(module, name, float(os.environ[name]))
at, delay, count = int(os.environ["AT"]), float(os.environ["DELAY"]), int(os.environ.get("COUNT", "1"))
record = loop.Trainer._record
fired = threading.Event()

def fire():
    fired.set()
    sys.stdout.write(f"driver: SIGINT x{count}\n")  # one write: not inside another thread's line
    sys.stdout.flush()
    for _ in range(count):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)

def _record(self, p):
    ok = record(self, p)
    if p.step == at:
        threading.Timer(delay, fire).start()
    return ok

loop.Trainer._record = _record
if os.environ.get("SLOW_SAVE"):  # saves after the signals take this long (a large model's save)
    from nsa_jax.rundir import checkpoint
    save = checkpoint.Checkpointer.save

    def _save(self, *args, **kwargs):
        if fired.is_set():
            time.sleep(float(os.environ["SLOW_SAVE"]))
        return save(self, *args, **kwargs)

    checkpoint.Checkpointer.save = _save
from launch.train import main
sys.argv = ["launch.train", *sys.argv[1:]]
sys.exit(main())
"""


# ---------------------------------------------------------------------------
# the guard


def test_first_signal_sets_the_flag_and_a_second_quits_at_once(capfd):
    exits: list[int] = []
    quit_ = threading.Event()
    guard = preemption.PreemptionGuard(
        on_first=lambda name: f"first {name}",
        abort_note=lambda: "the newest checkpoint is step 7",
        exit_fn=lambda code: (exits.append(code), quit_.set()),
    )
    before = signal.getsignal(signal.SIGINT)
    guard.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt: a flag
        time.sleep(0.05)
        assert guard.stop_requested() and guard.signal_name == "SIGINT" and not exits
        time.sleep(preemption.PreemptionGuard.ANNOUNCE_AFTER_S + 0.3)  # the announcement is due
        os.kill(os.getpid(), signal.SIGINT)
        assert quit_.wait(5), "a second SIGINT did not end the process"
        assert exits == [130]
    finally:
        guard.uninstall()
        signal.signal(signal.SIGINT, before)
    out, err = capfd.readouterr()
    assert out == "first SIGINT\n"
    assert err.strip() == "SIGINT again: quitting now without saving; the newest checkpoint is step 7"


def test_a_second_signal_quiets_the_run_then_names_the_checkpoint_it_reads_last(capfd, monkeypatch):
    # The run is muted before anything else, the output flushed, and what is kept read last: a save
    # that commits during the flush is the step the line names (and the one a restart resumes from).
    order: list[str] = []
    kept = {"step": 4}
    monkeypatch.setattr(preemption, "_flush_stdout", lambda: (order.append("flush"), kept.update(step=6)))
    quit_ = threading.Event()
    guard = preemption.PreemptionGuard(
        on_first=lambda name: f"first {name}",
        on_abort=lambda: order.append("mute"),
        abort_note=lambda: order.append("note") or f"the newest checkpoint is step {kept['step']}",
        exit_fn=lambda code: (order.append(f"exit {code}"), quit_.set()),
    )
    before = signal.getsignal(signal.SIGINT)
    guard.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)  # before the first one's announcement is due
        assert quit_.wait(5)
    finally:
        guard.uninstall()
        signal.signal(signal.SIGINT, before)
    time.sleep(preemption.PreemptionGuard.ANNOUNCE_AFTER_S + 0.3)
    out, err = capfd.readouterr()
    assert order == ["mute", "flush", "note", "exit 130"]
    assert err.strip() == "SIGINT again: quitting now without saving; the newest checkpoint is step 6"
    assert "first SIGINT" not in out  # the announcement due after the quit is not printed


def test_uninstall_restores_the_handlers_and_after_a_stop_a_late_signal_still_quits_quietly(capfd):
    before = signal.getsignal(signal.SIGINT)
    calm = preemption.PreemptionGuard(exit_fn=lambda code: None)
    calm.install()
    calm.uninstall()
    assert signal.getsignal(signal.SIGINT) is before  # no stop: the handlers go back as they were
    exits: list[int] = []
    guard = preemption.PreemptionGuard(exit_fn=exits.append)
    guard.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert guard.stop_requested()
        # The run tears down after the stop (a save, writer threads joined): a second Ctrl-C
        # arriving then is the quiet quit, not a KeyboardInterrupt in the interpreter's shutdown.
        guard.uninstall()
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert exits == [130]
    finally:
        signal.signal(signal.SIGINT, before)
    _, err = capfd.readouterr()
    assert err.strip() == "SIGINT again: quitting now without saving"


# ---------------------------------------------------------------------------
# Ctrl-C end to end


@pytest.mark.slow
def test_ctrl_c_saves_says_how_to_resume_and_the_same_command_resumes(tmp_path, cache):
    out = tmp_path / "run"
    args = train_args(out, 400, "checkpoint.save_every=1000")
    # A crash before the first save (SIGKILL at step 3): nothing to resume.
    first = Run(args, cache)
    first.until("step 3/")
    first.p.kill()
    first.finish()
    assert not resume.complete_steps(resume.checkpoint_dir(out)) and csv_steps(out)
    # The same command starts again from step 0 and keeps the crashed attempt's files.
    run = Run(args, cache)
    run.until("step 5/")
    assert "restart: the earlier run" in run.out and "without a checkpoint" in run.out and "from step 0" in run.out
    assert list((out / "previous").iterdir())
    t_sent = time.monotonic()
    run.p.send_signal(signal.SIGINT)  # Ctrl-C
    rc = run.finish()
    assert rc == 130, run.stderr[-3000:]
    assert time.monotonic() - t_sent < 10
    assert "Traceback" not in run.stderr and "KeyboardInterrupt" not in run.stderr
    saved = resume.complete_steps(resume.checkpoint_dir(out))
    last = csv_steps(out)[-1]
    assert saved == [last] and last >= 5
    lines = run.stderr.strip().splitlines()
    assert lines[-1].startswith(f"interrupted: stopped after step {last}; checkpoint step {last} is in "), lines
    assert lines[-1].endswith("to resume run the same command: " + shlex.join(["python", "-m", "launch.train", *args]))
    assert f"Ctrl-C (SIGINT) received; stopping after step {last}; saving a checkpoint" in run.out
    # The stop is said once on stdout (the loop's line or the announcement), the outcome once on stderr.
    said = [line for line in run.out.splitlines() if "stopping after" in line or line.startswith("SIGINT:")]
    assert len(said) == 1, run.out
    assert [line for line in lines if line.startswith("interrupted:")] == [lines[-1]], run.stderr
    # The same command resumes from it.
    again = Run(args[:2] + ["--steps", str(last + 3)] + args[4:], cache)
    assert again.finish() == 0, again.stderr[-3000:]
    assert f"resume: step {last} from" in again.out
    assert csv_steps(out) == list(range(1, last + 4))


@pytest.mark.slow
def test_a_second_ctrl_c_quits_at_once_and_keeps_the_last_checkpoint(tmp_path, cache):
    out = tmp_path / "run"
    args = train_args(out, 400, "checkpoint.save_every=2", "checkpoint.max_to_keep=10")
    # At step 7: the save of step 6 began only once step 4's had committed (a save waits for the one
    # before it), so step 4 is on disk whatever the load; step 6's may still be in flight. The stop's
    # save takes 5 s, so the second Ctrl-C comes while it runs, as it does for a large model.
    run = Run(args, cache, driver=DRIVER, AT="7", DELAY="0", COUNT="2", SLOW_SAVE="5")
    run.until("driver: SIGINT x2")
    t_sent = time.monotonic()
    rc = run.finish()
    assert rc == 130, run.stderr[-3000:]
    assert time.monotonic() - t_sent < 3
    assert "Traceback" not in run.stderr
    quit_line = [line for line in run.stderr.splitlines() if line.startswith("SIGINT again: quitting now")]
    assert len(quit_line) == 1, run.stderr[-3000:]
    kept = resume.complete_steps(resume.checkpoint_dir(out))
    assert kept and kept[-1] >= 4 and f"the newest checkpoint is step {kept[-1]}" in quit_line[0]
    # The run never ends as a finished one. (The first signal's stop line may still come after the
    # driver's line: the loop says it as soon as it sees the flag, which can be before the second
    # signal is read; what the quit line names is what a restart resumes from, checked above and below.)
    after = run.out.split("driver: SIGINT x2", 1)[1]
    assert "done:" not in after, run.out
    # The checkpoint the line names reads back: the same command resumes from it.
    again = Run(args[:2] + ["--steps", str(kept[-1] + 2)] + args[4:], cache)
    assert again.finish() == 0, again.stderr[-3000:]
    assert f"resume: step {kept[-1]} from" in again.out


@pytest.mark.slow
def test_ctrl_c_during_the_compile_stops_in_seconds_without_a_traceback(tmp_path):
    out = tmp_path / "run"
    run = Run(train_args(out, 50), tmp_path / "empty_cache")  # nothing cached: a full compile
    t_sent = run.until("compile: tracing")
    run.p.send_signal(signal.SIGINT)
    assert run.finish() == 130, run.stderr[-3000:]
    assert time.monotonic() - t_sent < 8
    assert "received during the compile; stopping before step 1" in run.out and "step 1/" not in run.out
    assert "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith("interrupted: stopped after step 0 with no checkpoint")


# ---------------------------------------------------------------------------
# long steps


@pytest.mark.slow
def test_a_stop_during_a_long_step_waits_for_that_step_only_and_long_waits_say_so(tmp_path, cache):
    out = tmp_path / "run"
    # ~1-3 s steps on a CPU (1,500 micro-batches per step); every step one at a time (LONG_STEP_S 0) so
    # the test does not depend on this machine's speed, and a progress line after 1 s of silence.
    args = train_args(out, 50, "train.accumulate=1500", "checkpoint.save_every=1000")
    run = Run(args, cache, driver=DRIVER, AT="2", DELAY="0.3", LONG_STEP_S="0", QUIET_S="1")
    t_sent = run.until("driver: SIGINT")
    assert run.finish() == 130, run.stderr[-3000:]
    # Step 3 was running when the signal came: it ends, is saved, and no step 4 starts.
    assert csv_steps(out) == [1, 2, 3] and resume.complete_steps(resume.checkpoint_dir(out)) == [3], run.out
    said = {line.split(":")[0]: t for t, line in run.lines}
    assert said["SIGINT"] - t_sent < 2, run.out  # the announcement comes at once, not at the step's end
    assert "SIGINT: the run stops when step 3 ends" in run.out
    # Said once: the loop does not repeat the stop the announcement named.
    assert "stopping after step 3" not in run.out and run.out.count("SIGINT:") == 1, run.out
    # A step that runs past QUIET_S (1 s here) without a line says so.
    assert any(re.fullmatch(r"step [123]/50: running: \d+s so far.*", line) for _, line in run.lines), run.out
    assert "step 1/50 |" in run.out  # a step line from the first step


# ---------------------------------------------------------------------------
# messages


def test_durations_and_the_cpu_projection():
    assert fmt_duration(45) == "45s" and fmt_duration(7500) == "2h05m"
    assert fmt_duration(70 * 86400 + 3600) == "70d01h"
    gpu = load_config("a100_pcie", [])
    assert progress.gpu_settings(gpu) == ["model.dtype bfloat16"]  # attention_impl auto runs XLA on a CPU
    warning = progress.cpu_projection(gpu, 50_000, 120.0, "cpu")
    assert warning.startswith("warning: 2m00s a step a config meant for a GPU") and "about 69d10h" in warning
    assert progress.cpu_projection(gpu, 50_000, 0.1, "gpu") is None
    tiny = load_config("cpu_tiny", [])
    assert progress.gpu_settings(tiny) == [] and progress.cpu_projection(tiny, 200, 2.0, "cpu") is None
    assert "about 55h" not in (progress.cpu_projection(tiny, 100_000, 2.0, "cpu") or "")
    assert progress.cpu_projection(tiny, 100_000, 2.0, "cpu").startswith("warning: 2s a step on a CPU")


def test_gpu_settings_on_a_cpu_sized_config_get_the_fix_not_a_smaller_config():
    tiny = load_config("cpu_tiny", ["model.dtype=bfloat16", "model.nsa.attention_impl=pallas"])
    assert progress.sized_for_cpu(tiny) and progress.sized_for_cpu(load_config("cpu_small", []))
    assert not progress.sized_for_cpu(load_config("a100_pcie", []))
    boot = progress.gpu_config_warning(tiny, "cpu")
    assert boot == (
        "warning: model.dtype bfloat16, model.nsa.attention_impl pallas is meant for a GPU and runs slower on a "
        "CPU; for the CPU path run the same command with --precision fp32 --set model.nsa.attention_impl=xla"
    )
    projection = progress.cpu_projection(tiny, 200, 30.0, "cpu")
    assert "cpu_tiny" not in boot and "cpu_tiny" not in projection
    assert projection.endswith("; on a CPU run it with --precision fp32 --set model.nsa.attention_impl=xla")
    long_tiny = progress.cpu_projection(load_config("cpu_tiny", []), 100_000, 2.0, "cpu")
    assert "cpu_tiny" not in long_tiny and long_tiny.endswith("; fewer --steps take less, or run it on a GPU")
    # A config sized for a GPU is still told to train a small one on a CPU.
    gpu = load_config("a100_pcie", [])
    warning = progress.gpu_config_warning(gpu, "cpu")
    assert warning.startswith("warning: this config is meant for a GPU") and "\n" not in warning
    # The alarm XLA prints while such a config compiles on a CPU for minutes is named and explained.
    assert '"Very slow compile?" alarm after 2 minutes is expected' in warning
    assert "(--config cpu_tiny)" in progress.cpu_projection(gpu, 50_000, 120.0, "cpu")
    assert progress.gpu_config_warning(tiny, "gpu") is None
    assert progress.gpu_config_warning(load_config("cpu_tiny", ["model.nsa.attention_impl=auto"]), "cpu") is None


def test_raising_steps_on_resume_says_what_happens_to_the_learning_rate():
    cfg = load_config("cpu_tiny", ["train.steps=40"]).train  # warmup 20, lr 1e-3, min_lr 1e-4

    def lr_at(step, train):
        return float(O.learning_rate(step, train))

    saved = {**cfg.__dict__, "steps": 30}
    line = schedule.lr_change_on_resume(saved, cfg, 30, lr_at)
    assert line.startswith("resume: train.steps 30 -> 40: the LR schedule is recomputed")
    # The finished run ended at min_lr; the longer schedule puts step 31 back up the cosine.
    assert "step 30 trained at lr 1.00e-04" in line and f"step 31 trains at {lr_at(30, cfg):.2e}" in line
    assert lr_at(30, cfg) > 4e-4 and "set train.decay_steps" in line
    assert schedule.lr_change_on_resume({**cfg.__dict__}, cfg, 30, lr_at) is None
    assert schedule.lr_change_on_resume({**cfg.__dict__, "log_every": 1}, cfg, 30, lr_at) is None


def test_a_resume_that_ends_inside_the_warm_up_says_so():
    # cpu_tiny's 20-step warm-up; 6 steps resumed to 10: the LR only rises, no cosine is reached.
    cfg = load_config("cpu_tiny", ["train.steps=10"]).train

    def lr_at(step, train):
        return float(O.learning_rate(step, train))

    lrs = [lr_at(s, cfg) for s in range(cfg.steps)]
    assert all(a < b for a, b in zip(lrs, lrs[1:])) and lrs[-1] < cfg.lr  # the schedule itself: warm-up only
    line = schedule.lr_change_on_resume({**cfg.__dict__, "steps": 6}, cfg, 6, lr_at)
    assert (
        f"warm-up (20 steps) ends past the last step: the LR rises to {lrs[-1]:.2e} at step 10 and never decays" in line
    )
    assert "cosine" not in line and "set train.warmup below 10" in line
    assert f"step 6 trained at lr {lr_at(5, cfg):.2e}, step 7 trains at {lrs[6]:.2e}" in line


def _stopping_trainer(lead: bool = True, processes: int = 1) -> SimpleNamespace:
    """What Trainer's stop methods read, for a run between steps 5 and 6 (step 6 not dispatched)."""
    said: list[str] = []
    t = SimpleNamespace(
        lead=lead,
        summary={"steps_done": 5, "halted": None},
        cfg=SimpleNamespace(checkpoint=SimpleNamespace(enabled=True), train=SimpleNamespace(steps=20)),
        _stop_said=None,
        _stop_lock=threading.Lock(),
        _dispatched=5,
        _posted_after=None,
        _preempt=SimpleNamespace(signal_name="SIGINT", agrees_late=processes > 1, posted_stop=False),
        art=SimpleNamespace(event=lambda *a, **k: None),
        said=said,
        say=said.append,
    )
    t._one_at_a_time = lambda: False
    t._stop_step = lambda: loop.Trainer._stop_step(t)
    t._last_step_note = lambda: ""
    return t


def test_only_process_0_announces_the_first_stop_signal():
    # Every process of a launch.spawn run gets the Ctrl-C; process 0 alone says what the run does.
    lead = _stopping_trainer()
    lead.summary = None
    lead._dispatched = 0
    assert loop.Trainer._stop_announcement(lead, "SIGINT").startswith("SIGINT: the run stops before its first step")
    assert loop.Trainer._stop_announcement(_stopping_trainer(lead=False), "SIGINT") == ""


def test_a_stop_is_said_once_whichever_says_it_first():
    # The announcement first (a long step): the loop's stop after that step says nothing more.
    t = _stopping_trainer()
    assert loop.Trainer._stop_announcement(t, "SIGINT").startswith("SIGINT: the run stops after step 5, saves")
    loop.Trainer._stopped_by_signal(t, 5)
    assert t.said == [] and t.summary["halted"] == "sigint"
    # The loop first (short steps): the announcement a second later has nothing to add.
    t = _stopping_trainer()
    loop.Trainer._stopped_by_signal(t, 5)
    assert t.said == [progress.signal_stop_line("SIGINT", 5, True, True)]
    assert loop.Trainer._stop_announcement(t, "SIGINT") == ""
    # Processes agree on a stop one step later than the one announced: the loop names the step it stops after.
    t = _stopping_trainer()
    loop.Trainer._stop_announcement(t, "SIGINT")
    loop.Trainer._stopped_by_signal(t, 6)
    assert t.said == [progress.signal_stop_line("SIGINT", 6, True, True)]
    # "interrupted:" is launch.train's outcome line alone.
    assert not t.said[0].startswith("interrupted") and "stopping after step 6" in t.said[0]


@pytest.mark.parametrize("one_at_a_time", [False, True])
def test_with_several_processes_the_stop_is_announced_at_the_step_they_agree_on(one_at_a_time):
    """launch.spawn: processes read the agreed stop flag one boundary after it is posted. A signal while step 11
    runs is posted before step 12 and read before step 13: the run stops after step 12, said once."""

    def trainer():
        t = _stopping_trainer(processes=2)
        t._dispatched, t.summary["steps_done"] = 11, 10
        t._one_at_a_time = lambda: one_at_a_time
        return t

    t = trainer()  # nothing posted yet: the next boundary posts the flag, step 12 runs, the one after reads it
    assert "the run stops after step 12" in loop.Trainer._stop_announcement(t, "SIGINT")
    loop.Trainer._stopped_by_signal(t, 12)  # what the loop says when the processes agree
    assert t.said == []
    # Posted at the boundary after step 10 (step 11 dispatched since): the stop comes when step 11 ends.
    t = trainer()
    t._posted_after = 10
    line = loop.Trainer._stop_announcement(t, "SIGINT")
    assert ("when step 11 ends" if one_at_a_time else "after step 11") in line
    loop.Trainer._stopped_by_signal(t, 11)
    assert t.said == []
    # The last step in flight: the run ends there anyway.
    t = trainer()
    t._dispatched = 20
    line = loop.Trainer._stop_announcement(t, "SIGINT")
    assert ("when step 20 ends" if one_at_a_time else "after step 20") in line
