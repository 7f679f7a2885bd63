"""The out_dir policy of a run: start, resume, restart, overwrite or refuse; no jax.

`plan_out_dir(cfg, overwrite=..., overwrite_checkpoints=...)` looks at `cfg.train.out_dir` before XLA
starts and decides, in this order:
  not writable              OutDirError (an OSError on the folder: read-only, not a directory, permission)
  .HALT present             "halted": nothing runs until it is removed (the reason is in it)
  --overwrite-checkpoints   checkpoints (and corrupt ones) deleted, the rest as --overwrite
  checkpoints present       --overwrite refused (it never deletes them); a config whose checkpoint must
                            not be resumed (`resume_conflicts`) refused; the newest complete step >=
                            train.steps: "finished", nothing to run; else "resume"
  an earlier run's files    no checkpoint (a run that died in boot or compile, or stopped or crashed
                            before its first save): "restart" from step 0, its files moved to
                            previous/<utc time>/ (nothing is deleted); refused, naming what is there,
                            when it is another run (env.json: a model or data setting that differs) or
                            a finished run saved without checkpoints; --overwrite deletes its files
                            ("overwrite")
  nothing                   "fresh"
`apply_plan` carries the decision out (moves or deletes files). The checkpoint directory inspection used
here (`complete_steps`, `saved_config`, ...) is shared with nsa_jax/rundir/checkpoint.py.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import shutil
import time
from typing import Any

import yaml

from nsa_jax.config import Config, ConfigError, from_dict, to_dict, upgrade_saved, validate
from nsa_jax.rundir import files as rf
from nsa_jax.words import count

TMP_MARKER = ".orbax-checkpoint-tmp"  # orbax's suffix of a step directory not yet committed

# Model keys that only change how the same weights are computed; everything else in
# `model` changes the parameters' shapes or the function they define.
NUMERICS_ONLY = (
    "model.dtype",
    "model.remat",
    "model.scan_unroll",
    "model.nsa.attention_impl",
    "model.nsa.query_chunk",
)
# Model keys that change which blocks the selection branch chooses and no parameter (every block scorer,
# kernels/scorers.py, reads the layer's own queries and keys): a run may continue under another.
SCORER_KEYS = ("model.nsa.scorer", "model.nsa.scorer_sub", "model.nsa.scorer_candidates")
# Keys that give the saved data position its meaning: the stream, its row shape, and
# the seed of synthetic streams and shuffles. The rows per optimizer step
# (train.global_batch x train.accumulate) count too, as a product: how they split into
# micro-batches may change on resume (`elastic_batch`).
DATA_POSITION_KEYS = (
    "data.dataset",
    "data.path",
    "data.tokenizer",
    "data.val_fraction",
    "data.kv_pairs",
    "data.kv_queries",
    "data.kv_placement",
    "data.kv_format",
    "train.seq_len",
    "train.seed",
)
ROWS_PER_STEP = "train.global_batch x train.accumulate"
# Zero vs non-zero adds or removes a link of the optax chain, i.e. changes the
# optimizer state's structure.
OPTIMIZER_STRUCTURE_KEYS = ("train.grad_clip", "train.weight_decay")
NOT_REPORTED = ("train.out_dir",)


class CheckpointError(ValueError):
    """No usable checkpoint, or one that must not be resumed; one line naming the fix."""


class OutDirError(ConfigError):
    """The out_dir cannot be used (not writable, not a directory); one line naming the fix."""


# ---------------------------------------------------------------------------
# checkpoint directory inspection


def checkpoint_dir(out_dir: str | os.PathLike) -> pathlib.Path:
    return pathlib.Path(out_dir) / rf.CHECKPOINT_DIR


def complete_steps(ckpt_dir: str | os.PathLike) -> list[int]:
    """Committed steps in `ckpt_dir`, ascending: directories named by an integer.

    orbax writes `<step>.orbax-checkpoint-tmp-<n>` and renames it to `<step>` only after
    the last file is written, so an integer name means a complete save.
    """
    d = pathlib.Path(ckpt_dir)
    if not d.is_dir():
        return []
    return sorted(int(p.name) for p in d.iterdir() if p.is_dir() and p.name.isdigit())


def uncommitted_dirs(ckpt_dir: str | os.PathLike) -> list[pathlib.Path]:
    """Step directories of saves that never finished (killed or failed mid-write)."""
    d = pathlib.Path(ckpt_dir)
    return sorted(p for p in d.iterdir() if TMP_MARKER in p.name) if d.is_dir() else []


def saved_config(step_dir: str | os.PathLike) -> dict[str, Any]:
    """The config dict stored in a step directory (the JSON file of its `config` item)."""
    path = pathlib.Path(step_dir) / "config" / "metadata"
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or "model" not in data:
        raise ValueError(f"{path} does not hold a run config")
    return data


def config_from_dict(data: dict[str, Any]) -> Config:
    """The Config of a saved config dict, written by this version or an earlier one (upgrade_saved)."""
    return validate(from_dict(Config, upgrade_saved(data)))


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = tuple(v) if isinstance(v, list) else v
    return out


def resume_conflicts(saved: dict[str, Any], cfg: Config) -> tuple[list[str], list[str]]:
    """(blocking, other): 'key old -> new' differences between a checkpoint's config and `cfg`.

    Blocking: anything that changes the saved state's shapes or structure, and, unless
    checkpoint.restore_data is false, anything that changes what the saved data
    position means. Other differences (steps, LR schedule values, logging, cadence,
    parallel layout, ...) are allowed and only reported.
    """
    old, now = _flatten(upgrade_saved(saved)), _flatten(to_dict(cfg))
    defaults = _flatten(to_dict(Config()))
    missing = object()
    blocking, other = [], []
    rows = [d.get("train.global_batch", 0) * d.get("train.accumulate", 1) for d in (old, now)]
    if rows[0] != rows[1] and cfg.checkpoint.restore_data:
        blocking.append(f"{ROWS_PER_STEP} (rows per optimizer step) {rows[0]} -> {rows[1]}")
    for key in sorted(set(old) | set(now)):
        a, b = old.get(key, missing), now.get(key, missing)
        if a == b or key in NOT_REPORTED:
            continue
        if a is missing and key in defaults and b == defaults[key]:
            continue  # a setting added after the checkpoint was written, at its default
        line = f"{key} {'<absent>' if a is missing else repr(a)} -> {'<absent>' if b is missing else repr(b)}"
        if key in SCORER_KEYS:
            other.append(line + " (the block scorer has no parameters: the run continues under the new one)")
        elif key.startswith("model.") and key not in NUMERICS_ONLY:
            blocking.append(line)
        elif key in DATA_POSITION_KEYS and cfg.checkpoint.restore_data:
            blocking.append(line)
        elif key in OPTIMIZER_STRUCTURE_KEYS and isinstance(a, (int, float)) and (a > 0) != (b > 0):
            blocking.append(line + " (changes the optimizer state's structure)")
        else:
            other.append(line)
    return blocking, other


def saved_devices(step_dir: str | os.PathLike) -> int | None:
    """The device count a step was saved on (its data item), None when unreadable."""
    try:
        data = json.loads((pathlib.Path(step_dir) / "data" / "metadata").read_text())
        return int(data["devices"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def elastic_batch(cfg: Config, n_devices: int) -> tuple[Config, str | None]:
    """`cfg` with train.global_batch / train.accumulate (and train.eval_batches) split anew for
    `n_devices` when the run resumes from a checkpoint saved on another layout; a note saying so.

    The rows per optimizer step R = global_batch x accumulate never change (they define the
    data position and the update). The micro-batch per device may shrink but not grow past
    the one the checkpoint ran with (it fitted in memory); when the configured split would
    grow it or not divide over the devices, the largest micro-batch G' that divides R, is a
    multiple of `n_devices` and keeps G' / n_devices within the saved one is taken, and
    accumulate becomes R / G'. Evaluation keeps its number of rows where it divides.
    """
    steps = complete_steps(checkpoint_dir(cfg.train.out_dir))
    if not steps or not cfg.checkpoint.restore_data:
        return cfg, None
    step_dir = checkpoint_dir(cfg.train.out_dir) / str(steps[-1])
    try:
        saved = saved_config(step_dir)["train"]
        s_G, s_A = int(saved["global_batch"]), int(saved["accumulate"])
    except (OSError, ValueError, KeyError, TypeError):
        return cfg, None  # the restore reports an unreadable checkpoint
    s_dev = saved_devices(step_dir)
    t = cfg.train
    R = t.global_batch * t.accumulate
    if s_dev is None or s_G * s_A != R or s_G % s_dev:
        return cfg, None
    per_dev = s_G // s_dev
    if t.global_batch % n_devices == 0 and t.global_batch // n_devices <= per_dev:
        return cfg, None
    fits = [g for g in range(n_devices, R + 1, n_devices) if R % g == 0 and g // n_devices <= per_dev]
    if not fits:
        return cfg, None  # the batch split check names the problem
    G = max(fits)
    A = R // G
    eval_rows = t.eval_batches * t.global_batch
    evals = eval_rows // G if eval_rows % G == 0 else t.eval_batches
    note = (
        f"train.global_batch {t.global_batch} -> {G}, train.accumulate {t.accumulate} -> {A} "
        f"(checkpoint step {steps[-1]} ran {count(per_dev, 'row')} per device on {count(s_dev, 'device')}; "
        f"{count(R, 'row')} per step kept)"
    )
    train = dataclasses.replace(t, global_batch=G, accumulate=A, eval_batches=evals)
    return dataclasses.replace(cfg, train=train), note


def quarantine(step_dir: pathlib.Path, out_dir: pathlib.Path) -> pathlib.Path:
    """Moves a step that does not read back out of orbax's sight; never deletes it."""
    dest_root = out_dir / rf.CORRUPT_DIR
    dest_root.mkdir(parents=True, exist_ok=True)
    dest = dest_root / f"{step_dir.name}-{int(time.time())}"
    shutil.move(str(step_dir), str(dest))
    return dest


