"""Cross-process agreement: one flag per process -> the same answer on every process.

`agree_any` is what a multi-process run uses wherever each process sees something
alone (a failed save, a `.HALT` file, a kernel that failed its guard, an evaluation
that raised) and all of them must then act alike, or their collectives would part.

Why a module of its own at the bottom, next to config.py: the run directory
(rundir/checkpoint.py, a failed save), operations (ops/health.py, halts), the loop
(train/boot.py, train/saves.py) and evaluation (evaluation/training.py) all need it,
and it needs jax alone. In ops/ it made rundir/ import upward into operations,
which themselves read the run directory's schema (rundir/files.py).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils


def agree_any(flag: bool) -> bool:
    """True on every process when `flag` is True on any; a collective, so every process must call it."""
    if jax.process_count() == 1:
        return bool(flag)
    return bool(np.any(multihost_utils.process_allgather(np.int32(bool(flag)))))
