"""Checkpoint saves inside a training run, and the stop of a run whose save or run file failed.

The Trainer (loop.py) starts a save after a recorded step (`save`): every
`checkpoint.save_every` steps, and when `due` says checkpoint.save_minutes of wall-clock
time passed since the last save (or the first step). It asks at every step
which saves committed (`poll`) and, before a save and after the last step, whether a
run file could not be written (`outputs_failed`). Each writes its heartbeat events
(`checkpoint_start`, `checkpoint`, `checkpoint_failed`, `output_failed`); a failure puts
summary["halted"] ("checkpoint_failed", "output_failed") and summary["error"] (one line
naming the newest committed checkpoint) into the run's summary, and the loop stops
(launch.train exits 74).

Saves run in the background (nsa_jax/rundir/checkpoint.py): `poll` reports a commit or a
failure at the next step with one process, at the next save or the end at the latest
with several.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import jax

from nsa_jax.agreement import agree_any
from nsa_jax.config import Config
from nsa_jax.rundir import checkpoint as ckpt
from nsa_jax.train.artifacts import RunArtifacts


def committed_note(last: int | None) -> str:
    return f"the newest committed checkpoint is step {last}" if last is not None else "no checkpoint was committed"


class RunSaves:
    """The saves of one run: its Checkpointer, its artifacts (events) and its summary (a failure's halt and error)."""

    clock: Callable[[], float] = staticmethod(time.monotonic)  # the time source of `due` (a test may replace it)

    def __init__(
        self,
        cfg: Config,
        checkpointer: ckpt.Checkpointer,
        art: RunArtifacts,
        summary: dict[str, Any],
        doing: Callable[[str | None], None],
    ):
        self.cfg, self.ckpt, self.art, self.summary, self._doing = cfg, checkpointer, art, summary, doing
        self._last_save_t: float | None = None  # the clock of `due` starts at the first step

    def due(self, step: int) -> bool:
        """Whether checkpoint.save_minutes have passed since the last save (or the first call).

        With several processes the clocks differ and a save is collective: they agree (one
        small all-gather) at log steps only, like .HALT.
        """
        minutes = self.cfg.checkpoint.save_minutes
        if minutes <= 0:
            return False
        now = self.clock()
        if self._last_save_t is None:
            self._last_save_t = now
        late = now - self._last_save_t >= minutes * 60
        if jax.process_count() == 1:
            return late
        return step % self.cfg.train.log_every == 0 and agree_any(late)

    def save(self, state, data) -> tuple[bool, float | None]:
        """Saves `state`, every step of which has been recorded, with the position of `data` after it.

        (False when the save failed: the run must stop, summary["halted"] says why; when the
        save's blocking part ended, the next step's time starting there, or None when nothing
        was saved: checkpoints off, a step dispatched but never recorded). The `checkpoint`
        event follows once the step is committed (`poll`).
        """
        if not self.cfg.checkpoint.enabled:
            return True, None
        step = self.summary["steps_done"]
        if int(jax.device_get(state.step)) != step:  # a step was dispatched but never recorded
            return True, None
        t0 = time.perf_counter()
        self._doing(f"checkpoint: saving step {step}")
        try:
            # The held-out rows are fixed (evaluation/heldout.py): no validation stream position to save.
            info = self.ckpt.save(step, state, data.get_state(), None)
        except ckpt.CheckpointSaveError as e:
            self._failed(e)
            return False, None
        done = time.perf_counter()
        self._last_save_t = self.clock()
        self._doing(None)
        if info is not None:
            self.art.event("checkpoint_start", step, info["path"], save_s=done - t0, checksum_s=info["checksum_s"])
        return True, done

    def poll(self, block: bool = False) -> bool:
        """Writes `checkpoint` events for committed saves; False (and a `checkpoint_failed` event)
        for one that failed."""
        try:
            committed = self.ckpt.poll(block=block)
        except ckpt.CheckpointSaveError as e:
            self._failed(e)
            return False
        for step in committed:
            self.art.event("checkpoint", step, str(self.ckpt.dir / str(step)))
        return True

    def _failed(self, e: ckpt.CheckpointSaveError) -> None:
        last = self.ckpt.committed
        msg = f"{e}; {committed_note(last)}; stopping (fix the cause and run the same command to resume)"
        self.summary.update(halted="checkpoint_failed", error=msg)
        self.art.event("checkpoint_failed", e.step, msg, cause=e.cause, committed_step=last)

    def outputs_failed(self, step: int | None) -> bool:
        """True (and the run stops, with an `output_failed` event) once a run file could not be written.

        No save on the way out: the disk that refused a CSV row would most likely refuse the
        checkpoint too, and a failed save adds nothing to the committed ones. With several
        processes (only process 0 writes the CSVs) all agree at log intervals, as for .HALT.
        """
        failed = self.art.failed
        if jax.process_count() > 1:  # step None: before a save or after the last step, where every process checks
            if (step is not None and step % self.cfg.train.log_every) or not agree_any(failed is not None):
                return False
        elif failed is None:
            return False
        # A save in flight commits (its `checkpoint` event) or fails before the message names the newest.
        self.poll(block=True)
        last = self.ckpt.committed
        what = failed.strerror if failed is not None else "process 0 could not write its run files"
        msg = f"{what}; {committed_note(last)}; stopping (free space and run the same command to resume)"
        self.summary.update(halted="output_failed", error=msg)
        path = str(failed.path) if failed else None
        self.art.event("output_failed", self.summary["steps_done"], msg, path=path, committed_step=last)
        return True
