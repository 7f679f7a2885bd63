"""The device mesh: its axis names, the mesh a config runs on, and how a batch is laid on it.

Every module that names a mesh axis takes it from here: `DATA` (rows of the batch; the
data-parallel axis every strategy reduces gradients over) and `SEQ` (the devices one
sequence is split over under context parallelism, nsa/context.py). `make_mesh` builds
the (data, seq) mesh of a run, `process_rows` says which rows of the global batch this
process reads (data loading and held-out evaluation), and `put_batch` places a process's
rows as the global batch array, sharded on the batch axis.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nsa_jax.config import Config
from nsa_jax.words import count

DATA = "data"
SEQ = "seq"


def make_mesh(cfg: Config, devices: list | None = None) -> Mesh:
    """The (data, seq) mesh over `devices` (default: parallel.num_devices of jax.devices()).

    `seq` has parallel.context devices, neighbours in device order (on one host where the
    processes hold consecutive devices); `data` the rest.
    """
    visible = len(devices) if devices is not None else len(jax.devices())
    if devices is None:
        devices = jax.devices()
        n = cfg.parallel.num_devices
        if n:
            if jax.process_count() > 1:
                raise ValueError("parallel.num_devices must be 0 (all devices) in a multi-process run")
            if n > len(devices):
                seen = count(len(devices), "device is", "devices are")
                raise ValueError(f"parallel.num_devices is {n} but only {seen} visible{_more_devices(devices, n)}")
            devices = devices[:n]
    C = cfg.parallel.context
    if len(devices) % C:
        fixes = [f"parallel.context to a divisor of {len(devices)}"]
        if visible >= C:
            fixes.append(f"parallel.num_devices to a multiple of {C} (of the {visible} visible)")
        raise ValueError(
            f"parallel.context={C} must divide the run's {len(devices)} device(s) (data x seq); set "
            + " or ".join(fixes)
            + (_more_devices(devices, -(-visible // C) * C) if visible % C else "")
        )
    return Mesh(np.asarray(devices).reshape(len(devices) // C, C), (DATA, SEQ))


def _more_devices(devices: list, want: int) -> str:
    """Where one CPU process sees fewer than `want` devices: the flag that gives it more (read when jax starts)."""
    if devices[0].platform != "cpu" or jax.process_count() > 1:
        return ""
    return f"; on a CPU, run it with XLA_FLAGS=--xla_force_host_platform_device_count={want} (read when jax starts)"


def process_rows(mesh: Mesh) -> tuple[int, int]:
    """(index, count) of the rows this process reads among those of every process: processes whose
    devices hold the same `data` coordinates (a sequence split over `seq` across processes) read
    the same rows; (process_index, process_count) when each process has its own data coordinates."""
    data_of = {}
    axis = mesh.axis_names.index(DATA)
    for index, device in np.ndenumerate(mesh.devices):
        data_of.setdefault(device.process_index, set()).add(index[axis])
    groups = sorted({tuple(sorted(v)) for v in data_of.values()})
    flat = [d for g in groups for d in g]
    if len(flat) != len(set(flat)):
        raise ValueError(f"the mesh's data axis is split unevenly over the processes: {data_of}")
    return groups.index(tuple(sorted(data_of[jax.process_index()]))), len(groups)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """A batch [A, B, ...] (each leaf of its pytree) sharded on B."""
    return NamedSharding(mesh, P(None, DATA))


def put_batch(batch_AxbxT1: Any, mesh: Mesh) -> Any:
    """This process's rows [A, B / row groups, T + 1] -> the global sharded array [A, B, T + 1]
    (row groups: process_rows); every leaf of a batch pytree (data/targets.LabeledRows) alike."""
    groups, sharding = process_rows(mesh)[1], batch_sharding(mesh)

    def put(x: np.ndarray) -> jax.Array:
        shape = (x.shape[0], x.shape[1] * groups, *x.shape[2:])
        return jax.make_array_from_process_local_data(sharding, x, shape)

    return jax.tree.map(put, batch_AxbxT1)
