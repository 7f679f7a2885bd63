"""Compiled memory: what an XLA program needs per device, and what a device has.

One schema for every compiled program (the train step, the evaluation scorer, the
programs nsa_jax/tools/aot.py compiles for a GPU card, the benchmarks):
`compiled_memory(compiled)` is {"argument", "output", "alias", "temp",
"generated_code", "total"} in bytes per device, from XLA's `memory_analysis()` (its
buffer assignment: what XLA planned, not a measured peak), with
`total` = argument + output + temp - alias, what the program needs at once when
donated inputs are reused for outputs; None where the backend reports no analysis.

`device_memory_limit(device)` is what one device may use; `check_fits` compares the
train step's total with it and raises `WontFitError` (one line naming the knobs)
before the step runs, instead of dying in the allocator.
"""

from __future__ import annotations

import os

import jax

from nsa_jax.config import Config

FIELDS = ("argument", "output", "alias", "temp", "generated_code")


class WontFitError(ValueError):
    """A compiled program needs more memory than the device has; one line naming the knobs."""


def compiled_memory(compiled) -> dict[str, int] | None:
    """Per-device bytes of a compiled program: FIELDS and `total` (module docstring); None when not reported."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        return None
    if m is None:
        return None
    out = {k: int(getattr(m, f"{k}_size_in_bytes", 0) or 0) for k in FIELDS}
    out["total"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
    return out


def device_memory_limit(device) -> tuple[int | None, str]:
    """(bytes one device may use, where the figure comes from): the allocator's limit where the
    backend reports it, else the host's physical memory shared by its local devices (CPU)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - not every backend implements it
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"{device.platform} memory_stats bytes_limit"
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None, "unknown"
    return total // max(1, jax.local_device_count()), "host RAM / local devices"


def fmt_mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def fmt_size(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,.0f} B"


def describe(mem: dict[str, int] | None) -> str:
    """' | per device: arguments ..., temporaries ..., outputs ... (... aliased to donated inputs)'; '' without."""
    if not mem:
        return ""
    return (
        f" | per device: arguments {fmt_mib(mem['argument'])}, temporaries {fmt_mib(mem['temp'])}, "
        f"outputs {fmt_mib(mem['output'])} ({fmt_mib(mem['alias'])} aliased to donated inputs)"
    )


def check_fits(cfg: Config, mem: dict[str, int] | None, device) -> None:
    """WontFitError when the compiled train step's per-device total exceeds the device's limit."""
    if not mem:
        return
    need = mem["total"]
    limit, source = device_memory_limit(device)
    if limit is None or need <= limit:
        return
    t = cfg.train
    raise WontFitError(
        f"the compiled train step needs {fmt_size(need)} per device (temporaries {fmt_size(mem['temp'])}) "
        f"and the device has {fmt_size(limit)} ({source}); lower train.global_batch ({t.global_batch}) and raise "
        f"train.accumulate ({t.accumulate}) to keep the tokens per step, lower train.seq_len ({t.seq_len}), or set "
        f"model.remat=full (now {cfg.model.remat})"
    )
