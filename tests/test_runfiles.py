"""The run directory schema (nsa_jax/rundir/files.py) and the out_dir policy (nsa_jax/rundir/resume.py): no jax."""

from __future__ import annotations

import csv
import json
import os
import pathlib

import pytest

from launch.train import compile_cache_dir, prepare_out_dir
from nsa_jax.config import ConfigError, load_config
from nsa_jax.rundir import files as rf
from nsa_jax.rundir import resume

from helpers import python_c

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_writer_quotes_and_the_reader_reads_back(tmp_path):
    path = tmp_path / "x.csv"
    w = rf.CsvWriter(path, ("step", "loss", "note"))
    w.write({"step": 1, "loss": 2.5, "note": 'a, "quoted" cell'})
    w.write({"step": 2, "loss": None, "note": ""})
    w.close()
    with open(path, newline="") as f:  # the standard reader agrees on every cell
        assert list(csv.reader(f)) == [["step", "loss", "note"], ["1", "2.5", 'a, "quoted" cell'], ["2", "", ""]]
    parser = rf.CsvRows(text_columns=("note",))
    rows = [r for line in path.read_text().splitlines() if (r := parser.feed(line)) is not None]
    assert rows == [{"step": 1.0, "loss": 2.5, "note": 'a, "quoted" cell'}, {"step": 2.0, "loss": None, "note": None}]


def test_reader_skips_and_names_what_it_cannot_use(tmp_path):
    path = tmp_path / "training.csv"
    path.write_text("step,loss\n1,3.0\n2,abc\n1,2.0\n3,2.5,9\n,1.0\n4,2.0\n5,1.")  # the last line cut short
    problems: list[str] = []
    cols, rows = rf.read_csv(path, problems)
    assert cols == ["step", "loss"] and [r["step"] for r in rows] == [1.0, 4.0]
    text = "\n".join(problems)
    for piece in ("last line incomplete", "line 3 has a non-numeric value", "repeats step 1", "3 fields", "no step"):
        assert piece in text, text
    # Kept rows for a resume: step <= 3
    assert [r["step"] for r in rf.rows_upto(path, 3)] == [1.0]
    # A header-less file is read in the documented order.
    path.write_text("1,3.0,0.1,100\n")
    cols, rows = rf.read_csv(path, [])
    assert cols == list(rf.DOCUMENTED_COLUMNS[:4]) and rows[0]["toks_per_s"] == 100.0


def test_names_and_columns():
    assert rf.heartbeat_rank(rf.heartbeat_name(12)) == 12 and rf.heartbeat_rank("heartbeat_rankx.jsonl") is None
    assert rf.TRAIN_COLUMNS[3] == "toks_per_s"  # torch runbook scripts read column 3
    assert rf.GATE_COLUMNS == tuple(f"gate_{b}" for b in rf.BRANCHES) == ("gate_cmp", "gate_slc", "gate_win")
    assert {"checkpoint", "checkpoint_start", "checkpoint_failed", "step_end", "eval"} <= set(rf.EVENTS)
    assert len({rf.EXIT_OK, rf.EXIT_FAILED, rf.EXIT_USAGE, rf.EXIT_CHECKPOINT_FAILED, rf.EXIT_STALL}) == 5


def test_schema_modules_do_not_import_jax():
    mods = "nsa_jax.rundir.files, nsa_jax.rundir.resume, launch.watchdog, nsa_jax.report.reading"
    mods += ", nsa_jax.report.criteria, nsa_jax.report.text"
    code = f"import sys, {mods}; print('jax' in sys.modules)"
    r = python_c(code)
    assert r.stdout.strip() == "False", r.stderr


# ---------------------------------------------------------------------------
# out_dir policy


def cfg(out: pathlib.Path, *sets: str):
    return load_config("cpu_tiny", [f"train.out_dir={out}", *sets])


def fake_checkpoint(out: pathlib.Path, step: int, c) -> None:
    d = out / rf.CHECKPOINT_DIR / str(step) / "config"
    d.mkdir(parents=True)
    (d / "metadata").write_text(json.dumps(c.to_dict()))


def test_an_attempt_that_finished_no_step_is_restarted_and_kept(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "env.json").write_text("{}")
    (out / "training.csv").write_text(",".join(rf.TRAIN_COLUMNS) + "\n")  # header only
    (out / "heartbeat_rank0.jsonl").write_text('{"event": "boot", "step": 0}\n{"event": "compile", "step": 0}\n')
    plan = prepare_out_dir(str(out), False, cfg=cfg(out))
    assert plan.action == "restart"
    prev = list((out / rf.PREVIOUS_DIR).iterdir())
    assert len(prev) == 1 and sorted(p.name for p in prev[0].iterdir()) == [
        "env.json",
        "heartbeat_rank0.jsonl",
        "training.csv",
    ]
    assert rf.run_files(out) == []
    assert prepare_out_dir(str(out), False, cfg=cfg(out)).action == "fresh"


