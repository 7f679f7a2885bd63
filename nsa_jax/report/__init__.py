"""Run reports: a run's files read (`reading`), judged go/no-go (`criteria`), written as text
and markdown (`text`), its plots (`plots`), and its profiler traces summarised per device (`traces`).

`reading`, `criteria` and `text` are plain Python over the files a run writes; `plots`
needs matplotlib. The command lines are `python -m launch.report` and `python -m launch.sweep`.
"""

from nsa_jax.report.criteria import GO, NA, NO_GO, Criterion, Entry, Summary, Thresholds, rank_entries, summarize
from nsa_jax.report.reading import Run, RunPathError, load_run, resolve_run_dir
from nsa_jax.report.text import format_summary, format_table

__all__ = [
    "GO",
    "NA",
    "NO_GO",
    "Criterion",
    "Entry",
    "Run",
    "RunPathError",
    "Summary",
    "Thresholds",
    "format_summary",
    "format_table",
    "load_run",
    "rank_entries",
    "resolve_run_dir",
    "summarize",
]
