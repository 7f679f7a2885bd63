"""Checkpoints: orbax saves of the whole run, automatic exact resume, restore anywhere.

One orbax `CheckpointManager` step per saved optimizer step, `<out_dir>/checkpoints/<step>/`:
  state      TrainState (step, params, opt_state, rng): arrays (OCDBT)
  data       JSON data position: {"format": 2, "process_count", "devices", "global": {"train", "val"}} for
             the streams numbered over the run (synthetic, kv_recall, tokenized), or format 1's "processes":
             [{"train", "val"}] one per process (fineweb_edu, jsonl, text: always)
  config     JSON: Config.to_dict() of the run that saved it
  checksums  JSON: {"format", "state": {array path: uint32}, "data", "config"}, recomputed on restore
Saves: every `checkpoint.save_every` steps, every `checkpoint.save_minutes`, at the end of a run (after a
SIGINT, SIGTERM or .HALT stop too); `save()` returns once the state is off the device, orbax writes in the
background, a step directory gets its name only when complete; `checkpoint.max_to_keep` newest are kept.
Resume is automatic, from the newest step that reads back and matches its checksums; one that does not is
moved to `checkpoints_corrupt/` and the previous tried (CheckpointError when none does, or when the model
or data layout differs: `resume_conflicts`). A checkpoint is the state after step s and the data after its
s * train.accumulate micro-batches, so a killed step reruns bit for bit (on CPU). Arrays restore onto the
new mesh's shardings; a global data position onto any process count, per-process ones onto their own. A
failed background save is one CheckpointSaveError line (`Checkpointer.poll`). The details, step by step:
docs/CHECKPOINTS.md; failure cases: docs/RUNBOOK.md; the out_dir policy: resume.py.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import sys
import time
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from nsa_jax.agreement import agree_any
from nsa_jax.config import Config, ConfigError
from nsa_jax.data.sources import FILE_DATASETS
from nsa_jax.rundir import files as rf
from nsa_jax.rundir.checksums import (
    CHECKSUM_FORMAT,
    ChecksumError,
    host_checksums,
    json_checksum,
    read_checksums,
    state_checksums,
    verify_checksums,
)
from nsa_jax.rundir.orbax_errors import OrbaxErrorTrap, one_line, save_failure_cause, silence_closed_loop_callbacks
from nsa_jax.rundir.resume import (
    CheckpointError,
    checkpoint_dir,
    complete_steps,
    config_from_dict,
    quarantine,
    resume_conflicts,
    saved_config,
)
from nsa_jax.words import count

ITEMS = ("state", "data", "config", "checksums")
DATA_FORMAT = 2  # 1: one position per process only (read back with the same process count)


class CheckpointSaveError(RuntimeError):
    """A save that did not commit; `cause` is one line (disk full, permission denied, ...)."""

    def __init__(self, step: int, cause: str):
        super().__init__(f"checkpoint step {step} was not saved: {cause}")
        self.step, self.cause = step, cause


# ---------------------------------------------------------------------------
# multi-process helpers


def _allgather_json(obj: Any) -> list[Any]:
    """Every process's `obj` (JSON-serialisable), in process order; one entry per process."""
    if jax.process_count() == 1:
        return [obj]
    raw = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.int32(raw.size))).reshape(-1)
    buf = np.zeros(int(sizes.max()), np.uint8)
    buf[: raw.size] = raw
    rows = np.asarray(multihost_utils.process_allgather(buf)).reshape(len(sizes), -1)
    return [json.loads(bytes(rows[i, : sizes[i]]).decode()) for i in range(len(sizes))]


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


# ---------------------------------------------------------------------------
# save / restore of a training run


def _item_handlers() -> dict[str, Any]:
    """orbax handlers of the items; the state's arrays are written by the replica that
    holds them, without orbax's replica-parallel split.

    The split slices every replicated array across its devices with small jitted ops,
    and compiling those made the first save of a run block the loop for seconds. One
    writer per array is enough for replicated arrays, and each shard of a sharded one
    (zero1, fsdp) is written by the device that holds it.
    """
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
        "checksums": ocp.JsonCheckpointHandler(),
    }


@dataclasses.dataclass
class Restored:
    """What a resume needs: the train state, this process's data states, and where they came from."""

    step: int
    state: Any  # TrainState on the run's mesh
    train_data: dict | None  # None: checkpoint.restore_data is false
    val_data: dict | None
    path: pathlib.Path
    verified: bool = True  # False: written before checksums, read without a check
    verify_s: float = 0.0