def _earlier_run(out: pathlib.Path, c, last_step: int, done: dict | None = None) -> None:
    """The files of a run of config `c` that finished `last_step` steps and saved no checkpoint."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "env.json").write_text(json.dumps({"config": c.to_dict()}))
    rows = "".join(f"{s},{5.0 - s / 100}\n" for s in range(1, last_step + 1))
    (out / "training.csv").write_text("step,loss\n" + rows)
    beats = [{"event": "step_end", "step": s, "rank": 0} for s in range(1, last_step + 1)]
    if done is not None:
        beats.append({"event": "done", "step": last_step, "rank": 0, **done})
    (out / "heartbeat_rank0.jsonl").write_text("".join(json.dumps(b) + "\n" for b in beats))


def test_a_run_stopped_before_its_first_checkpoint_is_restarted_from_step_0_and_kept(tmp_path):
    out = tmp_path / "run"
    c = cfg(out)
    # Killed (or a second Ctrl-C) at step 37 of a run saving every 100 steps.
    _earlier_run(out, c, 37, done=None)
    before = (out / "training.csv").read_text()
    plan = prepare_out_dir(str(out), False, cfg=c)
    assert plan.action == "restart", plan
    assert "stopped after step 37 without a checkpoint" in plan.message and "from step 0" in plan.message
    (prev,) = list((out / rf.PREVIOUS_DIR).iterdir())
    assert (prev / "training.csv").read_text() == before  # moved, not deleted
    assert rf.run_files(out) == []
    # A longer run of the same model is the same run asked for again: restarted too.
    _earlier_run(out, c, 5)
    assert prepare_out_dir(str(out), False, cfg=cfg(out, "train.steps=500")).action == "restart"


def test_a_folder_with_corrupt_checkpoints_only_is_restarted_keeping_them(tmp_path):
    out = tmp_path / "run"
    c = cfg(out)
    _earlier_run(out, c, 12)
    (out / rf.CORRUPT_DIR / "10-1700000000").mkdir(parents=True)
    plan = prepare_out_dir(str(out), False, cfg=c)
    assert plan.action == "restart" and f"{rf.CORRUPT_DIR}/ stays" in plan.message
    assert (out / rf.CORRUPT_DIR / "10-1700000000").is_dir()


def test_another_run_without_checkpoints_is_refused_naming_it_safe_choice_first(tmp_path):
    out = tmp_path / "run"
    _earlier_run(out, cfg(out, "model.d_model=96"), 37)
    with pytest.raises(ConfigError) as e:
        prepare_out_dir(str(out), False, cfg=cfg(out))
    msg = str(e.value)
    assert "holds another run" in msg and "training.csv to step 37" in msg and "model.d_model 96 -> 192" in msg
    assert "\n" not in msg and msg.index("--out-dir") < msg.index("--overwrite")
    assert (out / "training.csv").is_file() and not (out / rf.PREVIOUS_DIR).exists()
    assert prepare_out_dir(str(out), True, cfg=cfg(out)).action == "overwrite"
    assert not (out / "training.csv").exists()


def test_a_finished_run_without_checkpoints_is_refused(tmp_path):
    out = tmp_path / "run"
    c = cfg(out, "train.steps=20", "checkpoint.enabled=false")
    _earlier_run(out, c, 20, done={"steps_done": 20, "halted": None})
    with pytest.raises(ConfigError, match=r"finished run \(training.csv to step 20 of 20\).*--out-dir.*--overwrite"):
        prepare_out_dir(str(out), False, cfg=c)
    # Stopped by Ctrl-C at step 12 instead: nothing finished, restarted.
    _earlier_run(out, c, 12, done={"steps_done": 12, "halted": "sigint"})
    assert prepare_out_dir(str(out), False, cfg=c).action == "restart"


def test_finished_and_halted_runs_are_known_before_compiling(tmp_path):
    out = tmp_path / "run"
    c = cfg(out, "train.steps=20")
    fake_checkpoint(out, 20, c)
    plan = prepare_out_dir(str(out), False, cfg=c)
    assert plan.action == "finished" and "raise --steps" in plan.message
    assert prepare_out_dir(str(out), False, cfg=cfg(out, "train.steps=30")).action == "resume"
    rf.write_halt(out, "throughput_flatline", "watchdog: toks_per_s under 1")
    plan = prepare_out_dir(str(out), False, cfg=cfg(out, "train.steps=30"))
    assert plan.action == "halted" and "toks_per_s under 1" in plan.message and "rm " in plan.message


@pytest.mark.parametrize("where", ["below_a_file", "is_a_file", "not_permitted"])
def test_an_unwritable_out_dir_is_one_clear_error(tmp_path, where):
    f = tmp_path / "file"
    f.write_text("x")
    out = {"below_a_file": f / "run", "is_a_file": f, "not_permitted": pathlib.Path("/sys/nsa_jax_run")}[where]
    if where == "not_permitted" and os.access("/sys", os.W_OK) and not pathlib.Path("/sys/kernel").is_dir():
        pytest.skip("/sys is writable here")
    with pytest.raises(resume.OutDirError, match="cannot be written") as e:
        prepare_out_dir(str(out), False, cfg=cfg(out))
    assert "\n" not in str(e.value) and "--out-dir" in str(e.value)


def test_compile_cache_folder_flag_env_and_off():
    assert compile_cache_dir("/c", {"NSA_COMPILE_CACHE": "/e"}) == "/c"
    assert compile_cache_dir(None, {"NSA_COMPILE_CACHE": "/e", "JAX_COMPILATION_CACHE_DIR": "/j"}) == "/e"
    assert compile_cache_dir(None, {"JAX_COMPILATION_CACHE_DIR": "/j"}) == "/j"
    assert compile_cache_dir("off", {}) is None and compile_cache_dir(None, {"NSA_COMPILE_CACHE": "0"}) is None
    assert compile_cache_dir(None, {}).endswith(os.path.join("nsa_jax", "jax_compilation_cache"))
