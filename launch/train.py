"""`python -m launch.train --config NAME [--dataset D] [--steps N] [--out-dir DIR] [--set key=value ...]`

Settles the whole configuration before jax is imported, because some of it must
reach XLA_FLAGS before the backend starts. Precedence, lowest first:
  the YAML file < runbook environment variables < command-line flags and --set.

Environment variables (the torch runbooks' names):
  NSA_ACCUM -> train.accumulate      NSA_LR -> train.lr
  NSA_SEQ_LEN -> train.seq_len       NSA_BATCH_SIZE -> train.global_batch
  NSA_DDP_COMPRESS=bf16|off -> parallel.grad_reduce_dtype bfloat16|float32
  NSA_DDP_BUCKET_MB -> parallel.bucket_mb (-> --xla_gpu_all_reduce_combine_threshold_bytes)
  NSA_TB_DISABLE, NSA_DISABLE_CSV_LOGS, NSA_DISABLE_AUX_STATS = 1|0
      -> logging.tensorboard, logging.csv, logging.aux_stats off|on
  NSA_PG_TIMEOUT_MIN -> ops.stall_seconds (minutes; the in-process stall watchdog)
Multi-process (one process per host): --coordinator/--num-processes/--process-id, or
JAX_COORDINATOR_ADDRESS/JAX_NUM_PROCESSES/JAX_PROCESS_ID, or SLURM (nsa_jax/ops/distributed.py);
python -m launch.spawn --nproc N -- python -m launch.train ... starts N local processes.
An out_dir holding checkpoints is resumed from its newest complete one (training.csv and
the heartbeats continue; nsa_jax/checkpoint.py); one holding only an earlier run's artifacts
is refused unless --overwrite. Checkpoints are deleted only with --overwrite-checkpoints.
SIGTERM finishes the step in flight, saves a checkpoint and exits with status 0.
File datasets: the model's vocabulary follows the tokenizer. When model.vocab_size is
smaller than the tokenizer's vocabulary it is raised to that size rounded up to a
multiple of 64 (the byte tokenizer's 258 ids -> 320), with a printed note.
Bad input prints one `error: ...` line and exits with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import shutil
import sys

from launch.cli import Parser
from nsa_jax import checkpoint as ckpt
from nsa_jax.config import Config, ConfigError, load_config
from nsa_jax.ops import distributed as dist

BUCKET_FLAG = "--xla_gpu_all_reduce_combine_threshold_bytes"
# Files a run writes into its out_dir (besides heartbeat_rank<r>.jsonl and tb/).
RUN_FILES = ("training.csv", "env.json", ".HALT", ".anomaly_type")

# variable -> (config key, value converter)
_NUMERIC_ENV = {
    "NSA_ACCUM": ("train.accumulate", int),
    "NSA_LR": ("train.lr", float),
    "NSA_SEQ_LEN": ("train.seq_len", int),
    "NSA_BATCH_SIZE": ("train.global_batch", int),
    "NSA_DDP_BUCKET_MB": ("parallel.bucket_mb", float),
    # The torch process-group timeout: here a step that does not end in time ends the process.
    "NSA_PG_TIMEOUT_MIN": ("ops.stall_seconds", lambda raw: float(raw) * 60),
}
_DISABLE_ENV = {
    "NSA_TB_DISABLE": "logging.tensorboard",
    "NSA_DISABLE_CSV_LOGS": "logging.csv",
    "NSA_DISABLE_AUX_STATS": "logging.aux_stats",
}


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m launch.train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="a100_pcie", help="config name in configs/ or a YAML path")
    p.add_argument("--dataset", help="data.dataset (synthetic, fineweb_edu, jsonl, text, tokenized, kv_recall)")
    p.add_argument("--data-path", help="data.path: a folder of parquet / jsonl / txt files")
    p.add_argument("--tokenizer", help="data.tokenizer: byte, gpt2, or a tokenizer.json path")
    p.add_argument("--steps", type=int, help="train.steps (optimizer steps)")
    p.add_argument("--out-dir", help="train.out_dir")
    p.add_argument("--loader-timeout", type=float, help="data.loader_timeout in seconds (0 waits forever)")
    p.add_argument("--synthetic-on-fail", action="store_true", help="fall back to synthetic data on a loader timeout")
    p.add_argument("--precision", choices=("bf16", "fp32"), help="model.dtype bfloat16 | float32")
    p.add_argument("--ddp", type=int, choices=(0, 1), help="0: one device only (parallel.num_devices=1); 1: all")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="dotted config override, e.g. --set model.n_layers=2 (repeatable)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace the artifacts of an earlier run in the out dir")
    p.add_argument(
        "--overwrite-checkpoints",
        action="store_true",
        help="also delete the out dir's checkpoints and start over (implies --overwrite); "
        "without it a run resumes from them",
    )
    dist.add_arguments(p)
    return p


def env_overrides(environ: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """Runbook variables -> (dotted overrides, {variable: what it set}); ConfigError on bad values."""
    overrides, applied = [], {}

    def add(var: str, key: str, value) -> None:
        overrides.append(f"{key}={value}")
        applied[var] = f"{key}={value}"

    for var, (key, conv) in _NUMERIC_ENV.items():
        raw = environ.get(var, "").strip()
        if raw:
            try:
                add(var, key, conv(raw))
            except ValueError:
                kind = "an integer" if conv is int else "a number"
                raise ConfigError(f"{var}={raw!r} must be {kind} ({key})") from None
    raw = environ.get("NSA_DDP_COMPRESS", "").strip().lower()
    if raw:
        dtypes = {"bf16": "bfloat16", "bfloat16": "bfloat16", "off": "float32", "fp32": "float32", "none": "float32"}
        if raw not in dtypes:
            raise ConfigError(f"NSA_DDP_COMPRESS={raw!r} must be bf16 or off")
        add("NSA_DDP_COMPRESS", "parallel.grad_reduce_dtype", dtypes[raw])
    for var, key in _DISABLE_ENV.items():
        raw = environ.get(var, "").strip()
        if raw:
            if raw not in ("0", "1"):
                raise ConfigError(f"{var}={raw!r} must be 1 (disable) or 0 (enable)")
            add(var, key, "false" if raw == "1" else "true")
    return overrides, applied


def flag_overrides(args: argparse.Namespace) -> list[str]:
    out = []
    if args.dataset is not None:
        out.append(f"data.dataset={args.dataset}")
    if args.data_path is not None:
        out.append(f"data.path={args.data_path}")
    if args.tokenizer is not None:
        out.append(f"data.tokenizer={args.tokenizer}")
    if args.steps is not None:
        out.append(f"train.steps={args.steps}")
    if args.out_dir is not None:
        out.append(f"train.out_dir={args.out_dir}")
    if args.loader_timeout is not None:
        out.append(f"data.loader_timeout={args.loader_timeout}")
    if args.synthetic_on_fail:
        out.append("data.synthetic_on_fail=true")
    if args.precision is not None:
        out.append(f"model.dtype={'bfloat16' if args.precision == 'bf16' else 'float32'}")
    if args.ddp is not None:
        out.append(f"parallel.num_devices={1 if args.ddp == 0 else 0}")
    return out + list(args.overrides)


def xla_flags_with_bucket(flags: str, bucket_mb: float) -> str:
    """XLA_FLAGS plus the all-reduce combine threshold, unless the flags already set one."""
    if BUCKET_FLAG in flags:
        return flags
    return f"{flags} {BUCKET_FLAG}={int(bucket_mb * 2**20)}".strip()


def prepare_out_dir(
    out_dir: str, overwrite: bool, *, overwrite_checkpoints: bool = False, cfg: Config | None = None
) -> None:
    """Refuses to mix a new run into an earlier run's artifacts unless `overwrite`.

    With checkpoints in out_dir the run resumes (checked against `cfg` here, before XLA
    starts); `overwrite` alone is refused then, `overwrite_checkpoints` deletes them.
    """
    out = pathlib.Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"train.out_dir {out} exists and is not a directory")
    if not out.is_dir():
        return
    steps = ckpt.complete_steps(ckpt.checkpoint_dir(out))
    if steps and not overwrite_checkpoints:
        if overwrite:
            raise ConfigError(
                f"{out} holds checkpoints (steps {', '.join(map(str, steps[-3:]))}) that --overwrite does not "
                f"delete; drop --overwrite to resume from step {steps[-1]}, pass --overwrite-checkpoints to delete "
                "them and start over, or choose another directory with --out-dir"
            )
        if cfg is not None:
            _check_resumable(out, steps, cfg)
        return  # resume: the Trainer restores the newest complete checkpoint and appends
    if overwrite_checkpoints:
        for d in (ckpt.checkpoint_dir(out), out / ckpt.CORRUPT_DIR):
            shutil.rmtree(d, ignore_errors=True)
        overwrite = True
    found = [n for n in RUN_FILES if (out / n).exists()] + sorted(q.name for q in out.glob("heartbeat_rank*.jsonl"))
    found += sorted(q.name for q in out.glob("stackdump_*.txt"))
    if not found:
        return
    if not overwrite:
        raise ConfigError(
            f"{out} already holds a run ({', '.join(found[:3])}); choose another directory with "
            "--out-dir or --set train.out_dir=..., or pass --overwrite to replace it"
        )
    # Tolerant: in a multi-process run every process clears the same shared directory.
    for name in found:
        (out / name).unlink(missing_ok=True)
    if (out / "tb").is_dir():
        shutil.rmtree(out / "tb", ignore_errors=True)


def _check_resumable(out: pathlib.Path, steps: list[int], cfg: Config) -> None:
    """ConfigError when the newest readable checkpoint's config must not be resumed with `cfg`."""
    for step in reversed(steps):
        try:
            saved = ckpt.saved_config(ckpt.checkpoint_dir(out) / str(step))
        except (OSError, ValueError):
            continue  # unreadable: the Trainer falls back to an older step or stops
        blocking, _ = ckpt.resume_conflicts(saved, cfg)
        if blocking:
            raise ConfigError(
                f"{out} holds checkpoints of a different run (step {step}: {'; '.join(blocking[:3])}); resume with "
                "the settings they were saved with, choose another directory with --out-dir, or pass "
                "--overwrite-checkpoints to delete them and start over"
            )
        return


