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
  CONFIG=configs/x.yaml -> the config where --config is not given (before --init-from's; env.json
      records it)
Multi-process (one process per host): --coordinator/--num-processes/--process-id, or
JAX_COORDINATOR_ADDRESS/JAX_NUM_PROCESSES/JAX_PROCESS_ID, or SLURM (nsa_jax/ops/distributed.py);
python -m launch.spawn --nproc N -- python -m launch.train ... starts N local processes.
One trainer per out dir (nsa_jax/rundir/lock.py): the run holds an exclusive lock on
<out_dir>/.lock until it exits (the OS drops it on any death, SIGKILL included); a second
trainer on a held folder exits 2 at once, naming the holder, and changes nothing in it.
Out dir policy (nsa_jax/rundir/resume.py), decided before XLA starts: a folder holding checkpoints
is resumed from its newest complete one (training.csv and the heartbeats continue), or,
when that step is train.steps already, nothing runs (exit 0); a .HALT in it stops the
launch until it is removed; an earlier run that saved no checkpoint (it died in boot or
compile, or was killed or stopped by a second Ctrl-C before its first save) is started
again from step 0, its files moved to previous/<utc time>/; the files of another run
(env.json: a model or data setting differs) or of a finished run without checkpoints are
refused unless --overwrite. Checkpoints are deleted only with --overwrite-checkpoints.
Raising --steps on a resume recomputes the LR schedule for the new length (one line says
what it does at the resumed step); train.decay_steps keeps the peak LR until the last N steps.
Compilation cache: jax's persistent cache in ~/.cache/nsa_jax/jax_compilation_cache, so a
repeated run, or a resume with the same settings, loads the compiled step instead of compiling
it; a resume that changes train.steps (or another LR setting: the schedule's numbers are
constants of the compiled step) compiles again. --compile-cache DIR|off or NSA_COMPILE_CACHE.
SIGTERM and Ctrl-C (SIGINT) finish the step in flight, save a checkpoint and exit: status 0
after SIGTERM, 130 after Ctrl-C (with one line saying how to resume: the same command). A
second one quits at once without saving (the newest committed checkpoint stays).
Exit status: 0 done (or halted by .HALT, or SIGTERM), 1 crash or NaN halt, 2 bad input /
unusable out dir / a batch that cannot fit in memory, 74 a checkpoint save or a run file
(training.csv, val.csv, env.json) write failed (disk full, permission; the last committed
checkpoint is kept, and the same command resumes from it), 75 the stall watchdog ended a
hung process, 130 Ctrl-C.
Data is checked before the out dir is touched (nsa_jax/data/check.py): files that hold no
usable text (empty, not UTF-8) are one `error:` line; data without a validation split (a
small corpus whose documents all hash into train, a prepared folder without val shards)
trains without evaluation, with one warning at boot.
File datasets: the model's vocabulary follows the tokenizer. When model.vocab_size is
smaller than the tokenizer's vocabulary it is raised to that size rounded up to a
multiple of 64 (the byte tokenizer's 258 ids -> 320), with a printed note.
Bad input prints one `error: ...` line and exits with status 2. Progress and results go to
stdout; warnings and notes (`warning:`, `note:`) to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import shlex
import sys
import threading

from launch.cli import Parser, add_overrides
from nsa_jax.config import Config, ConfigError, load_config
from nsa_jax.data import make_tokenizer
from nsa_jax.data.check import check_data, repeat_note
from nsa_jax.data.sources import FILE_DATASETS
from nsa_jax.data.tokenizers import fitted_vocab_size
from nsa_jax.ops import distributed as dist
from nsa_jax.runbook_env import config_from_env, env_overrides
from nsa_jax.rundir import files as rf
from nsa_jax.rundir import lock, resume

BUCKET_FLAG = "--xla_gpu_all_reduce_combine_threshold_bytes"
# jax's persistent compilation cache: a repeated or resumed run loads the compiled step
# instead of compiling it again (--compile-cache DIR|off, NSA_COMPILE_CACHE).
DEFAULT_CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "nsa_jax", "jax_compilation_cache")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m launch.train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--config", help="config name in configs/ or a YAML path (default: --init-from's config.yaml, else a100_pcie)"
    )
    p.add_argument(
        "--init-from",
        metavar="FOLDER",
        help="train.init_from: start from a model folder's parameters (python -m launch.convert writes one)",
    )
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
        "--profile-steps",
        metavar="A:B",
        help="logging.profile_steps: trace optimizer steps A..B into OUT/traces/rank<r>/ "
        "(python -m launch.trace_summary OUT summarises them)",
    )
    add_overrides(p)
    p.add_argument("--overwrite", action="store_true", help="replace the artifacts of an earlier run in the out dir")
    p.add_argument(
        "--overwrite-checkpoints",
        action="store_true",
        help="also delete the out dir's checkpoints and start over (implies --overwrite); "
        "without it a run resumes from them",
    )
    p.add_argument(
        "--compile-cache",
        metavar="DIR|off",
        help="jax's persistent compilation cache folder, or off (default: NSA_COMPILE_CACHE, "
        f"JAX_COMPILATION_CACHE_DIR, else {DEFAULT_CACHE})",
    )
    dist.add_arguments(p)
    return p


