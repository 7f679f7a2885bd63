"""Checkpoints: orbax saves of the whole run, automatic exact resume, restore anywhere.

Layout, one orbax `CheckpointManager` step per saved optimizer step:

  <out_dir>/checkpoints/<step>/state    TrainState (step, params, opt_state, rng): arrays (OCDBT)
  <out_dir>/checkpoints/<step>/data     JSON: the data position of every process
                                        {"format", "process_count", "devices", "processes": [{"train", "val"}]}
  <out_dir>/checkpoints/<step>/config   JSON: Config.to_dict() of the run that saved it

Saves happen every `checkpoint.save_every` optimizer steps and once at the end of a
run (also after a SIGTERM or a .HALT stop). They are asynchronous: `save()` returns
once the state has been copied off the device, and orbax writes the files in a
background thread while training goes on. A step directory is written under a
temporary name (`<step>.orbax-checkpoint-tmp-<n>`) and renamed only when every file
is on disk, so a process killed mid-save leaves a directory that is never listed as
a step (and is removed by the next manager). `checkpoint.max_to_keep` newest steps
are kept.

Resume policy: automatic. When `<out_dir>/checkpoints` holds a complete step, the
Trainer restores the newest one that reads back (state, data position, and the
training.csv rows up to that step; heartbeats are appended) instead of starting
from scratch; `launch.train` refuses `--overwrite` then, because checkpoints are
only deleted with the explicit `--overwrite-checkpoints`. A checkpoint whose
`state`, `data` or `config` does not read back is moved to
`<out_dir>/checkpoints_corrupt/` with a warning and the previous step is tried; when
none reads back the run stops with `CheckpointError`. A checkpoint saved with a
different model (or data layout, see `resume_conflicts`) is never resumed silently:
that is a `CheckpointError` too.

Granularity: the optimizer step. A checkpoint holds the state after step s and the
data position after the s * train.accumulate micro-batches that step consumed; the
micro-batch loop lives inside the compiled step, so there is no state "inside" an
accumulation cycle to lose: a run killed in the middle of step s + 1 restarts that
step from its first micro-batch with the same data and RNG, and reproduces it bit
for bit (on CPU). Data epochs need nothing special, the stream's own state carries
the epoch.

Restore onto another mesh: arrays are restored with the new mesh's shardings
(those of parallel.strategy, nsa_jax/train/strategies.py: replicated, or sharded
over `data` for zero1/fsdp), so a run saved on 2 devices resumes on 1 or 8, and
under another strategy. The data position is per process; with the same process count it carries
over unchanged; with a different one it cannot (each process reads its own shard
of the stream) and the restore stops with an error, unless
`checkpoint.restore_data=false` restarts the data stream on purpose.

Preemption (SIGTERM): `PreemptionGuard` turns the signal into a flag; the loop stops
at the next step boundary, saves, and the launcher exits 0. With several processes
the flag is OR-reduced across them with one small all-reduce per step that is read
one step later, so every process stops after the same step without the loop ever
waiting for it. A second SIGTERM kills the process at once.

Nothing here imports jax or orbax at module level: the launcher inspects an out_dir
(`complete_steps`, `saved_config`, `resume_conflicts`) before XLA starts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import signal
import threading
import time
from typing import Any, Callable

from nsa_jax.config import Config, ConfigError, from_dict, to_dict, validate

CHECKPOINT_DIR = "checkpoints"
CORRUPT_DIR = "checkpoints_corrupt"
ITEMS = ("state", "data", "config")
TMP_MARKER = ".orbax-checkpoint-tmp"  # orbax's suffix of a step directory not yet committed
DATA_FORMAT = 1

# Model keys that only change how the same weights are computed; everything else in
# `model` changes the parameters' shapes or the function they define.
NUMERICS_ONLY = ("model.dtype", "model.remat", "model.nsa.attention_impl", "model.nsa.query_chunk")
# Keys that give the saved data position its meaning: the stream, its row shape, the
# rows per optimizer step, and the seed of synthetic streams and shuffles.
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
    "train.global_batch",
    "train.accumulate",
    "train.seed",
)
# Zero vs non-zero adds or removes a link of the optax chain, i.e. changes the
# optimizer state's structure.
OPTIMIZER_STRUCTURE_KEYS = ("train.grad_clip", "train.weight_decay")
NOT_REPORTED = ("train.out_dir",)


class CheckpointError(ValueError):
    """No usable checkpoint, or one that must not be resumed; one line naming the fix."""


# ---------------------------------------------------------------------------
# directory inspection (no jax)


def checkpoint_dir(out_dir: str | os.PathLike) -> pathlib.Path:
    return pathlib.Path(out_dir) / CHECKPOINT_DIR


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
    return validate(from_dict(Config, data))


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
    old, now = _flatten(saved), _flatten(to_dict(cfg))
    defaults = _flatten(to_dict(Config()))
    missing = object()
    blocking, other = [], []
    for key in sorted(set(old) | set(now)):
        a, b = old.get(key, missing), now.get(key, missing)
        if a == b or key in NOT_REPORTED:
            continue
        if a is missing and key in defaults and b == defaults[key]:
            continue  # a setting added after the checkpoint was written, at its default
        line = f"{key} {'<absent>' if a is missing else repr(a)} -> {'<absent>' if b is missing else repr(b)}"
        if key.startswith("model.") and key not in NUMERICS_ONLY:
            blocking.append(line)
        elif key in DATA_POSITION_KEYS and cfg.checkpoint.restore_data:
            blocking.append(line)
        elif key in OPTIMIZER_STRUCTURE_KEYS and isinstance(a, (int, float)) and (a > 0) != (b > 0):
            blocking.append(line + " (changes the optimizer state's structure)")
        else:
            other.append(line)
    return blocking, other


def _quarantine(step_dir: pathlib.Path, out_dir: pathlib.Path) -> pathlib.Path:
    """Moves a step that does not read back out of orbax's sight; never deletes it."""
    dest_root = out_dir / CORRUPT_DIR
    dest_root.mkdir(parents=True, exist_ok=True)
    dest = dest_root / f"{step_dir.name}-{int(time.time())}"
    shutil.move(str(step_dir), str(dest))
    return dest


