"""Multi-process start-up: where the coordinator is, how many processes, which one this is.

One process per host drives all of that host's accelerators; processes on different hosts find each other
through jax.distributed's coordination service (docs/RUNBOOK.md, "The processes"). The settings come from,
highest precedence first:

  1. launch.train flags   --coordinator HOST:PORT --num-processes N --process-id I
  2. environment          JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID
                          (what launch.spawn sets for its children)
  3. SLURM                SLURM_NTASKS, SLURM_PROCID, the first host of the step's node
                          list; port JAX_COORDINATOR_PORT, else derived from SLURM_JOB_ID

Flags and variables may be mixed field by field. Nothing set, or one process, means a single-process run
and nothing is initialised. jax's own cluster detection is switched off on purpose: under SLURM it pins
each process to the GPU numbered SLURM_LOCALID (one process per GPU), so with one task per node every
process would drive GPU 0 only. Nothing here imports jax at module level: launch.train resolves the
settings before XLA_FLAGS is final.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from typing import Mapping

from nsa_jax.words import count

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


class DistributedConfigError(ValueError):
    """Inconsistent multi-process settings, phrased as one line with the fix."""


@dataclasses.dataclass(frozen=True)
class DistSpec:
    """A multi-process run as seen by one process."""

    coordinator: str  # HOST:PORT of process 0's coordination service
    num_processes: int
    process_id: int
    source: str  # flags, env, flags+env or slurm

    def describe(self) -> str:
        return f"process {self.process_id} of {self.num_processes}, coordinator {self.coordinator} (from {self.source})"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The three launch flags; defaults None so the environment can fill them."""
    g = parser.add_argument_group("multi-process (one process per host)")
    g.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help=f"process 0's address for jax.distributed (else ${ENV_COORDINATOR}, else SLURM)",
    )
    g.add_argument("--num-processes", type=int, metavar="N", help=f"processes in the run (else ${ENV_NUM_PROCESSES})")
    g.add_argument("--process-id", type=int, metavar="I", help=f"this process, 0..N-1 (else ${ENV_PROCESS_ID})")


def _int_env(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise DistributedConfigError(f"{name}={raw!r} must be an integer") from None


def _check_address(addr: str, where: str) -> str:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedConfigError(f"{where} is {addr!r}; it must look like HOST:PORT, e.g. 10.0.0.1:1234")
    return addr


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: 'gpu[003-004,9],cpu1' -> 'gpu003'."""
    nodelist = nodelist.strip()
    m = re.match(r"([^,\[]*)(?:\[([^\]]*)\]([^,]*))?", nodelist)
    if not m or not (m.group(1) or m.group(2)):
        raise DistributedConfigError(f"cannot read a host from the SLURM node list {nodelist!r}")
    prefix, ranges, suffix = m.group(1), m.group(2), m.group(3) or ""
    if ranges is None:
        return prefix
    first = re.split(r"[,-]", ranges, maxsplit=1)[0]
    return f"{prefix}{first}{suffix}"


def _from_slurm(environ: Mapping[str, str]) -> DistSpec | None:
    if "SLURM_PROCID" not in environ:
        return None
    ntasks = _int_env(environ, "SLURM_NTASKS") or _int_env(environ, "SLURM_NPROCS") or 1
    if ntasks <= 1:
        return None
    nodes = _int_env(environ, "SLURM_STEP_NUM_NODES") or _int_env(environ, "SLURM_NNODES") or ntasks
    if ntasks > nodes:
        # Several tasks on a node would each claim all of its GPUs.
        raise DistributedConfigError(
            f"SLURM started {count(ntasks, 'task')} on {count(nodes, 'node')}; nsa-jax runs one process per host "
            "that drives all its GPUs: use srun --ntasks-per-node=1"
        )
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        raise DistributedConfigError("SLURM_PROCID is set but no SLURM node list; pass --coordinator HOST:PORT")
    port = _int_env(environ, "JAX_COORDINATOR_PORT")
    if port is None:
        # Same on every task of the job, and different for jobs sharing a first node.
        port = 49152 + (_int_env(environ, "SLURM_JOB_ID") or 0) % 16384
    return DistSpec(
        _check_address(f"{first_host(nodelist)}:{port}", "the SLURM coordinator"),
        ntasks,
        _int_env(environ, "SLURM_PROCID"),
        "slurm",
    )


def resolve(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> DistSpec | None:
    """The run's multi-process settings, or None for a single-process run."""
    environ = os.environ if environ is None else environ
    flags = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
    env = {
        "coordinator": environ.get(ENV_COORDINATOR, "").strip() or None,
        "num_processes": _int_env(environ, ENV_NUM_PROCESSES),
        "process_id": _int_env(environ, ENV_PROCESS_ID),
    }
    merged = {k: flags[k] if flags[k] is not None else env[k] for k in flags}
    if all(v is None for v in merged.values()):
        return _from_slurm(environ)
    n = merged["num_processes"]
    if n is not None and n < 1:
        raise DistributedConfigError(f"the number of processes must be >= 1, got {n}")
    if n == 1 and merged["process_id"] in (None, 0):
        return None
    missing = [
        name
        for name, key, var in (
            ("--coordinator", "coordinator", ENV_COORDINATOR),
            ("--num-processes", "num_processes", ENV_NUM_PROCESSES),
            ("--process-id", "process_id", ENV_PROCESS_ID),
        )
        if merged[key] is None
    ]
    if missing:
        raise DistributedConfigError(
            f"a multi-process run needs {', '.join(missing)} (or ${ENV_COORDINATOR}, ${ENV_NUM_PROCESSES}, "
            f"${ENV_PROCESS_ID}); or use python -m launch.spawn --nproc N -- python -m launch.train ..."
        )
    pid = merged["process_id"]
    if not 0 <= pid < n:
        raise DistributedConfigError(f"the process id must lie in 0..{n - 1}, got {pid}")
    used_flags = any(v is not None for v in flags.values())
    used_env = any(flags[k] is None and env[k] is not None for k in flags)
    source = "flags+env" if used_flags and used_env else "flags" if used_flags else "env"
    return DistSpec(_check_address(merged["coordinator"], "the coordinator"), n, pid, source)


def initialize(spec: DistSpec | None, *, init_timeout_s: int = 300, peer_timeout_s: int = 100) -> None:
    """jax.distributed.initialize for `spec` (nothing for None); must run before any device is used.

    peer_timeout_s: a process whose heartbeat is missing this long is declared dead
    and the coordination service stops the others, so a crashed or killed peer ends
    the run instead of leaving the rest blocked in a collective.
    """
    if spec is None:
        return
    import jax  # noqa: PLC0415 - launch.train imports this module before XLA_FLAGS is final

    # Cross-process collectives on the CPU backend (tests, CPU clusters); GPUs use NCCL.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=spec.coordinator,
        num_processes=spec.num_processes,
        process_id=spec.process_id,
        cluster_detection_method="deactivate",
        initialization_timeout=int(init_timeout_s),
        heartbeat_timeout_seconds=int(peer_timeout_s),
    )
