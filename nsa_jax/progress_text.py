"""The wording every command's progress lines share: durations and the "so far" line.

Training (nsa_jax/train/progress.py), inference (nsa_jax/inference/progress.py),
evaluation and the launchers all print how long something took or will take. The text
lives here, at the bottom of the import graph (standard library only), so each of them
imports it without reaching into another's package: inference and evaluation must not
depend on the training loop's modules.
"""

from __future__ import annotations

import math


def fmt_duration(seconds: float) -> str:
    """45 -> '45s', 83 -> '1m23s', 7500 -> '2h05m', 6048000 -> '70d00h'; '?' when unknown."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600:02d}h"


def fmt_seconds(seconds: float) -> str:
    """fmt_duration, with decimals below 10 s (a short batch's time is not '0s'): 0.062 -> '0.06s', 4.26 -> '4.3s'."""
    if 0 <= seconds < 1:
        return f"{seconds:.2f}s"
    if 1 <= seconds < 10:
        return f"{seconds:.1f}s"
    return fmt_duration(seconds)


def so_far(what: str, seconds: float) -> str:
    """'<what>: 1m02s so far': the line of an activity still under way."""
    return f"{what}: {fmt_duration(seconds)} so far"
