"""How counts are said in what the commands print: `count(1, "step")` -> "1 step", `count(2, "step")` -> "2 steps".

One place, so no line says "1 steps" or hedges with "step(s)". No imports: every layer may use it.
"""

from __future__ import annotations


def count(n: int, noun: str, plural: str | None = None) -> str:
    """`n` (thousands separated) and `noun`, or its `plural` (default: noun + "s") unless n is 1."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"
