"""`python -m launch.train` end to end in subprocesses: artifacts, toggles, errors."""

from __future__ import annotations

import csv
import json
import math
import pathlib
import re

import pytest

from launch.train import (
    BUCKET_FLAG,
    build_parser,
    fit_vocab_to_tokenizer,
    flag_overrides,
    prepare_out_dir,
    xla_flags_with_bucket,
)
from nsa_jax.config import ConfigError, load_config
from nsa_jax.runbook_env import env_overrides

from helpers import NSA_CSV_COLUMNS, TINY_RUN, cpu_env, python_c, run_module, set_flags

ROOT = pathlib.Path(__file__).resolve().parent.parent

TINY = TINY_RUN
HEARTBEAT_FIELDS = {"ts", "iso", "pid", "rank", "step", "msg", "memory", "event"}


def launch(args: list[str], env: dict[str, str] | None = None, devices: int = 2, timeout: int = 600):
    return run_module("launch.train", *args, env=cpu_env(devices, **(env or {})), timeout=timeout)


sets = set_flags


def read_heartbeat(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_run_writes_documented_artifacts_on_two_devices(tmp_path):
    out = tmp_path / "run"
    extra = ["train.log_every=2", "train.eval_every=2", "train.eval_batches=1"]
    r = launch(
        ["--config", "cpu_tiny", "--steps", "3", "--out-dir", str(out), *sets(TINY + extra)],
        env={"NSA_PREFILL_BATCHED": "1", "NSA_DDP_COMPRESS": "off", "NCCL_ALGO": "Ring"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"^compile: [\d.]+s \| per device: arguments ", r.stdout, re.M), r.stdout
    assert re.search(r"^step 2/3 \| loss \d+\.\d{4} \| lr \d\.\d\de-\d\d \| [\d,]+ tok/s \| ETA \S+", r.stdout, re.M)
    # The reduction as the torch runbook's `[ddp] gradient compression` line says it (NSA_DDP_COMPRESS=off).
    assert "strategy dp, gradients reduced in float32 (combine threshold 25 MB) ->" in r.stdout, r.stdout

    with open(out / "training.csv") as f:
        rows = list(csv.reader(f))
    header, body = rows[0], rows[1:]
    assert header[:6] == ["step", "loss", "lr", "toks_per_s", "grad_norm", "step_time_s"]
    assert {*NSA_CSV_COLUMNS, "val_loss"} <= set(header)
    assert [int(r[0]) for r in body] == [1, 2, 3]
    col = {name: i for i, name in enumerate(header)}
    for row in body:
        assert all(math.isfinite(float(row[col[c]])) for c in ("loss", "lr", "grad_norm", "gate_slc"))
        assert float(row[col["toks_per_s"]]) > 0 and float(row[col["step_time_s"]]) > 0
    assert [bool(r[col["val_loss"]]) for r in body] == [False, True, False]
    assert re.search(r"^step 2/3 \| .* \| val \d+\.\d{4} ppl \d+\.\d\d$", r.stdout, re.M), r.stdout
    with open(out / "val.csv") as f:
        val_rows = list(csv.DictReader(f))
    assert [int(v["step"]) for v in val_rows] == [2]
    v = val_rows[0]
    assert float(v["val_loss"]) == float(body[1][col["val_loss"]])
    assert math.isclose(float(v["val_ppl"]), math.exp(float(v["val_loss"])), rel_tol=1e-5)
    assert int(v["tokens"]) == 2 * 4 * 64 and v["retrieval_acc"] == ""

    beats = read_heartbeat(out / "heartbeat_rank0.jsonl")
    assert all(HEARTBEAT_FIELDS <= set(b) for b in beats)
    events = [b["event"] for b in beats]
    assert {"boot", "compile", "step_start", "progress", "step_end", "done"} <= set(events)
    assert [b["step"] for b in beats if b["event"] == "step_end"] == [1, 2, 3]
    boot = next(b for b in beats if b["event"] == "boot")
    assert (boot["strategy"], boot["grad_reduce_dtype"], boot["bucket_mb"]) == ("dp", "float32", 25.0), boot
    assert all(b["memory"]["bytes_in_use"] > 0 and b["rank"] == 0 for b in beats)
    # Every step is announced before it ends.
    for s in (1, 2, 3):
        start = next(i for i, b in enumerate(beats) if b["event"] == "step_start" and b["step"] == s)
        end = next(i for i, b in enumerate(beats) if b["event"] == "step_end" and b["step"] == s)
        assert start < end

    env = json.loads((out / "env.json").read_text())
    assert {"python", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint"} <= set(env["versions"])
    assert all(env["versions"][k] for k in ("python", "jax", "jaxlib", "flax", "optax"))
    assert len(env["devices"]) == 2 and env["mesh"]["shape"] == {"data": 2, "seq": 1}
    assert "--xla_force_host_platform_device_count=2" in env["XLA_FLAGS"]
    assert f"{BUCKET_FLAG}={25 * 2**20}" in env["XLA_FLAGS"]
    assert env["nsa_env"]["NSA_PREFILL_BATCHED"] == "1" and env["nccl_env"] == {"NCCL_ALGO": "Ring"}
    assert env["toggles"]["NSA_PREFILL_BATCHED"]["effect"].startswith("accepted, no effect")
    assert env["toggles"]["NSA_DDP_COMPRESS"]["effect"] == "applied: parallel.grad_reduce_dtype=float32"
    assert env["config"]["parallel"]["grad_reduce_dtype"] == "float32"
    assert env["config"]["model"]["n_layers"] == 1 and env["config"]["train"]["steps"] == 3
    assert set(env["attention_impl"]) == {"cmp", "slc", "win"}
    assert "git_sha" in env and env["compile"]["seconds"] > 0
    assert list((out / "tb").glob("events.out.tfevents.*"))

    # The same out_dir again: refused before anything is touched.
    before = (out / "training.csv").read_text()
    again = launch(["--config", "cpu_tiny", "--steps", "3", "--out-dir", str(out)])
    assert again.returncode == 2
    assert again.stderr.strip().count("\n") == 0 and again.stderr.startswith("error: ")
    assert "--out-dir" in again.stderr and "--overwrite" in again.stderr
    assert (out / "training.csv").read_text() == before


@pytest.mark.slow
def test_env_toggles_switch_artifacts_off(tmp_path):
    out = tmp_path / "quiet"
    # Only the compressed branch: the artifacts are the point here, and it compiles fastest. The
    # config by the runbooks' CONFIG= variable (no --config).
    args = ["--steps", "1", "--out-dir", str(out), *sets(TINY + ["model.nsa.branches=[cmp]"])]
    env = {"NSA_DISABLE_CSV_LOGS": "1", "NSA_TB_DISABLE": "1", "NSA_DISABLE_AUX_STATS": "1", "NSA_MEM_DUMP_EVERY": "1"}
    r = launch(args, env={**env, "CONFIG": "configs/cpu_tiny.yaml"}, devices=1)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not (out / "training.csv").exists() and not (out / "tb").exists()
    assert [b["step"] for b in read_heartbeat(out / "heartbeat_rank0.jsonl") if b["event"] == "step_end"] == [1]
    env = json.loads((out / "env.json").read_text())
    assert env["config"]["logging"]["csv"] is False and env["config"]["logging"]["tensorboard"] is False
    assert env["config"]["logging"]["aux_stats"] is False
    assert env["toggles"]["NSA_DISABLE_CSV_LOGS"]["effect"] == "applied: logging.csv=false"
    # NSA_MEM_DUMP_EVERY: each step's device memory profile, gzip'd pprof as jax writes it.
    assert (out / "memory" / "step1_rank0.prof").read_bytes()[:2] == b"\x1f\x8b"
    assert env["toggles"]["CONFIG"] == {
        "value": "configs/cpu_tiny.yaml",
        "effect": "applied: the config (configs/cpu_tiny.yaml)",
    }
    # cpu_tiny's own settings, not a100_pcie's (the default without --config).
    assert env["config"]["model"]["dtype"] == "float32" and env["config"]["parallel"]["strategy"] == "dp"
    assert env["config"]["model"]["nsa"]["attention_impl"] == load_config("cpu_tiny").model.nsa.attention_impl == "xla"


@pytest.mark.parametrize(
    "args,env",
    [
        (["--steps", "abc"], {}),
        (["--bogus"], {}),
        (["--config", "no_such_config"], {}),
        (["--set", "model.n_layers=-1"], {}),
        (["--set", "train.no_such_key=1"], {}),
        ([], {"NSA_DDP_COMPRESS": "fp8"}),
        ([], {"NSA_ACCUM": "two"}),
        (["--config", None], {"CONFIG": "configs/no_such.yaml"}),  # the runbooks' way, naming no file
        (["--set", "train.global_batch=3", *sets(t for t in TINY if "global_batch" not in t)], {}),  # 3 rows, 2 devices
    ],
)
@pytest.mark.slow
def test_bad_input_gives_one_error_line_and_status_2(tmp_path, args, env):
    base = ["--config", "cpu_tiny"] if args[:2] != ["--config", None] else []
    args = args[2:] if not base else args
    r = launch([*base, "--out-dir", str(tmp_path / "x"), *args], env=env)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr


@pytest.mark.parametrize("where", ["below_a_file", "is_a_file", "read_only_fs"])
def test_unusable_out_dir_gives_one_error_line_and_status_2_before_compiling(tmp_path, where):
    f = tmp_path / "file"
    f.write_text("x")
    out = {"below_a_file": f / "run", "is_a_file": f, "read_only_fs": pathlib.Path("/sys/nsa_jax_run")}[where]
    r = launch(["--config", "cpu_tiny", "--out-dir", str(out)])
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: train.out_dir {out} cannot be written"), r.stderr
    assert "compile:" not in r.stdout and f.read_text() == "x"


@pytest.mark.slow
def test_a_batch_that_cannot_fit_is_refused_before_training_and_restarts(tmp_path):
    out = tmp_path / "run"
    r = launch(["--config", "cpu_tiny", "--out-dir", str(out), "--set", "train.global_batch=32768"], devices=1)
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-3000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the compiled train step needs "), r.stderr[-3000:]
    for knob in ("TB per device", "train.global_batch (32768)", "train.accumulate", "train.seq_len", "model.remat"):
        assert knob in lines[0]
    assert "step 1/" not in r.stdout
    # Nothing was trained: the same folder is restarted, its files kept in previous/.
    cfg = load_config("cpu_tiny", [f"train.out_dir={out}"])
    assert prepare_out_dir(str(out), False, cfg=cfg).action == "restart"
    assert list((out / "previous").iterdir())


@pytest.mark.slow
def test_launcher_does_not_import_jax_before_setting_flags():
    code = "import sys, launch.train; print('jax' in sys.modules)"
    r = python_c(code)
    assert r.stdout.strip() == "False", r.stderr


def test_env_overrides_map_runbook_variables():
    sets_, applied = env_overrides(
        {
            "NSA_ACCUM": "2",
            "NSA_LR": "3e-4",
            "NSA_SEQ_LEN": "1024",
            "NSA_BATCH_SIZE": "4",
            "NSA_DDP_COMPRESS": "bf16",
            "NSA_DDP_BUCKET_MB": "100",
            "NSA_TB_DISABLE": "0",
            "NSA_DISABLE_CSV_LOGS": "1",
            "NSA_PREFILL_BATCHED": "1",
        }
    )
    cfg = load_config("a100_pcie", sets_)
    assert (cfg.train.accumulate, cfg.train.lr, cfg.train.seq_len, cfg.train.global_batch) == (2, 3e-4, 1024, 4)
    assert cfg.parallel.grad_reduce_dtype == "bfloat16" and cfg.parallel.bucket_mb == 100.0
    assert cfg.logging.tensorboard is True and cfg.logging.csv is False
    assert "NSA_PREFILL_BATCHED" not in applied and applied["NSA_ACCUM"] == "train.accumulate=2"
    off = load_config("a100_pcie", env_overrides({"NSA_DDP_COMPRESS": "off"})[0])
    assert off.parallel.grad_reduce_dtype == "float32"
    with pytest.raises(ConfigError, match="NSA_TB_DISABLE"):
        env_overrides({"NSA_TB_DISABLE": "yes"})


def test_convenience_flags_map_to_their_config_keys_and_set_wins():
    argv = "--dataset text --data-path /d --tokenizer byte --steps 7 --out-dir /o --loader-timeout 9"
    argv += " --synthetic-on-fail --precision fp32 --ddp 0 --set train.steps=8"
    cfg = load_config("cpu_tiny", flag_overrides(build_parser().parse_args(argv.split())))
    assert (cfg.data.dataset, cfg.data.path, cfg.data.tokenizer) == ("text", "/d", "byte")
    assert (cfg.train.steps, cfg.train.out_dir, cfg.data.loader_timeout) == (8, "/o", 9)
    assert cfg.data.synthetic_on_fail is True and cfg.model.dtype == "float32" and cfg.parallel.num_devices == 1
    assert flag_overrides(build_parser().parse_args([])) == []


def test_bucket_flag_is_appended_once():
    assert xla_flags_with_bucket("", 25) == f"{BUCKET_FLAG}={25 * 2**20}"
    assert xla_flags_with_bucket("--a=1", 100) == f"--a=1 {BUCKET_FLAG}={100 * 2**20}"
    mine = f"--a=1 {BUCKET_FLAG}=5"
    assert xla_flags_with_bucket(mine, 100) == mine


@pytest.mark.slow
def test_remarks_go_to_stderr_and_the_kernels_a_cpu_runs_instead_are_named(tmp_path):
    # compressed_kernel=cudnn (which needs bf16) on a CPU: the XLA path runs; cpu_tiny is sized for a CPU,
    # so the warning names the flag that gives the CPU path, not another config.
    over = [*TINY, "model.nsa.compressed_kernel=cudnn"]
    r = launch(
        [
            "--config",
            "cpu_tiny",
            "--steps",
            "1",
            "--precision",
            "bf16",
            "--out-dir",
            str(tmp_path / "run"),
            *sets(over),
        ],
        devices=1,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out, err = r.stdout.splitlines(), r.stderr.splitlines()
    assert not [line for line in out if line.startswith(("warning:", "note:", "error:"))], r.stdout
    assert (
        "warning: model.dtype bfloat16 is meant for a GPU and runs slower on a CPU; for the CPU path run the "
        "same command with --precision fp32"
    ) in err
    assert (
        "note: kernels: model.nsa.compressed_kernel=cudnn runs as xla-chunked (attention_impl=xla runs every "
        "branch on XLA)"
    ) in err
    assert "cpu_tiny" not in r.stderr
    assert any(line.startswith("boot: 1 process, 1 cpu device on the data axis") for line in out), r.stdout
    assert any(line.startswith("done: 1 step in ") for line in out), r.stdout


def test_overwrite_clears_an_earlier_run(tmp_path):
    (tmp_path / "tb").mkdir()
    (tmp_path / "tb" / "events.out.tfevents.1").write_text("x")
    for name in ("heartbeat_rank0.jsonl", "env.json", "notes.txt"):
        (tmp_path / name).write_text("x")
    (tmp_path / "training.csv").write_text("step,loss\n1,5.0\n")  # a finished step: not a restart
    other = load_config("cpu_tiny", ["model.n_layers=2"]).to_dict()
    (tmp_path / "env.json").write_text(json.dumps({"config": other}))  # of another model
    with pytest.raises(ConfigError, match="holds another run"):
        prepare_out_dir(str(tmp_path), overwrite=False, cfg=load_config("cpu_tiny", []))
    prepare_out_dir(str(tmp_path), overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    prepare_out_dir(str(tmp_path), overwrite=False)  # nothing left to protect


def test_model_vocabulary_follows_the_tokenizer():
    text = load_config("cpu_tiny", ["data.dataset=text", "data.path=unused"])
    assert text.model.vocab_size == 256
    fitted, note = fit_vocab_to_tokenizer(text)
    assert fitted.model.vocab_size == 320  # 256 bytes + EOS + PAD = 258, rounded up to 64
    assert "model.vocab_size 256 -> 320" in note and "'byte'" in note
    assert fitted.model.d_model == text.model.d_model and fitted.data == text.data
    # A vocabulary that already covers the tokenizer is kept; non-file datasets are untouched.
    big = load_config("cpu_tiny", ["data.dataset=text", "model.vocab_size=512"])
    assert fit_vocab_to_tokenizer(big) == (big, None)
    synth = load_config("cpu_tiny", [])
    assert fit_vocab_to_tokenizer(synth) == (synth, None)
    prepared = load_config("cpu_tiny", ["data.dataset=tokenized", "data.path=unused"])
    assert fit_vocab_to_tokenizer(prepared)[0].model.vocab_size == 320
