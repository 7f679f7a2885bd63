"""Checkpoints: exact resume after SIGTERM and SIGKILL, half-written and corrupt saves,
restore onto another device count, the resume policy of launch.train, load_for_inference.

The subprocess runs share a persistent compilation cache, so only the first one pays
for compiling the train step. One chain of runs on a small text corpus (epochs of about
three optimizer steps, accumulate 2) is compared with an uninterrupted run:

  straight run to N=8                                   -> reference rows and params
  run A: no periodic saves; SIGTERM while step 4 is in flight -> exit 0, checkpoint 4
  run B: resumes at 4, SIGKILL inside the commit of 6   -> step 6 left uncommitted
  run C: resumes at 4 (never from the half-written 6)   -> rows and params equal the reference
"""

from __future__ import annotations

import csv
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from launch.train import prepare_out_dir
from nsa_jax.config import ConfigError, load_config
from nsa_jax.mesh import make_mesh, replicated
from nsa_jax.ops import preemption
from nsa_jax.rundir import checkpoint as C
from nsa_jax.rundir import checksums, resume
from nsa_jax.rundir import files as rf
from nsa_jax.step import step as S
from nsa_jax.step.strategies import make_plan
from nsa_jax.train.loop import Trainer
from nsa_jax.train.saves import RunSaves

from helpers import NSA_CSV_COLUMNS, TINY_RUN, TINY_SAVING_RUN, cpu_env, set_flags

ROOT = pathlib.Path(__file__).resolve().parent.parent

N = 8
SETS = [
    "model.vocab_size=320",
    *TINY_RUN,
    "train.accumulate=2",
    "train.log_every=1",
    "train.eval_every=1000",
    "checkpoint.save_every=2",
    "checkpoint.max_to_keep=3",
    "data.dataset=text",
    "data.val_fraction=0.0",
    "logging.tensorboard=false",
]
# Columns that must match bit for bit (timings differ run to run).
EXACT = (
    "step",
    "loss",
    "lr",
    "grad_norm",
    "tokens",
    "skipped",
    *NSA_CSV_COLUMNS,
)

# Runs launch.train after arranging a deterministic interruption (CKPT_TEST_MODE):
#   sigterm:        the process sends itself SIGTERM once step CKPT_TEST_AT is logged
#   kill_in_commit: SIGKILL when orbax is about to commit step CKPT_TEST_AT, i.e. every
#                   file of it is written but the directory still has its temporary name
#   enospc:         the commit of step CKPT_TEST_AT fails in orbax's background thread with
#                   OSError(ENOSPC), as on a full disk
#   csv_enospc:     training.csv's row of step CKPT_TEST_AT fails with OSError(ENOSPC), as on a
#                   disk that fills between two checkpoint saves
DRIVER = r"""
import asyncio, os, signal, sys
mode, at = os.environ.get("CKPT_TEST_MODE", ""), int(os.environ.get("CKPT_TEST_AT", "0"))
if mode == "sigterm":
    from tests.helpers import sigterm_after_step
    sigterm_after_step(at)
elif mode == "kill_in_commit":
    from orbax.checkpoint._src.path import atomicity
    finalize = atomicity.AtomicRenameTemporaryPath.finalize
    async def _finalize(self):
        if self.get().name.startswith(f"{at}."):
            os.kill(os.getpid(), signal.SIGKILL)
        return await finalize(self)
    atomicity.AtomicRenameTemporaryPath.finalize = _finalize
elif mode == "enospc":
    import errno
    from orbax.checkpoint._src.path import atomicity
    finalize = atomicity.AtomicRenameTemporaryPath.finalize
    async def _finalize(self):
        if self.get().name.startswith(f"{at}."):
            raise OSError(errno.ENOSPC, "No space left on device", str(self.get()))
        return await finalize(self)
    atomicity.AtomicRenameTemporaryPath.finalize = _finalize
elif mode == "csv_enospc":
    import errno
    from nsa_jax.rundir import files as runfiles
    write = runfiles.CsvWriter.write
    def _write(self, row):
        if self.path.name == "training.csv" and row.get("step") == at:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(self, row)
    runfiles.CsvWriter.write = _write
from launch.train import main
sys.exit(main(sys.argv[1:]))
"""