# ---------------------------------------------------------------------------
# multi-process helpers


def _allgather_json(obj: Any) -> list[Any]:
    """Every process's `obj` (JSON-serialisable), in process order; one entry per process."""
    import jax

    if jax.process_count() == 1:
        return [obj]
    import numpy as np
    from jax.experimental import multihost_utils

    raw = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.int32(raw.size))).reshape(-1)
    buf = np.zeros(int(sizes.max()), np.uint8)
    buf[: raw.size] = raw
    rows = np.asarray(multihost_utils.process_allgather(buf)).reshape(len(sizes), -1)
    return [json.loads(bytes(rows[i, : sizes[i]]).decode()) for i in range(len(sizes))]


def _barrier(name: str) -> None:
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


# ---------------------------------------------------------------------------
# save / restore of a training run


def _item_handlers() -> dict[str, Any]:
    """orbax handlers of the three items; the state's arrays are written by the replica that
    holds them, without orbax's replica-parallel split.

    The split slices every replicated array across its devices with small jitted ops,
    and compiling those made the first save of a run block the loop for seconds. One
    writer per array is enough for replicated arrays, and each shard of a sharded one
    (zero1, fsdp) is written by the device that holds it.
    """
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    th = ocp.type_handlers
    registry = th.create_type_handler_registry(
        (jax.Array, th.ArrayHandler(use_replica_parallel=False)),
        (np.ndarray, th.NumpyHandler()),
        (int, th.ScalarHandler()),
        (float, th.ScalarHandler()),
        (np.number, th.ScalarHandler()),
    )
    return {
        "state": ocp.PyTreeCheckpointHandler(type_handler_registry=registry),
        "data": ocp.JsonCheckpointHandler(),
        "config": ocp.JsonCheckpointHandler(),
    }


@dataclasses.dataclass
class Restored:
    """What a resume needs: the train state, this process's data states, and where they came from."""

    step: int
    state: Any  # TrainState on the run's mesh
    train_data: dict | None  # None: checkpoint.restore_data is false
    val_data: dict | None
    path: pathlib.Path


