"""Run artifacts under the output directory (docs/RUNBOOK.md "Artifacts"): the writers.

File names, columns and event names are defined in nsa_jax/rundir/files.py (no jax), which the report and
the watchdogs read by too:
  training.csv            header row; step, loss, lr, toks_per_s first (runbook scripts read column 3 as
                          tokens/s), then the columns of `csv_columns`; step_time_s / toks_per_s are the
                          step's own (no eval, no save)
  heartbeat_rank<r>.jsonl one JSON object per line: ts, iso, pid, rank, step, msg, memory, event
                          (rundir/files.py EVENTS) plus event-specific fields
  env.json                versions, devices, mesh, XLA_FLAGS, NSA_*/NCCL_* variables and what each NSA_*
                          toggle does here, git sha, config, kernels
  val.csv                 one row per evaluation on the fixed held-out set (nsa_jax/evaluation/heldout.py)
  long_eval.csv           with eval.suites: the long-context suites' figures per evaluation
  tb/                     tensorboardX event files
On resume both CSVs keep their rows up to the restored step (rewritten atomically, then appended to);
later rows are re-run. Process 0 writes the CSVs, env.json and tb/; every process writes its own
heartbeat. Each kind is switched by `logging.*` (the launcher maps NSA_TB_DISABLE, NSA_DISABLE_CSV_LOGS
and NSA_DISABLE_AUX_STATS onto those keys).
"""

from __future__ import annotations

import datetime
import errno
import importlib.metadata
import json
import math
import os
import pathlib
import platform
import resource
import subprocess
import sys
import time
from typing import Any, Callable

import jax
from tensorboardX import SummaryWriter

from nsa_jax.config import Config
from nsa_jax.kernels import cudnn_fits, plan_kernels
from nsa_jax.rundir import files as rf

# Torch-runbook variables that are accepted and do nothing here, and why.
NOOP_TOGGLES = {
    "NSA_PREFILL_BATCHED": "always vectorised",
    "NSA_SEL_RANGES_V2": "always vectorised; the kernel choice is model.nsa.attention_impl",
    "NSA_DDP_FIND_UNUSED": "jit traces one static graph; no unused-parameter search",
    "NSA_DDP_STATIC_GRAPH": "jit traces one static graph",
    "NSA_DDP_DISABLE_GC": "activation checkpointing is model.remat and works under data parallel",
    "NSA_DDP_SAFE_MODE": "no DDP hooks to make conservative",
    "NSA_OPT_FUSED": "XLA fuses the optimizer update",
    "NSA_USE_FA2": "no dense SDPA path; per-branch kernels are recorded in attention_impl",
    "NSA_SDPA_AUDIT": "no dense SDPA path; per-branch kernels are recorded in attention_impl",
    "NSA_SDPA_FLASH_ONLY": "no dense SDPA path; per-branch kernels are recorded in attention_impl",
    "NSA_SDPA_NO_FLASH": "no dense SDPA path; per-branch kernels are recorded in attention_impl",
    "NSA_NVTX": "branches always carry named scopes in profiler traces",
    "NSA_SCALER_INIT_SCALE": "no fp16 path; bf16 needs no loss scaling",
    "NSA_SCALER_GROWTH_INTERVAL": "no fp16 path; bf16 needs no loss scaling",
    "NSA_SCALER_GROWTH_FACTOR": "no fp16 path; bf16 needs no loss scaling",
    "NSA_SCALER_BACKOFF_FACTOR": "no fp16 path; bf16 needs no loss scaling",
}


def csv_columns(cfg: Config) -> tuple[str, ...]:
    return rf.training_columns(cfg.logging.aux_stats)


# ---------------------------------------------------------------------------
# memory and environment


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        try:
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        except Exception:  # noqa: BLE001 - memory is best effort
            return None


def memory_snapshot() -> dict[str, Any]:
    """Device bytes in use (max over local devices, and each device's in `per_device`, in
    jax.local_devices() order, so the balance between GPUs can be read) where the backend reports
    it, else process RSS."""
    in_use, peak = [], []
    for d in jax.local_devices():
        try:
            stats = d.memory_stats()
        except Exception:  # noqa: BLE001 - not every backend implements it
            stats = None
        if stats and "bytes_in_use" in stats:
            in_use.append(int(stats["bytes_in_use"]))
            peak.append(int(stats.get("peak_bytes_in_use", stats["bytes_in_use"])))
    if in_use:
        return {"source": "device", "bytes_in_use": max(in_use), "peak_bytes_in_use": max(peak), "per_device": in_use}
    return {"source": "process_rss", "bytes_in_use": _rss_bytes()}


def _git_sha() -> str | None:
    root = pathlib.Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def _version(module: str) -> str | None:
    try:
        return importlib.metadata.version(module)
    except Exception:  # noqa: BLE001 - absent package
        return None