# ---------------------------------------------------------------------------
# out_dir policy


@dataclasses.dataclass
class OutDirPlan:
    """What a launch does with its out_dir; `message` is one line for the operator."""

    action: str  # fresh | resume | restart | overwrite | finished | halted
    out: pathlib.Path
    message: str = ""
    steps: list[int] = dataclasses.field(default_factory=list)  # complete checkpoint steps
    files: list[pathlib.Path] = dataclasses.field(default_factory=list)  # an earlier run's files
    delete_checkpoints: bool = False


def check_writable(out: pathlib.Path) -> None:
    """Creates `out` and a probe file in it; OutDirError naming the cause when either fails."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write_probe_{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        why = e.strerror or type(e).__name__
        if isinstance(e, (FileExistsError, NotADirectoryError)) or (out.exists() and not out.is_dir()):
            why = "it, or a folder above it, is a file, not a directory"
        raise OutDirError(
            f"train.out_dir {out} cannot be written ({why}); choose another directory with --out-dir "
            "or --set train.out_dir=..."
        ) from None


@dataclasses.dataclass
class EarlierRun:
    """What an out_dir's run files say about the run that wrote them (no checkpoints read)."""

    last_step: int = 0  # the newest finished step in training.csv or a heartbeat
    config: dict[str, Any] | None = None  # env.json's config
    done: dict[str, Any] | None = None  # the last `done` heartbeat event (summary fields)

    def finished_without_checkpoints(self) -> bool:
        """It ran to its train.steps with checkpoint.enabled=false: nothing to resume, nothing lost."""
        if self.config is None or self.done is None or self.done.get("halted") is not None:
            return False
        train, saving = self.config.get("train", {}), self.config.get("checkpoint", {})
        return saving.get("enabled") is False and self.done.get("steps_done") == train.get("steps")