class Checkpointer:
    """The orbax CheckpointManager of one run directory, used by the Trainer.

    `save` starts a save and returns; `poll` tells which saves have committed since
    (the loop writes the `checkpoint` event then) and raises CheckpointSaveError for
    one that failed. With one process `poll` looks without waiting, every step; with
    several it is asked only with block=True (at the next save and at the end), where
    every process waits and they agree on the outcome.
    """

    def __init__(
        self,
        plan,
        out_dir: str | os.PathLike,
        warn: Callable[[str], None] = print,
        verify: bool = True,
    ):
        # plan: the run's ShardingPlan (nsa_jax/step/strategies.py): its config, mesh and the
        # shapes and shardings of the state, which a restore reads straight into.
        self.plan, self.cfg, self.mesh = plan, plan.cfg, plan.mesh
        self.out, self._warn = pathlib.Path(out_dir), warn
        self.verify = verify
        self.dir = checkpoint_dir(out_dir)
        self._mngr = None
        self.last_step: int | None = None  # newest step on disk that this run saved or restored
        self.committed: int | None = None  # newest step known to be committed
        self._pending: int | None = None  # a save started and not yet seen committed or failed
        self._unreported: list[int] = []  # committed steps that save() saw before a poll could report them
        self._trap = OrbaxErrorTrap()
        logging.getLogger("absl").addFilter(self._trap)
        silence_closed_loop_callbacks()
        if self.cfg.checkpoint.enabled:
            # Opening the manager takes seconds: done at boot, not in the first save.
            self._manager()

    def _manager(self):
        if self._mngr is None:
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
        return self.plan.abstract_state()

    def _restore_step(self, mngr, step: int, target, saved: dict | None = None) -> Restored:
        """One step, verified against its checksums; raises on anything that does not read back."""
        step_dir = self.dir / str(step)
        sums = read_checksums(step_dir) if self.verify else None
        items = {
            "state": ocp.args.PyTreeRestore(
                item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)
            ),
            "data": ocp.args.JsonRestore(),
        }
        out = mngr.restore(step, args=ocp.args.Composite(**items))
        state = out.state
        if int(jax.device_get(state.step)) != step:
            raise ValueError(f"state.step is {int(jax.device_get(state.step))}, expected {step}")
        t0 = time.perf_counter()
        if sums is not None:
            verify_checksums(sums["state"], state_checksums(state), "array")
            if sums.get("data") != json_checksum(out.data):
                raise ChecksumError("checksum mismatch in the data item (the data position)")
            if sums.get("config") != json_checksum(saved_config(step_dir)):
                raise ChecksumError("checksum mismatch in the config item")
        verify_s = time.perf_counter() - t0
        micro_rows = (saved or {}).get("train", {}).get("global_batch")
        train_data, val_data = self._data_for_this_process(out.data, step, micro_rows)
        return Restored(step, state, train_data, val_data, step_dir, sums is not None, verify_s)

    def restore_latest(self) -> Restored | None:
        """The newest checkpoint that reads back and matches its checksums, or None when there is none.

        Steps that fail to read or to verify are moved to checkpoints_corrupt/ with a
        warning; CheckpointError when every step fails, or when the newest readable
        config must not be resumed with this run's config.
        """
        steps = complete_steps(self.dir)
        if not steps:
            return None
        mngr = self._manager()
        target = self.abstract_state()
        failed: list[tuple[int, str]] = []
        restored = None
        for step in reversed(steps):
            step_dir = self.dir / str(step)
            try:
                saved = saved_config(step_dir)
            except Exception as e:  # noqa: BLE001 - any read failure means "not usable"
                failed.append((step, f"config: {one_line(e)}"))
                self._warn(f"warning: checkpoint {step_dir} is unreadable ({failed[-1][1]}); trying the previous one")
                continue
            blocking, other = resume_conflicts(saved, self.cfg)
            if blocking:
                raise CheckpointError(
                    f"checkpoint {step_dir} was saved with a different setup ({'; '.join(blocking[:4])}); "
                    "resume with the settings it was saved with, or start this run in another out_dir"
                )
            try:
                restored = self._restore_step(mngr, step, target, saved)
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many kinds
                failed.append((step, one_line(e)))
                self._warn(
                    f"warning: checkpoint {step_dir} does not read back ({failed[-1][1]}); trying the previous one"
                )
                continue
            if other:
                self._warn(
                    f"resume: settings changed since step {step}: {'; '.join(other[:8])}"
                    + (f" (+{len(other) - 8} more)" if len(other) > 8 else "")
                )
            if not restored.verified and self.verify:
                self._warn(
                    f"warning: checkpoint {step_dir} has no checksums (written by an older version); not verified"
                )
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
                    dest = quarantine(self.dir / str(step), self.out)
                    self._warn(f"warning: moved unreadable checkpoint step {step} to {dest}")
            _barrier("nsa_checkpoint_quarantine")
            mngr.reload()
        self.last_step = self.committed = restored.step
        return restored

    def _data_for_this_process(
        self, data: dict, step: int, micro_rows: int | None = None
    ) -> tuple[dict | None, dict | None]:
        """This process's data states: the global position (format 2, any process count), or its own
        entry of a per-process list (the same process count only). `micro_rows`: train.global_batch
        of the saved run, which turns a per-process micro-batch count into global rows."""
        if not self.cfg.checkpoint.restore_data:
            return None, None
        if not isinstance(data, dict) or data.get("format") not in (1, DATA_FORMAT):
            raise ValueError("data item has an unknown format")
        if "global" in data:
            return data["global"].get("train"), data["global"].get("val")
        saved_pc, pc = int(data["process_count"]), jax.process_count()
        if saved_pc != pc:
            dataset = self.cfg.data.dataset
            file_stream = dataset in FILE_DATASETS
            why = (
                f"{dataset} streams read a shard of the files per process"
                if file_stream
                else "the checkpoint predates global positions"
            )
            elastic = (
                "; for runs that change their process count, prepare the files once with "
                "`python -m launch.prepare_data` and train with `--dataset tokenized`, whose position is global"
                if file_stream
                else ""
            )
            raise CheckpointError(
                f"checkpoint step {step} was saved by {count(saved_pc, 'process', 'processes')} and this run has {pc}, "
                f"and its data position is one per process ({why}); resume with "
                f"{count(saved_pc, 'process', 'processes')}, or set "
                "checkpoint.restore_data=false to restore weights, optimizer and step and restart the data stream "
                f"from its beginning{elastic}"
            )
        mine = data["processes"][jax.process_index()]
        train = mine.get("train")
        if isinstance(train, dict) and "position" in train and "rows" not in train and micro_rows:
            train = {**train, "micro_rows": int(micro_rows)}
        return train, mine.get("val")

    # -- save -----------------------------------------------------------------

    def save(self, step: int, state, train_data: dict, val_data: dict | None) -> dict[str, Any] | None:
        """Starts an asynchronous save of `state` as `step`; returns timings, None when skipped.

        Returns once the arrays are off the device (the caller may then donate them);
        the files are written in the background. Every process must call it. A save
        that failed in the background is raised here at the latest (CheckpointSaveError).
        """
        if step == self.last_step or step in complete_steps(self.dir):
            return None
        # orbax waits for the previous save anyway; its failure is raised first, its commit reported by the next poll
        self._unreported += self.poll(block=True)
        t0 = time.perf_counter()
        processes = _allgather_json({"train": train_data, "val": val_data})
        # A position that every process shares is the global one (GlobalRowStream): stored once, and
        # read back on any process count. Streams that read a shard per process keep one per process.
        shared = all(isinstance(p["train"], dict) and "rows" in p["train"] for p in processes) and all(
            p == processes[0] for p in processes
        )
        data = {
            "format": DATA_FORMAT,
            "process_count": jax.process_count(),
            "devices": self.plan.n_devices,  # the data axis: the groups the rows are split over
            **({"global": processes[0]} if shared else {"processes": processes}),
        }
        config = self.cfg.to_dict()
        t1 = time.perf_counter()
        sums = {
            "format": CHECKSUM_FORMAT,
            "state": state_checksums(state),
            "data": json_checksum(data),
            "config": json_checksum(config),
        }
        checksum_s = time.perf_counter() - t1
        self._manager().save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(state),
                data=ocp.args.JsonSave(data),
                config=ocp.args.JsonSave(config),
                checksums=ocp.args.JsonSave(sums),
            ),
            force=True,
        )
        self.last_step = self._pending = step
        return {"save_s": time.perf_counter() - t0, "checksum_s": checksum_s, "path": str(self.dir / str(step))}

    def poll(self, block: bool = False, agree: bool = True) -> list[int]:
        """Steps newly committed since the last poll; CheckpointSaveError for a save that failed.

        block=False (one process): looks without waiting. block=True: waits for the save
        in flight; with several processes every process must call it at the same step.
        """
        done, self._unreported = self._unreported, []
        if self._pending is None or self._mngr is None:
            return done
        if not block:
            if jax.process_count() > 1 or self._mngr.is_saving_in_progress():
                return done
        step, self._pending = self._pending, None
        error: BaseException | None = None
        try:
            self._mngr.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - orbax re-raises the background writer's error here
            error = e
        if error is None and self._trap.errors:
            error = self._trap.errors[-1]
        self._trap.errors.clear()
        committed = (self.dir / str(step)).is_dir()
        failed = error is not None or not committed
        if agree_any(failed) if agree else failed:
            cause = save_failure_cause(error) if error is not None else "the step directory was never committed"
            self.last_step, self._unreported = self.committed, done
            raise CheckpointSaveError(step, cause)
        self.committed = step
        return [*done, step]

    def wait(self) -> None:
        """Blocks until the last save is committed."""
        if self._mngr is not None:
            self._mngr.wait_until_finished()

    def close(self) -> None:
        """Waits for the last save to commit; a failure not polled yet is warned about in one line,
        not raised (the loop's cleanup must still run; the last committed checkpoint stays the newest)."""
        if self._mngr is None:
            logging.getLogger("absl").removeFilter(self._trap)
            return
        try:
            self.poll(block=True, agree=False)  # no collective: close runs on error paths too
        except CheckpointSaveError as e:
            self._warn(f"warning: {e}; the newest complete checkpoint is step {self.committed}")
        mngr, self._mngr = self._mngr, None
        try:
            mngr.close()
        except Exception as e:  # noqa: BLE001 - already reported by poll
            self._warn(f"warning: checkpoint manager did not close cleanly ({one_line(e)})")
        finally:
            logging.getLogger("absl").removeFilter(self._trap)