def toggle_effects(environ: dict[str, str], applied: dict[str, str]) -> dict[str, dict[str, str]]:
    """Every NSA_* variable set, and the runbooks' CONFIG -> its value and what it does in this run."""
    out = {}
    for name in sorted(k for k in environ if k.startswith("NSA_") or k == "CONFIG"):
        if name in applied:
            effect = f"applied: {applied[name]}"
        elif name == "CONFIG":
            effect = "not used: --config names the config"
        elif name in NOOP_TOGGLES:
            effect = f"accepted, no effect: {NOOP_TOGGLES[name]}"
        else:
            effect = "not recognised; ignored"
        out[name] = {"value": environ[name], "effect": effect}
    return out


def env_info(cfg: Config, mesh, applied: dict[str, str] | None = None, kernel_plans=None) -> dict[str, Any]:
    """env.json's record. `kernel_plans`: [(first step, KernelPlan)] per schedule phase, what
    the step runs (default: the config's plan on the mesh's backend); `attention_impl` names
    the last phase's, `attention_impl_phases` each phase's when there are several."""
    environ = dict(os.environ)
    if kernel_plans is None:
        backend = mesh.devices.flat[0].platform
        kernel_plans = [(0, plan_kernels(cfg.model.nsa, cfg.train.seq_len, backend, cudnn_ok=cudnn_fits(cfg.model)))]
    scorer = cfg.model.nsa.scorer
    phases = [{"from_step": start, **plan.describe(scorer)} for start, plan in kernel_plans]
    return {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv,
        "versions": {
            "python": platform.python_version(),
            "jax": jax.__version__,
            "jaxlib": _version("jaxlib"),
            "flax": _version("flax"),
            "optax": _version("optax"),
            "orbax-checkpoint": _version("orbax-checkpoint"),
            "grain": _version("grain"),
            "numpy": _version("numpy"),
            "nsa_jax": _version("nsa-jax"),
        },
        "git_sha": _git_sha(),
        "host": platform.node(),
        "backend": jax.default_backend(),
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "devices": [str(d) for d in jax.devices()],
        "local_device_count": jax.local_device_count(),
        "mesh": {
            "axis_names": list(mesh.axis_names),
            "shape": dict(mesh.shape),
            "devices": [str(d) for d in mesh.devices.flat],
        },
        "attention_impl": kernel_plans[-1][1].describe(scorer),
        **({"attention_impl_phases": phases} if len(phases) > 1 else {}),
        "XLA_FLAGS": environ.get("XLA_FLAGS", ""),
        "nsa_env": {k: v for k, v in sorted(environ.items()) if k.startswith("NSA_")},
        "nccl_env": {k: v for k, v in sorted(environ.items()) if k.startswith("NCCL_")},
        "toggles": toggle_effects(environ, applied or {}),
        "noop_toggles": {k: f"accepted, no effect: {v}" for k, v in NOOP_TOGGLES.items()},
        "config": cfg.to_dict(),
    }


# ---------------------------------------------------------------------------
# writers


def _iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).isoformat(timespec="milliseconds")


class Heartbeat:
    """Appends one JSON line per event to heartbeat_rank<r>.jsonl, flushed at once (watchdogs tail it).

    A write the filesystem refuses (a full disk) drops that record: the event that
    reports a full disk must not itself turn the clean stop into a crash.
    """

    def __init__(self, path: pathlib.Path, rank: int):
        self.path, self.rank, self.pid = path, rank, os.getpid()
        self.f = open(path, "a", buffering=1)

    def event(self, event: str, step: int, msg: str = "", **fields: Any) -> None:
        ts = time.time()
        rec = {
            "ts": ts,
            "iso": _iso(ts),
            "pid": self.pid,
            "rank": self.rank,
            "step": int(step),
            "event": event,
            "msg": msg,
            "memory": memory_snapshot(),
            **fields,
        }
        try:
            self.f.write(json.dumps(rec, default=_json_default) + "\n")
        except OSError:  # dropped: see the class docstring
            pass

    def close(self) -> None:
        try:
            self.f.close()
        except OSError:  # the flush of a line the full disk refused
            pass


class CsvLog(rf.CsvWriter):
    """A header row, then one row per step (training.csv) or per evaluation (val.csv).

    `keep_upto`: resume at that step. The rows of an earlier file with step <= keep_upto
    are kept (a temporary file replaces the old one atomically, so a kill at any moment
    leaves either the old rows or the kept ones) and new rows are appended. Without it
    the file starts empty.
    """

    def __init__(self, path: pathlib.Path, columns: tuple[str, ...], keep_upto: int | None = None):
        super().__init__(path, columns, rf.rows_upto(path, keep_upto) if keep_upto is not None else ())


class TbLog:
    """tensorboardX scalars under <out>/tb."""

    def __init__(self, logdir: pathlib.Path):
        self.w = SummaryWriter(logdir=str(logdir), flush_secs=30)

    def scalars(self, step: int, values: dict[str, Any]) -> None:
        for k, v in values.items():
            if v is not None and math.isfinite(float(v)):
                self.w.add_scalar(k, float(v), step)

    def close(self) -> None:
        self.w.close()