class Checkpointer:
    """The orbax CheckpointManager of one run directory, used by the Trainer."""

    def __init__(self, cfg: Config, out_dir: str | os.PathLike, mesh, warn: Callable[[str], None] = print):
        self.cfg, self.out, self.mesh, self._warn = cfg, pathlib.Path(out_dir), mesh, warn
        self.dir = checkpoint_dir(out_dir)
        self._mngr = None
        self.last_step: int | None = None  # newest step on disk that this run saved or restored
        if cfg.checkpoint.enabled:
            # Importing orbax and opening the manager takes seconds: done at boot, not in the first save.
            self._manager()

    def _manager(self):
        if self._mngr is None:
            import orbax.checkpoint as ocp

            c = self.cfg.checkpoint
            opts = ocp.CheckpointManagerOptions(
                max_to_keep=c.max_to_keep,
                create=True,
                cleanup_tmp_directories=True,
                enable_async_checkpointing=c.async_save,
            )
            self._mngr = ocp.CheckpointManager(self.dir.absolute(), options=opts, item_handlers=_item_handlers())
        return self._mngr

    # -- restore --------------------------------------------------------------

    def abstract_state(self):
        """Shapes of a fresh TrainState, placed as parallel.strategy places it on this run's mesh
        (the restore target: orbax reads each array straight into those shardings)."""
        import jax

        from nsa_jax.train import strategies

        shapes = strategies.state_shapes(self.cfg)
        placed = strategies.state_shardings(self.cfg, self.mesh, shapes)
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, placed)

    def restore_latest(self) -> Restored | None:
        """The newest checkpoint that reads back, or None when there is none.

        Steps that fail to read are moved to checkpoints_corrupt/ with a warning;
        CheckpointError when every step fails, or when the newest readable config
        must not be resumed with this run's config.
        """
        steps = complete_steps(self.dir)
        if not steps:
            return None
        import jax
        import orbax.checkpoint as ocp

        mngr = self._manager()
        target = self.abstract_state()
        failed: list[tuple[int, str]] = []
        restored = None
        for step in reversed(steps):
            step_dir = self.dir / str(step)
            try:
                saved = saved_config(step_dir)
            except Exception as e:  # noqa: BLE001 - any read failure means "not usable"
                failed.append((step, f"config: {_one_line(e)}"))
                self._warn(f"warning: checkpoint {step_dir} is unreadable ({failed[-1][1]}); trying the previous one")
                continue
            blocking, other = resume_conflicts(saved, self.cfg)
            if blocking:
                raise CheckpointError(
                    f"checkpoint {step_dir} was saved with a different setup ({'; '.join(blocking[:4])}); "
                    "resume with the settings it was saved with, or start this run in another out_dir"
                )
            try:
                out = mngr.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.PyTreeRestore(
                            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)
                        ),
                        data=ocp.args.JsonRestore(),
                    ),
                )
                state = out.state
                if int(jax.device_get(state.step)) != step:
                    raise ValueError(f"state.step is {int(jax.device_get(state.step))}, expected {step}")
                train_data, val_data = self._data_for_this_process(out.data, step)
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many kinds
                failed.append((step, _one_line(e)))
                self._warn(
                    f"warning: checkpoint {step_dir} does not read back ({failed[-1][1]}); trying the previous one"
                )
                continue
            if other:
                self._warn(
                    f"resume: settings changed since step {step}: {'; '.join(other[:8])}"
                    + (f" (+{len(other) - 8} more)" if len(other) > 8 else "")
                )
            restored = Restored(step, state, train_data, val_data, step_dir)
            break
        if restored is None:
            detail = "; ".join(f"step {s}: {m}" for s, m in failed[:3])
            raise CheckpointError(
                f"no checkpoint in {self.dir} reads back ({detail}); move the directory aside to start "
                "over (launch.train: --overwrite-checkpoints), or restore a copy"
            )
        # Unreadable newer steps would otherwise stay "latest" for orbax, and a new save
        # of the same step would collide with them.
        if failed:
            if jax.process_index() == 0:
                for step, _ in failed:
                    dest = _quarantine(self.dir / str(step), self.out)
                    self._warn(f"warning: moved unreadable checkpoint step {step} to {dest}")
            _barrier("nsa_checkpoint_quarantine")
            mngr.reload()
        self.last_step = restored.step
        return restored

    def _data_for_this_process(self, data: dict, step: int) -> tuple[dict | None, dict | None]:
        import jax

        if not self.cfg.checkpoint.restore_data:
            return None, None
        if not isinstance(data, dict) or data.get("format") != DATA_FORMAT:
            raise ValueError("data item has an unknown format")
        saved_pc, pc = int(data["process_count"]), jax.process_count()
        if saved_pc != pc:
            raise CheckpointError(
                f"checkpoint step {step} was saved by {saved_pc} process(es) and this run has {pc}: each process's "
                "data position belongs to its own shard of the stream and cannot be carried over; resume with "
                f"{saved_pc} process(es), or set checkpoint.restore_data=false to restore weights, optimizer and step "
                "and restart the data stream from its beginning"
            )
        mine = data["processes"][jax.process_index()]
        return mine.get("train"), mine.get("val")

    # -- save -----------------------------------------------------------------

    def save(self, step: int, state, train_data: dict, val_data: dict | None) -> dict[str, Any] | None:
        """Starts an asynchronous save of `state` as `step`; returns timings, None when skipped.

        Returns once the arrays are off the device (the caller may then donate them);
        the files are written in the background. Every process must call it.
        """
        if step == self.last_step or step in complete_steps(self.dir):
            return None
        import jax
        import orbax.checkpoint as ocp

        t0 = time.perf_counter()
        processes = _allgather_json({"train": train_data, "val": val_data})
        data = {
            "format": DATA_FORMAT,
            "process_count": jax.process_count(),
            "devices": self.mesh.size,
            "processes": processes,
        }
        self._manager().save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(state),
                data=ocp.args.JsonSave(data),
                config=ocp.args.JsonSave(self.cfg.to_dict()),
            ),
            force=True,
        )
        self.last_step = step
        return {"blocking_s": time.perf_counter() - t0, "path": str(self.dir / str(step))}

    def wait(self) -> None:
        """Blocks until the last save is committed."""
        if self._mngr is not None:
            self._mngr.wait_until_finished()

    def close(self) -> None:
        """Waits for the last save to commit; a failed save is reported, not raised (the loop's
        cleanup must still run; the previous checkpoint stays the newest complete one)."""
        if self._mngr is None:
            return
        mngr, self._mngr = self._mngr, None
        try:
            mngr.wait_until_finished()
            mngr.close()
        except Exception as e:  # noqa: BLE001 - orbax re-raises the background writer's error here
            self._warn(
                f"warning: checkpoint save did not complete ({_one_line(e)}); "
                f"the newest complete checkpoint is the one before step {self.last_step}"
            )


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__