def _env(cache: pathlib.Path, devices: int, extra: dict | None = None) -> dict:
    env = {k: v for k, v in cpu_env(devices, cache).items() if not k.startswith("CKPT_TEST_")}
    return {**env, **(extra or {})}


sets = set_flags


def rows(out: pathlib.Path) -> list[dict]:
    with open(out / "training.csv") as f:
        return list(csv.DictReader(f))


def _resumes_to_the_reference(env, out: pathlib.Path, reference: pathlib.Path, step: int) -> None:
    """The same command resumes `out` from checkpoint `step` and ends with the straight run's rows."""
    again = env["train"](out)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resume: step {step} from" in again.stdout
    assert exact(rows(out)) == exact(rows(reference))


def exact(rs: list[dict]) -> list[tuple]:
    return [tuple(r[c] for c in EXACT if c in r) for r in rs]


def tree_equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Corpus, compile cache, and a `train(out, steps, mode=, at=)` runner."""
    base = tmp_path_factory.mktemp("ckpt")
    corpus = base / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(0)
    words = ["sparse", "attention", "block", "token", "window", "select", "gate", "query", "key", "value"]
    for i in range(3):  # ~1.6 KB in all: one epoch is about three optimizer steps of 520 tokens
        (corpus / f"doc{i}.txt").write_text(" ".join(rng.choice(words, 90)) + "\n")
    cache = base / "jax_cache"

    def train(out, steps=N, mode="", at=0, devices=2, extra_sets=(), args=()):
        cmd = [
            sys.executable,
            "-c",
            DRIVER,
            "--config",
            "cpu_tiny",
            "--steps",
            str(steps),
            "--out-dir",
            str(out),
            *sets(SETS + [f"data.path={corpus}", *extra_sets]),
            *args,
        ]
        extra = {"CKPT_TEST_MODE": mode, "CKPT_TEST_AT": str(at)} if mode else {}
        return subprocess.run(
            cmd, cwd=ROOT, env=_env(cache, devices, extra), capture_output=True, text=True, timeout=600
        )

    return {"base": base, "corpus": corpus, "cache": cache, "train": train}


@pytest.fixture(scope="module")
def reference(env):
    out = env["base"] / "straight"
    r = env["train"](out)
    assert r.returncode == 0, r.stderr[-3000:]
    assert resume.complete_steps(resume.checkpoint_dir(out)) == [4, 6, 8]  # max_to_keep=3, the final save included
    return out


def cfg_of(env, **over):
    extra = [f"{k}={v}" for k, v in over.items()]
    return load_config("cpu_tiny", SETS + [f"data.path={env['corpus']}", *extra])


@pytest.mark.slow
def test_sigterm_then_kill_in_commit_then_resume_is_exact(env, reference):
    ref_rows = rows(reference)
    assert [int(r["step"]) for r in ref_rows] == list(range(1, N + 1))
    out = env["base"] / "interrupted"

    # SIGTERM arrives while step 4 is in flight: it finishes, is logged and saved, exit 0.
    # (No periodic saves in this run, so checkpoint 4 can only come from the SIGTERM path.)
    a = env["train"](out, mode="sigterm", at=3, extra_sets=["checkpoint.save_every=100"])
    assert a.returncode == 0, a.stderr[-3000:]
    assert "preempted: SIGTERM received; stopping after step 4" in a.stdout
    assert resume.complete_steps(resume.checkpoint_dir(out)) == [4]
    assert exact(rows(out)) == exact(ref_rows[:4])

    # Resumed at 4, then killed with every file of step 6 written but not committed.
    b = env["train"](out, mode="kill_in_commit", at=6)
    assert b.returncode == -signal.SIGKILL, (b.returncode, b.stderr[-3000:])
    assert "resume: step 4 from" in b.stdout
    assert resume.complete_steps(resume.checkpoint_dir(out)) == [4]
    assert [p.name.split(".")[0] for p in resume.uncommitted_dirs(resume.checkpoint_dir(out))] == ["6"]
    # Steps after 4 were logged before the kill (the commit runs in the background, so
    # the loop may have gone on past 6); the resume must drop them.
    assert [int(r["step"]) for r in rows(out)][:6] == [1, 2, 3, 4, 5, 6]

    # Resumes from the complete step 4, not the half-written 6, and reproduces the straight run.
    c = env["train"](out)
    assert c.returncode == 0, c.stderr[-3000:]
    assert "resume: step 4 from" in c.stdout
    assert exact(rows(out)) == exact(ref_rows)  # rows 5, 6 of run B replaced, not duplicated
    assert not resume.uncommitted_dirs(resume.checkpoint_dir(out))
    final = [C.restore_params(resume.checkpoint_dir(d) / "8") for d in (out, reference)]
    assert tree_equal(*final)
    # The optimizer moments and RNG too, not only the weights.
    full = [_host_state(resume.checkpoint_dir(d) / "8") for d in (out, reference)]
    assert tree_equal(*full)
    beats = [json.loads(line) for line in (out / "heartbeat_rank0.jsonl").read_text().splitlines()]
    assert [b["step"] for b in beats if b["event"] == "resume"] == [4, 4]  # appended across the runs


def _host_state(step_dir: pathlib.Path):
    import orbax.checkpoint as ocp

    path = (step_dir / "state").absolute()
    with ocp.PyTreeCheckpointer() as ck:
        tree = ck.metadata(path).item_metadata.tree
        return ck.restore(
            path,
            args=ocp.args.PyTreeRestore(
                restore_args=jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
            ),
        )


def _copy(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.slow
def test_saved_on_two_devices_restores_on_one(env, reference, tmp_path):
    out = _copy(reference, tmp_path / "run")
    cfg = cfg_of(env, **{"train.out_dir": str(out)})
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("data",))
    saved = json.loads((resume.checkpoint_dir(out) / "8" / "data" / "metadata").read_text())
    assert saved["devices"] == 2 and saved["process_count"] == 1
    ck = C.Checkpointer(make_plan(cfg, mesh), out)
    try:
        r = ck.restore_latest()
    finally:
        ck.close()
    assert r.step == 8 and int(r.state.step) == 8
    for leaf in jax.tree.leaves(r.state):
        assert leaf.sharding.device_set == {jax.devices()[0]}
    host = _host_state(resume.checkpoint_dir(out) / "8")
    assert tree_equal(r.state.params, host["params"]) and tree_equal(r.state.opt_state, host["opt_state"])
    # The data position is per process, not per device: it carries over unchanged.
    assert r.train_data == saved["processes"][0]["train"] and r.train_data["kind"] == "text"
    from nsa_jax.data import make_dataset

    ds = make_dataset(cfg, "train")
    try:
        ds.set_state(r.train_data)
        assert next(ds).shape == (4, 65)
    finally:
        ds.close()


def _truncate_state(step_dir: pathlib.Path) -> None:
    for f in (step_dir / "state").rglob("*"):
        if f.is_file() and f.stat().st_size > 64:
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


@pytest.mark.slow
def test_corrupt_latest_falls_back_to_previous(env, reference, tmp_path):
    out = _copy(reference, tmp_path / "run")
    cdir = resume.checkpoint_dir(out)
    _truncate_state(cdir / "8")
    (cdir / "6" / "data" / "metadata").write_text('{"format": 1, "process_')  # cut short
    cfg = cfg_of(env, **{"train.out_dir": str(out)})
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("data",))
    warnings = []
    ck = C.Checkpointer(make_plan(cfg, mesh), out, warn=warnings.append)
    try:
        r = ck.restore_latest()
    finally:
        ck.close()
    assert r.step == 4 and int(r.state.step) == 4
    assert tree_equal(r.state.params, C.restore_params(resume.checkpoint_dir(reference) / "4"))
    assert sum("does not read back" in w for w in warnings) == 2, warnings
    # The unreadable steps are moved aside, never deleted, and no longer count as checkpoints.
    assert resume.complete_steps(cdir) == [4]
    assert sorted(p.name.split("-")[0] for p in (out / rf.CORRUPT_DIR).iterdir()) == ["6", "8"]

    # load_for_inference falls back the same way (from a fresh copy).
    out2 = _copy(reference, tmp_path / "run2")
    _truncate_state(resume.checkpoint_dir(out2) / "8")
    cfg2, params = C.load_for_inference(out2, warn=warnings.append)
    assert cfg2.model == cfg.model and tree_equal(params, C.restore_params(resume.checkpoint_dir(reference) / "6"))


def _largest_file(d: pathlib.Path) -> pathlib.Path:
    return max((f for f in d.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)


def _restore(env, out, warnings):
    cfg = cfg_of(env, **{"train.out_dir": str(out)})
    ck = C.Checkpointer(make_plan(cfg, make_mesh(cfg, jax.devices())), out, warn=warnings.append)
    try:
        return ck.restore_latest()
    finally:
        ck.close()


@pytest.mark.slow
@pytest.mark.parametrize("where", [0.05, 0.3, 0.5, 0.7, 0.95])
def test_corrupted_array_bytes_fall_back_to_the_previous_checkpoint(env, reference, tmp_path, where):
    out = _copy(reference, tmp_path / "run")
    target = _largest_file(resume.checkpoint_dir(out) / "8" / "state")
    data = bytearray(target.read_bytes())
    at = int(len(data) * where)
    data[at : at + 8] = np.random.default_rng(at).integers(0, 256, 8, dtype=np.uint8).tobytes()
    target.write_bytes(bytes(data))
    warnings: list[str] = []
    r = _restore(env, out, warnings)
    assert r.step == 6 and r.verified, warnings
    assert tree_equal(r.state.params, C.restore_params(resume.checkpoint_dir(reference) / "6"))
    assert any("checkpoint" in w and "/8" in w and "does not read back" in w for w in warnings), warnings
    assert resume.complete_steps(resume.checkpoint_dir(out)) == [4, 6]  # 8 moved aside, not deleted
    assert [p.name.split("-")[0] for p in (out / rf.CORRUPT_DIR).iterdir()] == ["8"]


@pytest.mark.slow
def test_checksum_mismatch_names_the_array_and_the_items(env, reference, tmp_path):
    # A changed value that still parses: only the checksums can tell.
    out = _copy(reference, tmp_path / "run")
    step8 = resume.checkpoint_dir(out) / "8"
    sums = json.loads((step8 / "checksums" / "metadata").read_text())
    key = next(k for k in sums["state"] if "params" in k)
    sums["state"][key] = (sums["state"][key] + 1) % 2**32
    (step8 / "checksums" / "metadata").write_text(json.dumps(sums))
    data_path = resume.checkpoint_dir(out) / "6" / "data" / "metadata"
    data = json.loads(data_path.read_text())
    data["devices"] += 1
    data_path.write_text(json.dumps(data))
    warnings: list[str] = []
    r = _restore(env, out, warnings)
    assert r.step == 4, warnings
    assert any(f"checksum mismatch in array {key}" in w for w in warnings), warnings
    assert any("checksum mismatch in the data item" in w for w in warnings), warnings
    # Inference reads the params only, and checks them the same way.
    out2 = _copy(reference, tmp_path / "run2")
    (resume.checkpoint_dir(out2) / "8" / "checksums" / "metadata").write_text(json.dumps(sums))
    msgs: list[str] = []
    _, params = C.load_for_inference(out2, warn=msgs.append)
    assert tree_equal(params, C.restore_params(resume.checkpoint_dir(reference) / "6"))
    assert len(msgs) == 1 and "checksum mismatch in array params" in msgs[0], msgs


@pytest.mark.slow
def test_failed_background_save_stops_the_run_and_keeps_the_last_checkpoint(env, reference, tmp_path):
    out = tmp_path / "full"
    r = env["train"](out, mode="enospc", at=4)
    assert r.returncode == 74, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "checkpoint step 4 was not saved: disk full" in errors[0], r.stderr[-3000:]
    assert "newest committed checkpoint is step 2" in errors[0]
    assert resume.complete_steps(resume.checkpoint_dir(out)) == [2]
    beats = [json.loads(line) for line in (out / "heartbeat_rank0.jsonl").read_text().splitlines()]
    assert [b["step"] for b in beats if b["event"] == "checkpoint"] == [2]  # written only once committed
    failed = [b for b in beats if b["event"] == "checkpoint_failed"]
    assert len(failed) == 1 and failed[0]["step"] == 4 and failed[0]["cause"].startswith("disk full")
    assert beats[-1]["event"] == "done" and beats[-1]["halted"] == "checkpoint_failed"
    # Found at the next step or the next save at the latest: no step past 6 ran.
    assert max(int(row["step"]) for row in rows(out)) <= 6
    # The same command resumes from the last committed step and ends where the straight run does.
    _resumes_to_the_reference(env, out, reference, step=2)


@pytest.mark.slow
def test_a_run_file_the_full_disk_refuses_stops_the_run_like_a_failed_save(env, reference, tmp_path):
    """The disk fills between two saves: training.csv's row of step 3 is refused (ENOSPC).

    The run stops at once with one error line and exit 74 (no traceback, no save on the
    way out), the committed checkpoint stays, and the same command resumes from it and
    ends where the straight run does.
    """
    out = tmp_path / "full_between_saves"
    r = env["train"](out, mode="csv_enospc", at=3)
    assert r.returncode == 74, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
    # One error line (before it, the boot's own notes and warnings, also on stderr).
    lines = [line for line in r.stderr.splitlines() if not line.startswith(("note:", "warning:"))]
    assert len(lines) == 1 and lines[0].startswith("error: training.csv could not be written: disk full"), lines
    assert "newest committed checkpoint is step 2" in lines[0] and "run the same command to resume" in lines[0]
    assert resume.complete_steps(resume.checkpoint_dir(out)) == [2]
    assert max(int(row["step"]) for row in rows(out)) == 2  # no row after the refused one
    beats = [json.loads(line) for line in (out / "heartbeat_rank0.jsonl").read_text().splitlines()]
    failed = [b for b in beats if b["event"] == "output_failed"]
    assert len(failed) == 1 and failed[0]["path"].endswith("training.csv") and failed[0]["committed_step"] == 2
    assert beats[-1]["event"] == "done" and beats[-1]["halted"] == "output_failed"
    _resumes_to_the_reference(env, out, reference, step=2)


@pytest.mark.slow
def test_a_finished_run_is_known_before_compiling(env, reference, tmp_path):
    out = _copy(reference, tmp_path / "run")
    r = env["train"](out)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "already holds step 8" in r.stdout and "compile:" not in r.stdout


@pytest.mark.slow
def test_no_readable_checkpoint_is_a_clear_error(env, reference, tmp_path):
    out = _copy(reference, tmp_path / "run")
    for s in resume.complete_steps(resume.checkpoint_dir(out)):
        _truncate_state(resume.checkpoint_dir(out) / str(s))
    cfg = cfg_of(env, **{"train.out_dir": str(out)})
    ck = C.Checkpointer(make_plan(cfg, make_mesh(cfg, jax.devices())), out, warn=lambda m: None)
    try:
        with pytest.raises(resume.CheckpointError, match="no checkpoint in .* reads back"):
            ck.restore_latest()
    finally:
        ck.close()
    with pytest.raises(resume.CheckpointError, match="reads back"):
        C.load_for_inference(out, warn=lambda m: None)


@pytest.mark.slow
def test_resume_with_another_model_is_refused(env, reference, tmp_path):
    out = _copy(reference, tmp_path / "run")
    cfg = cfg_of(env, **{"train.out_dir": str(out), "model.d_model": 96})
    ck = C.Checkpointer(make_plan(cfg, make_mesh(cfg, jax.devices())), out)
    try:
        with pytest.raises(resume.CheckpointError, match="model.d_model 64 -> 96"):
            ck.restore_latest()
    finally:
        ck.close()
    assert resume.complete_steps(resume.checkpoint_dir(out)) == [4, 6, 8]  # nothing moved aside


@pytest.mark.slow  # 22 s of training
def test_a_stage_that_trains_the_new_parts_alone_resumes_with_every_parameter_training(env, tmp_path):
    """train.trainable changes between the stages of one run: the optimizer state restores, the
    first stage moved nothing but the gates, the second moves the rest from where it was."""
    out = tmp_path / "run"
    first = env["train"](out, steps=2, devices=1, extra_sets=["train.trainable=[gate_fc1,gate_fc2]"])
    assert first.returncode == 0, first.stderr[-3000:]
    second = env["train"](out, steps=4, devices=1)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resume: step 2 from" in second.stdout
    assert [r["step"] for r in rows(out)] == ["1", "2", "3", "4"]

    def flat(tree):
        return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)}

    cfg = cfg_of(env)
    init = flat(S.create_state(S.make_plan(cfg, make_mesh(cfg, jax.devices()[:1]))).params)  # the run's own start
    two, four = (flat(C.restore_params(resume.checkpoint_dir(out) / str(s))) for s in (2, 4))
    assert init.keys() == two.keys()
    first_moved = {k for k in init if not np.array_equal(init[k], two[k])}
    second_moved = {k for k in two if not np.array_equal(two[k], four[k])}
    assert first_moved and all("gate_fc" in k for k in first_moved), sorted(first_moved)
    assert any("'q'" in k for k in second_moved) and any("mlp" in k for k in second_moved)


@pytest.mark.slow
def test_launcher_policy_protects_checkpoints(env, reference, tmp_path):
    out = _copy(reference, tmp_path / "run")
    cfg = cfg_of(env, **{"train.out_dir": str(out)})
    before = (out / "training.csv").read_text()
    # Checkpoints present: resume (nothing is touched).
    prepare_out_dir(str(out), False, cfg=cfg)
    assert (out / "training.csv").read_text() == before
    # --overwrite never deletes checkpoints.
    with pytest.raises(ConfigError, match="--overwrite-checkpoints"):
        prepare_out_dir(str(out), True, cfg=cfg)
    assert resume.complete_steps(resume.checkpoint_dir(out)) == [4, 6, 8]
    # Another model: refused before XLA starts, naming the differing key and the ways out.
    other = cfg_of(env, **{"train.out_dir": str(out), "model.n_layers": 2})
    with pytest.raises(ConfigError, match=r"model.n_layers 1 -> 2.*--out-dir.*--overwrite-checkpoints"):
        prepare_out_dir(str(out), False, cfg=other)
    # Longer training or another LR is a resume, not a conflict.
    prepare_out_dir(str(out), False, cfg=cfg_of(env, **{"train.steps": 20, "train.lr": 5e-4}))
    # Only uncommitted saves: no checkpoint. Another model's run is refused, naming it; the same
    # run is started again from step 0, its files moved aside (nothing deleted).
    shutil.move(str(resume.checkpoint_dir(out) / "8"), str(resume.checkpoint_dir(out) / "8.orbax-checkpoint-tmp-1"))
    for s in (4, 6):
        shutil.rmtree(resume.checkpoint_dir(out) / str(s))
    with pytest.raises(ConfigError, match=r"holds another run, without a checkpoint.*model.n_layers 1 -> 2"):
        prepare_out_dir(str(out), False, cfg=other)
    plan = prepare_out_dir(str(out), False, cfg=cfg)
    assert plan.action == "restart" and "stopped after step 8 without a checkpoint" in plan.message
    assert (out / "previous").is_dir() and not (out / "training.csv").exists()
    # --overwrite-checkpoints deletes them, and the artifacts, explicitly.
    shutil.copytree(resume.checkpoint_dir(reference), resume.checkpoint_dir(out), dirs_exist_ok=True)
    shutil.copy(reference / "training.csv", out / "training.csv")
    prepare_out_dir(str(out), False, overwrite_checkpoints=True, cfg=cfg)
    assert not resume.checkpoint_dir(out).exists() and not (out / "training.csv").exists()


def test_sigterm_guard_sets_a_flag_instead_of_exiting():
    seen, exits = [], []
    # A stand-in for the default action, so a broken guard fails the test instead of ending pytest.
    before = signal.signal(signal.SIGTERM, lambda *_: seen.append("default"))
    try:
        calm = preemption.PreemptionGuard(exit_fn=exits.append)
        calm.install()
        calm.uninstall()
        os.kill(os.getpid(), signal.SIGTERM)  # no stop while installed: the previous handler is back
        assert seen == ["default"] and not exits
        guard = preemption.PreemptionGuard(exit_fn=exits.append)
        guard.install()
        try:
            assert not guard.stop_requested()
            os.kill(os.getpid(), signal.SIGTERM)
            assert guard.stop_requested() and seen == ["default"]
        finally:
            guard.uninstall()
        # After a stop the run tears down: a later SIGTERM (a scheduler's escalation) ends it at once.
        os.kill(os.getpid(), signal.SIGTERM)
        assert exits == [128 + signal.SIGTERM] and seen == ["default"]
    finally:
        signal.signal(signal.SIGTERM, before)


AGREE = r"""
import os, signal, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(os.environ["COORD"], 2, int(sys.argv[1]))
import numpy as np
from nsa_jax.ops.preemption import PreemptionGuard
mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("data",))
guard = PreemptionGuard(mesh)
guard.install()
for step in range(1, 50):
    if guard.stop_requested():
        print("stopped before", step, flush=True)
        break
    if jax.process_index() == 1 and step == 3:
        os.kill(os.getpid(), signal.SIGTERM)  # only process 1 is preempted