# The flags that stand for one config key each, with their value as given.
_FLAG_KEYS = {
    "dataset": "data.dataset",
    "data_path": "data.path",
    "tokenizer": "data.tokenizer",
    "steps": "train.steps",
    "out_dir": "train.out_dir",
    "loader_timeout": "data.loader_timeout",
    "init_from": "train.init_from",
}


def config_source(args: argparse.Namespace, environ=os.environ) -> tuple[str, bool]:
    """(the config to load, whether the project saved it): --config, else the runbooks' CONFIG=
    variable, else --init-from's own config.yaml (a converted model's shape and tokenizer), else
    a100_pcie."""
    if args.config is not None:
        return args.config, False
    from_env = config_from_env(environ)
    if from_env is not None:
        return from_env, False
    if args.init_from is not None and (pathlib.Path(args.init_from) / rf.MODEL_CONFIG_FILE).is_file():
        return str(pathlib.Path(args.init_from) / rf.MODEL_CONFIG_FILE), True
    return "a100_pcie", False


def flag_overrides(args: argparse.Namespace) -> list[str]:
    """The config overrides the convenience flags stand for, then the --set ones (which win)."""
    out = [f"{key}={getattr(args, flag)}" for flag, key in _FLAG_KEYS.items() if getattr(args, flag) is not None]
    if args.profile_steps is not None:
        out.append(f"logging.profile_steps={args.profile_steps}")
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
    out_dir: str,
    overwrite: bool,
    *,
    overwrite_checkpoints: bool = False,
    cfg: Config | None = None,
    apply: bool = True,
) -> resume.OutDirPlan:
    """Decides what this launch does with `out_dir` (nsa_jax/rundir/resume.py) and carries it out
    (apply=False: decides only; `apply_out_dir_plan` later).

    Returns the plan (its action: fresh, resume, restart, overwrite, finished, halted);
    ConfigError when the folder is refused, OutDirError when it cannot be written.
    """
    cfg = cfg or Config()
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, out_dir=str(out_dir)))
    plan = resume.plan_out_dir(cfg, overwrite=overwrite, overwrite_checkpoints=overwrite_checkpoints)
    if apply:
        apply_out_dir_plan(plan)
    return plan


def apply_out_dir_plan(plan: resume.OutDirPlan) -> None:
    moved = resume.apply_plan(plan)
    if moved is not None:
        plan.message += f" ({moved})"


def lock_out_dir(out_dir: str, spec: dist.DistSpec | None) -> None:
    """One trainer per out_dir (nsa_jax/rundir/lock.py): process 0 locks it for the run's lifetime;
    OutDirLocked when another trainer holds it."""
    if spec is None or spec.process_id == 0:
        lock.acquire(out_dir, command=" ".join([os.path.basename(sys.executable), *sys.argv]))