def _earlier_run(out: pathlib.Path) -> EarlierRun:
    run = EarlierRun()
    csv_path = out / rf.TRAINING_CSV
    if csv_path.is_file():
        run.last_step = max((int(r["step"]) for r in rf.read_csv(csv_path)[1]), default=0)
    for hb in out.glob(rf.HEARTBEAT_GLOB):
        with open(hb, errors="replace") as f:
            for line in f:
                if '"event": "step_end"' not in line and '"event": "done"' not in line:
                    continue
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a line cut short by a kill
                if rec.get("event") == "step_end":
                    run.last_step = max(run.last_step, int(rec.get("step", 0)))
                elif rec.get("rank") == 0:
                    run.done = rec
    try:
        env = json.loads((out / rf.ENV_JSON).read_text())
        run.config = env["config"] if isinstance(env.get("config"), dict) else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        run.config = None
    return run


def plan_out_dir(cfg: Config, *, overwrite: bool = False, overwrite_checkpoints: bool = False) -> OutDirPlan:
    """The decision for `cfg.train.out_dir` (module docstring); ConfigError when it is refused."""
    out = pathlib.Path(cfg.train.out_dir)
    check_writable(out)
    halt = out / rf.HALT_FILE
    if halt.is_file():
        reason = halt.read_text(errors="replace").strip() or "no reason given"
        return OutDirPlan(
            "halted",
            out,
            f"halt: {halt} is present ({reason}); nothing runs until it is removed (rm {halt}, and "
            f"{out / rf.ANOMALY_FILE} if present) - then the same command resumes",
        )
    steps = complete_steps(checkpoint_dir(out))
    if steps and overwrite_checkpoints:
        return OutDirPlan(
            "overwrite",
            out,
            f"overwrite: deleting checkpoints {steps} and the earlier run's files",
            steps,
            rf.run_files(out),
            delete_checkpoints=True,
        )
    if steps:
        if overwrite:
            raise ConfigError(
                f"{out} holds checkpoints (steps {', '.join(map(str, steps[-3:]))}) that --overwrite does not "
                f"delete; drop --overwrite to resume from step {steps[-1]}, pass --overwrite-checkpoints to delete "
                "them and start over, or choose another directory with --out-dir"
            )
        _check_resumable(out, steps, cfg)
        if steps[-1] >= cfg.train.steps:
            return OutDirPlan(
                "finished",
                out,
                f"done: {out} already holds step {steps[-1]} (train.steps={cfg.train.steps}); nothing to run - "
                "raise --steps to train further (the LR schedule is then recomputed for the new train.steps: a "
                "cosine that ended at min_lr rises again; train.decay_steps holds the peak until the last N steps); "
                "a variant of the run (another bucket size, say) needs its own --out-dir, or python -m launch.sweep",
                steps,
            )
        return OutDirPlan("resume", out, f"resume: newest checkpoint step {steps[-1]} in {checkpoint_dir(out)}", steps)
    files = rf.run_files(out)
    corrupt = out / rf.CORRUPT_DIR
    if overwrite_checkpoints:
        message = "overwrite: deleting the earlier run's files"
        return OutDirPlan("overwrite", out, message, [], files, delete_checkpoints=True)
    if not files:
        return OutDirPlan("fresh", out)
    earlier = _earlier_run(out)
    moved = f"its files move to {out / rf.PREVIOUS_DIR}/"
    if earlier.last_step == 0 and not corrupt.exists():
        return OutDirPlan(
            "restart",
            out,
            f"restart: the earlier run in {out} finished no step and saved no checkpoint; {moved}",
            [],
            files,
        )
    if overwrite:
        return OutDirPlan("overwrite", out, "overwrite: deleting the earlier run's files", [], files)
    what = f"training.csv to step {earlier.last_step}" if earlier.last_step else ", ".join(p.name for p in files[:3])
    keep = (
        "to keep it choose another directory with --out-dir (or --set train.out_dir=...); "
        "pass --overwrite to delete its files and train here"
    )
    blocking = resume_conflicts(earlier.config, cfg)[0] if earlier.config is not None else []
    if blocking:
        raise ConfigError(
            f"{out} holds another run, without a checkpoint ({what}; env.json: {'; '.join(blocking[:3])}); {keep}"
        )
    if earlier.finished_without_checkpoints():
        raise ConfigError(
            f"{out} holds a finished run ({what} of {earlier.done.get('steps_done')}) saved without checkpoints "
            f"(checkpoint.enabled=false), so there is nothing to resume; {keep}"
        )
    kept = f"; {rf.CORRUPT_DIR}/ stays" if corrupt.exists() else ""
    return OutDirPlan(
        "restart",
        out,
        f"restart: the earlier run in {out} stopped after step {earlier.last_step} without a checkpoint "
        f"(interrupted or crashed before its first save); training starts again from step 0; {moved}{kept}",
        [],
        files,
    )