def fit_vocab_to_tokenizer(cfg: Config) -> tuple[Config, str | None]:
    """File datasets: (cfg with a model vocabulary that covers the tokenizer, a note when it changed)."""
    from nsa_jax.data import FILE_DATASETS, make_tokenizer
    from nsa_jax.data.tokenizers import fitted_vocab_size

    # `tokenized` folders must be read with the tokenizer of their manifest (checked when
    # the dataset opens), so data.tokenizer gives the right size for them too.
    if cfg.data.dataset not in (*FILE_DATASETS, "tokenized"):
        return cfg, None
    tok_vocab = make_tokenizer(cfg.data).vocab_size
    vocab = fitted_vocab_size(cfg.model.vocab_size, tok_vocab)
    if vocab == cfg.model.vocab_size:
        return cfg, None
    note = (
        f"note: model.vocab_size {cfg.model.vocab_size} -> {vocab} to fit the {cfg.data.tokenizer!r} tokenizer "
        f"({tok_vocab} ids, rounded up to a multiple of 64)"
    )
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab)), note


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        env_sets, applied = env_overrides(os.environ)
        cfg = load_config(args.config, env_sets + flag_overrides(args))
        cfg, vocab_note = fit_vocab_to_tokenizer(cfg)
        if vocab_note:
            print(vocab_note, flush=True)
        spec = dist.resolve(args.coordinator, args.num_processes, args.process_id)
        prepare_out_dir(cfg.train.out_dir, args.overwrite, overwrite_checkpoints=args.overwrite_checkpoints, cfg=cfg)
    except (ConfigError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # Before the first jax import: XLA reads its flags once, when the backend starts.
    os.environ["XLA_FLAGS"] = xla_flags_with_bucket(os.environ.get("XLA_FLAGS", ""), cfg.parallel.bucket_mb)
    if spec is not None:
        # Before any device is touched: the backend is created with the cross-process topology.
        print(f"dist: {spec.describe()}; waiting up to {cfg.ops.init_timeout_s}s for all processes", flush=True)
        try:
            dist.initialize(spec, init_timeout_s=cfg.ops.init_timeout_s, peer_timeout_s=cfg.ops.peer_timeout_s)
        except Exception as e:  # noqa: BLE001 - jax raises several kinds; one line says it
            print(f"error: jax.distributed did not start ({spec.describe()}): {e}".splitlines()[0], file=sys.stderr)
            return 1

    from nsa_jax.train.loop import Trainer

    try:
        trainer = Trainer(cfg, applied_env=applied)
    except (ConfigError, ValueError, TimeoutError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = trainer.run()
    return 1 if summary.get("halted") in ("nan_loss", "nan_grad") else 0


if __name__ == "__main__":
    sys.exit(main())