def refused(out_dir: str | None, status: int = rf.EXIT_USAGE) -> int:
    """`status` for a run refused before training: the lock file it created goes, and the out dir too
    when it created it and nothing else is in it, so the folder is left as it was."""
    if out_dir is not None:
        lock.discard_created(out_dir)
    return status


def compile_cache_dir(flag: str | None, environ: dict[str, str]) -> str | None:
    """The persistent compilation cache folder: --compile-cache, else NSA_COMPILE_CACHE, else
    JAX_COMPILATION_CACHE_DIR, else DEFAULT_CACHE; None when switched off ('off', '0', '')."""
    for raw in (flag, environ.get("NSA_COMPILE_CACHE"), environ.get("JAX_COMPILATION_CACHE_DIR")):
        if raw is not None:
            return None if raw.strip().lower() in ("off", "0", "none", "") else os.path.expanduser(raw.strip())
    return os.path.expanduser(DEFAULT_CACHE)


def fit_vocab_to_tokenizer(cfg: Config) -> tuple[Config, str | None]:
    """File datasets: (cfg with a model vocabulary that covers the tokenizer, a note when it changed)."""
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


def resume_command(argv: list[str] | None = None) -> str:
    """The command line that runs this launch again (the same command resumes)."""
    args = sys.argv[1:] if argv is None else argv
    return shlex.join(["python", "-m", "launch.train", *args])


def interrupted_line(summary: dict, out_dir: str, argv: list[str] | None = None) -> str:
    """The one line after a Ctrl-C stop: what was kept and how to go on."""
    saved = summary.get("checkpoint")
    if saved is not None:
        return (
            f"interrupted: stopped after step {summary.get('steps_done')}; checkpoint step {saved} is in "
            f"{os.path.join(out_dir, rf.CHECKPOINT_DIR)}; to resume run the same command: {resume_command(argv)}"
        )
    return (
        f"interrupted: stopped after step {summary.get('steps_done')} with no checkpoint; the same command starts "
        f"again from step 0 (this attempt's files move to {os.path.join(out_dir, rf.PREVIOUS_DIR)}/): "
        f"{resume_command(argv)}"
    )


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:
        # Ctrl-C before the run's own handler is installed (boot) or after it is gone (shutdown).
        print(
            "interrupted: Ctrl-C before training started or after it ended; nothing new was saved; "
            "run the same command to go on",
            file=sys.stderr,
        )
        return rf.EXIT_INTERRUPTED