def apply_plan(plan: OutDirPlan) -> pathlib.Path | None:
    """Moves (restart) or deletes (overwrite) what the plan says; the folder files were moved to, if any.

    Tolerant: in a multi-process run every process applies the same plan to a shared folder.
    """
    out = plan.out
    if plan.delete_checkpoints:
        for d in (checkpoint_dir(out), out / rf.CORRUPT_DIR):
            shutil.rmtree(d, ignore_errors=True)
    if plan.action == "restart":
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        dest = out / rf.PREVIOUS_DIR / stamp
        dest.mkdir(parents=True, exist_ok=True)
        for p in plan.files:
            try:
                shutil.move(str(p), str(dest / p.name))
            except FileNotFoundError:
                pass
        return dest
    if plan.action == "overwrite":
        for p in plan.files:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
    return None


def _check_resumable(out: pathlib.Path, steps: list[int], cfg: Config) -> None:
    """ConfigError when the newest readable checkpoint's config must not be resumed with `cfg`."""
    for step in reversed(steps):
        try:
            saved = saved_config(checkpoint_dir(out) / str(step))
        except (OSError, ValueError):
            continue  # unreadable: the Trainer falls back to an older step or stops
        blocking, _ = resume_conflicts(saved, cfg)
        if blocking:
            raise ConfigError(
                f"{out} holds checkpoints of a different run (step {step}: {'; '.join(blocking[:3])}); resume with "
                "the settings they were saved with, choose another directory with --out-dir, or pass "
                "--overwrite-checkpoints to delete them and start over"
            )
        return