# ---------------------------------------------------------------------------
# inference


def step_dirs(path: str | os.PathLike) -> list[pathlib.Path]:
    """Step directories at `path`, newest first: an out_dir, its checkpoints dir, or one step dir."""
    p = pathlib.Path(path)
    if (p / "state").is_dir() and (p / "config").is_dir():
        return [p]
    for root in (p / rf.CHECKPOINT_DIR, p):
        steps = complete_steps(root)
        if steps:
            return [root / str(s) for s in reversed(steps)]
    raise CheckpointError(
        f"no checkpoint at {p}: expected an out_dir, its {rf.CHECKPOINT_DIR}/ directory, or a step directory"
    )


def restore_params(step_dir: str | os.PathLike, verify: bool = True) -> Any:
    """The `params` subtree of a step directory's train state, as host numpy arrays, checked
    against the checksums recorded at save (ChecksumError naming the array on a mismatch)."""
    step_dir = pathlib.Path(step_dir)
    path = (step_dir / "state").absolute()
    # The handler, not a Checkpointer: a Checkpointer looks for the step's _CHECKPOINT_METADATA
    # inside state/ (the manager writes it one level up) and warns that it is missing.
    handler = ocp.PyTreeCheckpointHandler()
    try:
        tree = handler.metadata(path).tree
        want = {"params": tree["params"]}
        out = handler.restore(
            path,
            args=ocp.args.PyTreeRestore(
                item=want,
                restore_args=jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), want),
                partial_restore=True,
            ),
        )
    finally:
        handler.close()
    params = out["params"]
    sums = read_checksums(step_dir) if verify else None
    if sums is not None:
        prefix = ".params"
        saved = {k[len(prefix) :]: v for k, v in sums["state"].items() if k.startswith(prefix)}
        verify_checksums(saved, host_checksums(params), "array params")
    return params


def load_for_inference(path: str | os.PathLike, warn: Callable[[str], None] | None = None) -> tuple[Config, Any]:
    """(Config, params as numpy) of the newest readable checkpoint at `path`.

    `path`: an out_dir, its checkpoints/ directory, or one step directory. Only the
    params are read (not the optimizer state); an unreadable newest step falls back
    to the previous one with a warning.
    """

    warn = warn or (lambda m: print(m, file=sys.stderr))
    errors = []
    for step_dir in step_dirs(path):
        try:
            cfg = config_from_dict(saved_config(step_dir))
            return cfg, restore_params(step_dir)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - any read failure means "try the previous one"
            errors.append(f"{step_dir.name}: {one_line(e)}")
            warn(f"warning: checkpoint {step_dir} does not read back ({errors[-1]}); trying the previous one")
    raise CheckpointError(f"no checkpoint at {path} reads back ({'; '.join(errors[:3])})")