# ---------------------------------------------------------------------------
# preemption


class PreemptionGuard:
    """SIGTERM -> stop at a step boundary that every process agrees on.

    `stop_requested()` is called once per step boundary by every process. With one
    process it is the local flag. With several, each call reads the OR of the flags
    posted at the previous boundary (an all-reduce queued behind the previous step,
    finished by the time it is read) and posts the current flag, so all processes
    see the same answer at the same boundary, one step after the signal at most.
    """

    def __init__(self, mesh=None):
        self.mesh = mesh
        self.requested = False
        self._prev_handler = None
        self._installed = False
        self._posted = None
        self._reduce = None

    def install(self) -> None:
        # Signal handlers can only be set from the main thread; elsewhere SIGTERM keeps
        # its default action.
        if threading.current_thread() is threading.main_thread():
            self._prev_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._installed = True

    def uninstall(self) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._prev_handler or signal.SIG_DFL)
            self._installed = False

    def _on_sigterm(self, signum, frame) -> None:
        if self.requested:
            # Second SIGTERM: whoever sends it wants the process gone now.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self.requested = True

    def stop_requested(self) -> bool:
        import jax

        if jax.process_count() == 1 or self.mesh is None:
            return self.requested
        import numpy as np

        agreed = False
        if self._posted is not None:
            agreed = bool(np.asarray(self._posted.addressable_data(0)))
        if not agreed:
            self._posted = self._post(self.requested)
        return agreed

    def _post(self, flag: bool):
        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        mesh = self.mesh
        axis = mesh.axis_names[0]
        if self._reduce is None:
            self._reduce = jax.jit(jnp.max, out_shardings=NamedSharding(mesh, P()))
        local = np.full((mesh.local_mesh.size,), int(flag), np.int32)
        flags = jax.make_array_from_process_local_data(NamedSharding(mesh, P(axis)), local, (mesh.size,))
        return self._reduce(flags)


# ---------------------------------------------------------------------------
# inference


def step_dirs(path: str | os.PathLike) -> list[pathlib.Path]:
    """Step directories at `path`, newest first: an out_dir, its checkpoints dir, or one step dir."""
    p = pathlib.Path(path)
    if (p / "state").is_dir() and (p / "config").is_dir():
        return [p]
    for root in (p / CHECKPOINT_DIR, p):
        steps = complete_steps(root)
        if steps:
            return [root / str(s) for s in reversed(steps)]
    raise CheckpointError(
        f"no checkpoint at {p}: expected an out_dir, its {CHECKPOINT_DIR}/ directory, or a step directory"
    )


def restore_params(step_dir: str | os.PathLike) -> Any:
    """The `params` subtree of a step directory's train state, as host numpy arrays."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    path = (pathlib.Path(step_dir) / "state").absolute()
    with ocp.PyTreeCheckpointer() as ckptr:
        tree = ckptr.metadata(path).item_metadata.tree
        want = {"params": tree["params"]}
        out = ckptr.restore(
            path,
            args=ocp.args.PyTreeRestore(
                item=want,
                restore_args=jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), want),
                partial_restore=True,
            ),
        )
    return out["params"]


def load_for_inference(path: str | os.PathLike, warn: Callable[[str], None] | None = None) -> tuple[Config, Any]:
    """(Config, params as numpy) of the newest readable checkpoint at `path`.

    `path`: an out_dir, its checkpoints/ directory, or one step directory. Only the
    params are read (not the optimizer state); an unreadable newest step falls back
    to the previous one with a warning.
    """
    import sys

    warn = warn or (lambda m: print(m, file=sys.stderr))
    errors = []
    for step_dir in step_dirs(path):
        try:
            cfg = config_from_dict(saved_config(step_dir))
            return cfg, restore_params(step_dir)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - any read failure means "try the previous one"
            errors.append(f"{step_dir.name}: {_one_line(e)}")
            warn(f"warning: checkpoint {step_dir} does not read back ({errors[-1]}); trying the previous one")
    raise CheckpointError(f"no checkpoint at {path} reads back ({'; '.join(errors[:3])})")