def _main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    locked: str | None = None  # the out dir once this process has locked it
    try:
        env_sets, applied = env_overrides(os.environ)
        name, saved = config_source(args)
        if args.config is None and config_from_env(os.environ) is not None:
            applied["CONFIG"] = f"the config ({name})"
        cfg = load_config(name, env_sets + flag_overrides(args), saved=saved)
        folder = pathlib.Path(name).parent
        if name.endswith(rf.MODEL_CONFIG_FILE) and any((folder / f).is_file() for f in rf.MODEL_PARAMS_FILES):
            # A model folder's config: its own tokenizer beside it when the folder was moved.
            own = rf.folder_tokenizer(folder, cfg.data.tokenizer)
            cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=own))
        resume.check_init_from(cfg)
        cfg, vocab_note = fit_vocab_to_tokenizer(cfg)
        # Data problems are found before the out dir is locked or touched (nsa_jax/data/check.py).
        data_check = check_data(cfg)
        spec = dist.resolve(args.coordinator, args.num_processes, args.process_id)
        # The notes once the data is usable (bad input stays one error line), from process 0 alone.
        if spec is None or spec.process_id == 0:
            for note in (vocab_note, repeat_note(cfg, data_check)):
                if note:
                    print(note, file=sys.stderr, flush=True)
        # Before anything is read, moved or written in the folder, and before XLA starts.
        lock_out_dir(cfg.train.out_dir, spec)
        locked = cfg.train.out_dir
        # Processes other than 0 change the folder only once they have joined process 0 (which holds the lock).
        joined_later = spec is not None and spec.process_id != 0
        plan = prepare_out_dir(
            cfg.train.out_dir,
            args.overwrite,
            overwrite_checkpoints=args.overwrite_checkpoints,
            cfg=cfg,
            apply=not joined_later,
        )
    except (ConfigError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return refused(locked)
    # Decided before XLA starts: nothing to compile for a finished or halted run.
    if plan.action in ("finished", "halted"):
        print(plan.message, flush=True)
        halted_on_anomaly = plan.action == "halted" and (plan.out / rf.ANOMALY_FILE).is_file()
        return rf.EXIT_FAILED if halted_on_anomaly else rf.EXIT_OK
    if plan.action in ("restart", "overwrite"):
        print(plan.message, flush=True)
    # Before the first jax import: XLA reads its flags once, when the backend starts.
    os.environ["XLA_FLAGS"] = xla_flags_with_bucket(os.environ.get("XLA_FLAGS", ""), cfg.parallel.bucket_mb)
    cache = compile_cache_dir(args.compile_cache, os.environ)
    if spec is not None:
        # Before any device is touched: the backend is created with the cross-process topology.
        print(f"dist: {spec.describe()}; waiting up to {cfg.ops.init_timeout_s}s for all processes", flush=True)
        try:
            dist.initialize(spec, init_timeout_s=cfg.ops.init_timeout_s, peer_timeout_s=cfg.ops.peer_timeout_s)
        except Exception as e:  # noqa: BLE001 - jax raises several kinds; one line says it
            print(f"error: jax.distributed did not start ({spec.describe()}): {e}".splitlines()[0], file=sys.stderr)
            return refused(cfg.train.out_dir, rf.EXIT_FAILED)
        if joined_later:
            try:
                apply_out_dir_plan(plan)
            except OSError as e:
                print(f"error: {e}", file=sys.stderr)
                return rf.EXIT_USAGE

    # jax loads here, after XLA_FLAGS is final.
    from nsa_jax.ops.memory import WontFitError  # noqa: PLC0415 - imports jax: after XLA_FLAGS
    from nsa_jax.train.boot import enable_compile_cache  # noqa: PLC0415 - imports jax: after XLA_FLAGS
    from nsa_jax.train.loop import Trainer  # noqa: PLC0415 - imports jax: after XLA_FLAGS

    enable_compile_cache(cache)
    try:
        trainer = Trainer(cfg, applied_env=applied, eval_off=data_check.no_val)
    except (ConfigError, ValueError, TimeoutError, OSError) as e:
        print(f"error: {e}".splitlines()[0], file=sys.stderr)
        return refused(cfg.train.out_dir)
    try:
        summary = trainer.run()
    except WontFitError as e:
        print(f"error: {e}", file=sys.stderr)
        return refused(cfg.train.out_dir)
    if summary.get("halted") in ("checkpoint_failed", "output_failed"):
        print(f"error: {summary['error']}", file=sys.stderr)
        return rf.EXIT_CHECKPOINT_FAILED
    if summary.get("halted") == "sigint":
        print(interrupted_line(summary, cfg.train.out_dir, argv), file=sys.stderr, flush=True)
        return rf.EXIT_INTERRUPTED
    return rf.EXIT_FAILED if summary.get("halted") in ("nan_loss", "nan_grad") else rf.EXIT_OK


# Threads a stop signal leaves behind inside XLA (Trainer.compile): at interpreter shutdown they
# would be torn down mid-compile and abort the process.
ABANDONED_THREADS = ("nsa-compile", "nsa-init-state")


def exit_process(code: int) -> None:
    """sys.exit(code), or os._exit(code) once the output is flushed where a compile was left running."""
    if any(t.name in ABANDONED_THREADS and t.is_alive() for t in threading.enumerate()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    exit_process(main())