def _json_default(v: Any):
    try:
        return v.item()
    except AttributeError:
        return str(v)


class OutputWriteError(OSError):
    """A run file (training.csv, val.csv, long_eval.csv, env.json) could not be written."""

    def __init__(self, path: pathlib.Path, cause: OSError):
        what = "disk full" if cause.errno == errno.ENOSPC else (cause.strerror or type(cause).__name__)
        super().__init__(cause.errno, f"{path.name} could not be written: {what}")
        self.path, self.cause = path, cause


class RunArtifacts:
    """The writers of one process, each present only when enabled for it.

    A write the filesystem refuses (most often a full disk between two checkpoint saves)
    does not raise: it is kept in `failed` (the first one), later CSV rows and env.json
    rewrites are skipped, and the loop stops at its next check as on a failed save
    (launch.train exits 74; the committed checkpoints stay and the same command resumes).
    The heartbeat drops a refused line instead: it reports the stop. Closing never
    raises for a line the full disk refused.
    """

    def __init__(
        self,
        cfg: Config,
        out_dir: str | os.PathLike,
        mesh,
        applied_env: dict[str, str] | None = None,
        resume_step: int | None = None,
        kernel_plans=None,
    ):
        self.cfg, self.out = cfg, pathlib.Path(out_dir)
        self.rank = jax.process_index()
        lead = self.rank == 0
        self.out.mkdir(parents=True, exist_ok=True)
        log = cfg.logging
        self.failed: OutputWriteError | None = None
        self.env_path = self.out / rf.ENV_JSON
        self.env = env_info(cfg, mesh, applied_env, kernel_plans) if log.env_json and lead else None
        if self.env is not None:
            self.write_env()
            if self.failed is not None:  # at boot nothing is lost: say it as the boot's error
                raise self.failed
        self.hb = Heartbeat(self.out / rf.heartbeat_name(self.rank), self.rank) if log.heartbeat else None
        self.csv = CsvLog(self.out / rf.TRAINING_CSV, csv_columns(cfg), resume_step) if log.csv and lead else None
        self.val_csv = CsvLog(self.out / rf.VAL_CSV, rf.VAL_COLUMNS, resume_step) if log.csv and lead else None
        self.tb = TbLog(self.out / rf.TB_DIR) if log.tensorboard and lead else None
        self.long_csv = None
        if log.csv and lead and cfg.eval.suites:
            cols = rf.long_eval_columns(cfg.eval.suites, cfg.eval.lengths or (cfg.train.seq_len,))
            self.long_csv = CsvLog(self.out / rf.LONG_EVAL_CSV, cols, resume_step)

    def write_env(self, **sections: Any) -> None:
        """(Re)writes env.json atomically, adding `sections` (e.g. compile statistics)."""
        if self.env is None:
            return
        self.env.update(sections)
        tmp = self.env_path.with_suffix(".json.tmp")

        def write() -> None:
            try:
                tmp.write_text(json.dumps(self.env, indent=2, default=_json_default) + "\n")
                os.replace(tmp, self.env_path)
            except OSError:
                tmp.unlink(missing_ok=True)  # a partial temporary file; env.json itself is untouched
                raise

        self._write(self.env_path, write)

    def _write(self, path: pathlib.Path, write: Callable[[], None]) -> None:
        if self.failed is not None:
            return
        try:
            write()
        except OSError as e:
            self.failed = OutputWriteError(path, e)

    def event(self, event: str, step: int, msg: str = "", **fields: Any) -> None:
        if self.hb is not None:
            self.hb.event(event, step, msg, **fields)

    def memory_profile(self, step: int) -> None:
        """This process's devices' memory profile after `step` (logging.mem_dump_every), for pprof."""
        path = self.out / "memory" / f"step{step}_rank{self.rank}.prof"

        def write():
            path.parent.mkdir(exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            jax.profiler.save_device_memory_profile(str(tmp))
            os.replace(tmp, path)

        self._write(path, write)
        self.event("memory_profile", step, f"device memory profile in {path.relative_to(self.out)}", path=str(path))

    def row(self, row: dict[str, Any]) -> None:
        if self.csv is not None:
            self._write(self.csv.path, lambda: self.csv.write(row))

    def val_row(self, row: dict[str, Any]) -> None:
        if self.val_csv is not None:
            self._write(self.val_csv.path, lambda: self.val_csv.write(row))

    def long_eval_row(self, row: dict[str, Any]) -> None:
        if self.long_csv is not None:
            self._write(self.long_csv.path, lambda: self.long_csv.write(row))

    def scalars(self, step: int, values: dict[str, Any]) -> None:
        if self.tb is not None:
            self.tb.scalars(step, values)

    def close(self) -> None:
        for w in (self.hb, self.csv, self.val_csv, self.long_csv, self.tb):
            if w is not None:
                try:
                    w.close()
                except OSError:  # the flush of a row the full disk refused, already in `failed`
                    pass
