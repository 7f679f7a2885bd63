"""One trainer per out_dir: a second trainer is refused at once and leaves the folder untouched;
the lock of a SIGKILLed holder does not outlive it; readers do not take it."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from nsa_jax.rundir import lock as runlock

from helpers import LAUNCH_TRAIN, ROOT, TINY_SAVING_RUN, cpu_env, set_flags

TINY = TINY_SAVING_RUN


def _env(cache: pathlib.Path) -> dict[str, str]:
    return cpu_env(1, cache)


def _cmd(out: pathlib.Path, steps: int) -> list[str]:
    return [*LAUNCH_TRAIN, "--steps", str(steps), "--out-dir", str(out), *set_flags(TINY)]


def _steps(out: pathlib.Path) -> list[int]:
    d = out / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def _snapshot(d: pathlib.Path) -> dict[str, tuple[int, int]]:
    """Every path under `d` with its size and modification time (ns).

    A live trainer renames its checkpoint temp dirs while this walks: os.walk skips a
    directory that vanished, and so does the stat below.
    """
    out = {}
    for root, dirs, files in os.walk(d):
        for name in sorted(dirs + files):
            p = pathlib.Path(root) / name
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            out[str(p.relative_to(d))] = (st.st_size, st.st_mtime_ns)
    return out


def test_lock_is_exclusive_and_names_its_holder(tmp_path):
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", f"from nsa_jax.rundir import lock; lock.acquire({str(out)!r}, 'train A'); input()"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.PIPE,
        text=True,
    )
    try:
        for _ in range(200):
            if runlock.holder(out):
                break
            time.sleep(0.05)
        before = _snapshot(out)
        with pytest.raises(runlock.OutDirLocked) as e:
            runlock.acquire(out)
        msg = str(e.value)
        assert f"pid {holder.pid} on " in msg and "train A" in msg and "--out-dir" in msg, msg
        assert _snapshot(out) == before
    finally:
        holder.communicate("\n", timeout=30)
    # The holder exited: its lock went with it.
    assert runlock.acquire(out)
    assert runlock.holder(out)["pid"] == os.getpid()
    assert runlock.acquire(out)  # the same process again: still its own
    runlock.release_all()


def test_a_read_only_folder_is_one_error(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes through read-only permissions")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(runlock.ConfigError, match="cannot be written"):
            runlock.acquire(ro / "run")
    finally:
        ro.chmod(0o700)


@pytest.mark.slow
def test_second_trainer_is_refused_and_a_killed_holder_leaves_no_lock(tmp_path):
    out, cache = tmp_path / "run", tmp_path / "cache"
    cmd = _cmd(out, 400)
    first = subprocess.Popen(cmd, cwd=ROOT, env=_env(cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Wait until the first trainer has saved a checkpoint (it is well into its run).
        deadline = time.time() + 300
        while not _steps(out):
            assert first.poll() is None and time.time() < deadline, first.stderr.read() if first.stderr else ""
            time.sleep(0.2)
        before = {k: v for k, v in _snapshot(out).items() if not k.startswith(("checkpoints", "heartbeat", "train"))}
        t0 = time.perf_counter()
        second = subprocess.run(cmd, cwd=ROOT, env=_env(cache), capture_output=True, text=True, timeout=60)
        refusal_s = time.perf_counter() - t0
        print(f"second trainer refused in {refusal_s:.2f} s")
        assert second.returncode == 2, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), second.stderr
        assert f"pid {first.pid} on " in lines[0] and "--out-dir" in lines[0], lines
        assert second.stdout == ""
        assert refusal_s < 5
        after = {k: v for k, v in _snapshot(out).items() if not k.startswith(("checkpoints", "heartbeat", "train"))}
        assert after == before  # no previous/, no probe, the lock file untouched
        # The second never wrote a heartbeat: every line of the one heartbeat file is the first's.
        pids = {line.split('"pid": ')[1].split(",")[0] for line in (out / "heartbeat_rank0.jsonl").open()}
        assert pids == {str(first.pid)}
        # Readers do not take the lock: the report and the watchdog read the folder while it is held.
        for reader in (["launch.report", str(out)], ["launch.watchdog", "--dir", str(out), "--once"]):
            cmd_r = [sys.executable, "-m", *reader]
            rr = subprocess.run(cmd_r, cwd=ROOT, env=_env(cache), capture_output=True, text=True, timeout=120)
            assert rr.returncode in (0, 1) and "in use by another trainer" not in rr.stdout + rr.stderr, rr.stderr
            assert f"run: {out}" in rr.stdout or reader[0] == "launch.watchdog", rr.stdout
        assert runlock.holder(out)["pid"] == first.pid
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=60)
    # SIGKILL: no cleanup ran, the lock file is still there; the kernel dropped the lock.
    assert (out / runlock.LOCK_FILE).is_file()
    steps = _steps(out)
    again = subprocess.run(
        _cmd(out, steps[-1] + 1), cwd=ROOT, env=_env(cache), capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resume: step {steps[-1]} from" in again.stdout, again.stdout[-2000:]
