"""A stop for a full disk says so in its own line and nothing else; the same command then resumes.

The disk-full run writes into a small tmpfs (mounting needs root; skipped otherwise), so
orbax fails for real, with writes still in flight when it gives up on the save.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from nsa_jax.rundir import orbax_errors, resume

from helpers import TINY_SAVING_RUN

ROOT = pathlib.Path(__file__).resolve().parent.parent

TINY = [*TINY_SAVING_RUN, "checkpoint.max_to_keep=10"]


def _closed_loop_error() -> tuple[BaseException, object]:
    loop = asyncio.new_event_loop()
    loop.close()
    try:
        loop.call_soon_threadsafe(print)
    except RuntimeError as e:
        return e, e.__traceback__.tb_next  # as a C callback sees it: from call_soon_threadsafe on
    raise AssertionError("a closed loop accepted a callback")


def test_only_the_closed_loop_callbacks_of_a_failed_save_are_dropped():
    exc, tb = _closed_loop_error()
    assert orbax_errors.is_closed_loop_callback(exc, tb)
    assert not orbax_errors.is_closed_loop_callback(RuntimeError("Event loop is closed"), None)  # raised elsewhere
    try:
        raise RuntimeError("something else")
    except RuntimeError as e:
        assert not orbax_errors.is_closed_loop_callback(e, e.__traceback__)
    assert not orbax_errors.is_closed_loop_callback(ValueError("Event loop is closed"), tb)


def _leave_unretrieved_write_error(filename: str, gather: bool = False) -> None:
    """A write raised in code compiled as `filename`, whose exception nobody awaits, then collected: its
    task's, or with `gather` the exception of a gather over it (asyncio names that a _GatheringFuture)."""
    ns: dict = {}
    source = "async def write():\n    raise ValueError('RESOURCE_EXHAUSTED: No space left')\n"
    exec(compile(source, filename, "exec"), ns)
    loop = asyncio.new_event_loop()

    async def save():
        pending = asyncio.gather(ns["write"]()) if gather else loop.create_task(ns["write"]())
        await asyncio.sleep(0.01)  # the write fails; its exception is never retrieved
        del pending

    loop.run_until_complete(save())
    loop.close()
    gc.collect()  # asyncio logs an unretrieved exception when its task or future is collected


def _leave_unretrieved_future_error(message: str) -> None:
    """A future (as tensorstore's write, wrapped for asyncio) failed with `message`, never awaited, collected."""
    loop = asyncio.new_event_loop()
    future = loop.create_future()
    future.set_exception(ValueError(message))
    del future
    loop.close()
    gc.collect()


@pytest.mark.slow
def test_unretrieved_orbax_write_errors_are_dropped_and_others_kept(caplog):
    orbax_errors.silence_closed_loop_callbacks()
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        _leave_unretrieved_write_error("/site-packages/orbax/checkpoint/_src/serialization/fake.py")
        _leave_unretrieved_future_error(
            'RESOURCE_EXHAUSTED: Error writing "params.w/0.0" in OCDBT database at local file '
            '"/run/checkpoints/8.orbax-checkpoint-tmp/state.orbax-checkpoint-tmp/ocdbt.process_0/": No space left'
        )
        _leave_unretrieved_write_error("/site-packages/orbax/checkpoint/_src/serialization/fake.py", gather=True)
        assert "never retrieved" not in caplog.text
        _leave_unretrieved_write_error("/site-packages/somewhere/else.py")
        _leave_unretrieved_future_error("RESOURCE_EXHAUSTED: writing /data/elsewhere: No space left")
        _leave_unretrieved_write_error("/site-packages/somewhere/else.py", gather=True)
    assert "Task exception was never retrieved" in caplog.text and "RESOURCE_EXHAUSTED" in caplog.text
    assert "Future exception was never retrieved" in caplog.text and "/data/elsewhere" in caplog.text
    assert "_GatheringFuture exception was never retrieved" in caplog.text


def _mount(path: pathlib.Path, size: str, remount: bool = False) -> bool:
    opts = f"remount,size={size}" if remount else f"size={size}"
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True)
    return r.returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="mounting a tmpfs needs root")
def test_disk_full_stop_is_one_line_and_the_same_command_resumes(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    # One checkpoint of this model takes about 0.9 MB: three fit, the fourth does not.
    if not _mount(disk, "3300k"):
        pytest.skip("cannot mount a tmpfs here")
    try:
        out = disk / "run"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("NSA_", "JAX_COORD", "JAX_NUM", "JAX_PROC"))}
        env.update(
            PYTHONPATH=str(ROOT),
            JAX_PLATFORMS="cpu",
            XLA_FLAGS="--xla_force_host_platform_device_count=2",
            JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"),
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        )
        sets = [a for s in TINY for a in ("--set", s)]
        cmd = [sys.executable, "-m", "launch.train", "--config", "cpu_tiny", "--steps", "12", "--out-dir", str(out)]
        r = subprocess.run([*cmd, *sets], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        lines = r.stderr.splitlines()
        print(f"disk-full stop: exit {r.returncode}, {len(lines)} stderr line(s)")
        assert r.returncode == 74, r.stderr[-3000:]
        assert len(lines) <= 3, r.stderr[-3000:]
        assert lines[0].startswith("error: checkpoint step ") and "disk full" in lines[0], lines
        committed = resume.complete_steps(resume.checkpoint_dir(out))
        assert committed and f"newest committed checkpoint is step {committed[-1]}" in lines[0]
        # The operator frees space; the same command resumes from the newest committed step.
        assert _mount(disk, "20m", remount=True)
        again = subprocess.run([*cmd, *sets], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stderr[-3000:]
        assert f"resume: step {committed[-1]} from" in again.stdout, again.stdout[-2000:]
        assert again.stderr == "", again.stderr[-3000:]
        assert resume.complete_steps(resume.checkpoint_dir(out))[-1] == 12
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