jax.distributed.shutdown()
"""


@pytest.mark.slow
def test_processes_agree_on_the_stop_step(env):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    e = _env(env["cache"], 1, {"COORD": f"127.0.0.1:{port}"})
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", AGREE, str(i)],
            cwd=ROOT,
            env=e,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (o, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    lines = [(o.strip().splitlines() or ["never stopped"])[-1] for o, _ in outs]
    # Flag raised after step 3 of process 1, OR-reduced at boundary 4, read by both at boundary 5.
    assert lines == ["stopped before 5", "stopped before 5"], lines


@pytest.mark.slow
def test_generate_loads_a_checkpoint(env, reference):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.generate",
            "--ckpt",
            str(reference),
            "--prompt",
            "hi",
            "--max-new-tokens",
            "4",
            "--temperature",
            "0",
        ],
        cwd=ROOT,
        env=_env(env["cache"], 1),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("hi") and len(r.stdout.strip()) > 2


def test_save_returns_after_the_copy_off_the_device(tmp_path):
    """The loop donates the state to the next step right after save() returns: the
    background write must not see the donated (overwritten) buffers."""
    cfg = load_config("cpu_tiny", SETS[:6] + [f"train.out_dir={tmp_path}"])
    mesh = make_mesh(cfg)
    bump = jax.jit(
        lambda s: s.replace(step=s.step + 1, params=jax.tree.map(lambda p: p * 2.0 + 1.0, s.params)),
        donate_argnums=0,
        out_shardings=replicated(mesh),
    )
    state = bump(S.create_state(S.make_plan(cfg, mesh)))
    expect = jax.device_get(state.params)
    ck = C.Checkpointer(make_plan(cfg, mesh), tmp_path)
    try:
        info = ck.save(1, state, {"position": 0}, None)
        for _ in range(3):
            state = bump(state)
        jax.block_until_ready(state)
    finally:
        ck.close()
    assert info["save_s"] > 0 and resume.complete_steps(resume.checkpoint_dir(tmp_path)) == [1]
    assert tree_equal(C.restore_params(resume.checkpoint_dir(tmp_path) / "1"), expect)


def test_checksums_agree_on_host_and_device_and_see_any_one_changed_element():
    rng = np.random.default_rng(0)
    tree = {
        "f32": rng.standard_normal((3, 50)).astype(np.float32),
        "bf16": rng.standard_normal(77).astype(jax.numpy.bfloat16),
        "i8": rng.integers(-128, 127, 33).astype(np.int8),
        "u32": rng.integers(0, 2**32, 9, dtype=np.uint32),
        "scalar": np.int32(7),
    }
    host = checksums.host_checksums(tree)
    sums = checksums._tree_checksums(tree)
    device = {jax.tree_util.keystr(k): int(v) for k, v in jax.tree_util.tree_leaves_with_path(sums)}
    assert host == device and len(host) == 5
    # Sharded over two devices: the same global value.
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:2]), ("data",))
    sharded = jax.device_put(tree["f32"], jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "data")))
    assert int(checksums._tree_checksums(sharded)) == host["['f32']"]
    # One element changed by its lowest bit, anywhere, or two elements swapped: another checksum.
    for i in (0, 17, 149):
        bad = tree["f32"].copy().reshape(-1)
        bad.view(np.uint32)[i] ^= 1
        assert checksums.host_checksums({"f32": bad.reshape(3, 50)})["['f32']"] != host["['f32']"]
    swapped = tree["f32"].copy().reshape(-1)
    swapped[[3, 4]] = swapped[[4, 3]]
    assert checksums.host_checksums({"f32": swapped.reshape(3, 50)})["['f32']"] != host["['f32']"]


class _Clock:
    """A time source that moves `step` seconds at every reading."""

    def __init__(self, step: float):
        self.t, self.step = 0.0, step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


def _saved_steps(out: pathlib.Path, *sets: str, clock=None, monkeypatch=None) -> list[int]:
    cfg = load_config(
        "cpu_tiny",
        [*TINY_SAVING_RUN, "train.steps=6", "checkpoint.save_every=1000", "checkpoint.max_to_keep=10", *sets]
        + [f"train.out_dir={out}"],
    )
    if clock is not None:
        monkeypatch.setattr(RunSaves, "clock", clock)
    assert Trainer(cfg, print_fn=lambda m: None).run()["steps_done"] == 6
    return resume.complete_steps(resume.checkpoint_dir(out))


@pytest.mark.slow
def test_a_run_also_saves_on_wall_clock_time(tmp_path, monkeypatch):
    # The real clock: a tiny run of seconds is far from the default 30 minutes.
    assert _saved_steps(tmp_path / "real") == [6]
    # Each reading of the clock moves 40 s: with save_minutes=1 a save is due every other step.
    fast = _Clock(40.0)
    saved = _saved_steps(tmp_path / "minutes", "checkpoint.save_minutes=1", clock=fast, monkeypatch=monkeypatch)
    assert saved[-1] == 6 and len(saved) >= 3, saved  # the last step, and saves on the way
    # The same clock with save_minutes=0: steps only (the last one).
    assert _saved_steps(tmp_path / "steps", "checkpoint.save_minutes=0", clock=fast, monkeypatch=monkeypatch) == [6]


def test_save_minutes_due_starts_at_the_first_step_and_restarts_at_each_save():
    cfg = load_config("cpu_tiny", ["checkpoint.save_minutes=2"])
    saves = RunSaves(cfg, None, None, {}, lambda what: None)
    now = [100.0]
    saves.clock = lambda: now[0]
    assert not saves.due(1)  # the clock starts here, not at construction (a compile may take minutes)
    now[0] += 119
    assert not saves.due(2)
    now[0] += 1
    assert saves.due(3)
    saves._last_save_t = now[0]  # what a save does
    assert not saves.due(4)
    assert not RunSaves(load_config("cpu_tiny", ["checkpoint.save_minutes=0"]), None, None, {}, None).due(1)


def test_save_minutes_must_not_be_negative():
    with pytest.raises(ConfigError, match="checkpoint.save_minutes must be >= 0"):
        load_config("cpu_tiny", ["checkpoint.save_minutes=-1"])


def test_another_block_scorer_resumes_with_a_note_and_another_shape_does_not():
    """The block scorers have no parameters (kernels/scorers.py): a checkpoint of one continues under
    another, said in the resume line; a change of the parameters' shapes still blocks."""
    from nsa_jax.config import load_config, to_dict

    saved = to_dict(load_config("cpu_tiny"))
    blocking, other = resume.resume_conflicts(saved, load_config("cpu_tiny", ["model.nsa.scorer=minmax"]))
    assert blocking == []
    assert other == ["model.nsa.scorer 'cmp' -> 'minmax' (the block scorer has no parameters: the run continues "
                     "under the new one)"]  # fmt: skip
    blocking, _ = resume.resume_conflicts(saved, load_config("cpu_tiny", ["model.nsa.gate_hidden=8"]))
    assert blocking and blocking[0].startswith("model.nsa.gate_hidden")