def check_init_from(cfg) -> None:
    """ConfigError unless train.init_from (if set) is a model folder whose tokenizer is the run's, and the
    run's out dir is not that folder."""
    src = cfg.train.init_from
    if not src:
        return
    if not any((pathlib.Path(src) / name).is_file() for name in rf.MODEL_PARAMS_FILES):
        raise ConfigError(
            f"config: train.init_from {src} is not a model folder (no {rf.MODEL_PARAMS_FILE}); "
            "make one with python -m launch.convert SRC OUT"
        )
    if pathlib.Path(cfg.train.out_dir).resolve() == pathlib.Path(src).resolve():
        raise ConfigError(
            f"config: train.out_dir is {cfg.train.out_dir}, the model folder train.init_from reads: the run would "
            "write its checkpoints and run files into it; pass --out-dir RUN (a folder of its own)"
        )
    cfg_file = pathlib.Path(src) / rf.MODEL_CONFIG_FILE
    if cfg_file.is_file():
        theirs = (yaml.safe_load(cfg_file.read_text()) or {}).get("data", {}).get("tokenizer")
        theirs = None if theirs is None else rf.folder_tokenizer(src, theirs)
        if theirs is not None and not _same_tokenizer(theirs, cfg.data.tokenizer):
            raise ConfigError(
                f"config: train.init_from {src} reads text with the tokenizer {theirs}, but data.tokenizer is "
                f"{cfg.data.tokenizer}: token ids would mean other words; set data.tokenizer={theirs} "
                "(and prepare tokenized data with it)"
            )


def _same_tokenizer(a: str, b: str) -> bool:
    """The same tokenizer spec, or two tokenizer files with the same bytes (a converted model's copy)."""
    if a == b:
        return True
    fa, fb = pathlib.Path(a), pathlib.Path(b)
    return fa.is_file() and fb.is_file() and fa.read_bytes() == fb.read_bytes()
