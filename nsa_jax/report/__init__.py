"""Run reports: the go/no-go summary of a run's artifacts (`summary`) and its plots (`plots`).

`summary` is plain Python over the files a run writes; `plots` needs matplotlib.
The command lines are `python -m launch.report` and `python -m launch.sweep`.
"""

from nsa_jax.report.summary import (
    GO,
    NA,
    NO_GO,
    Criterion,
    Entry,
    Run,
    RunPathError,
    Summary,
    Thresholds,
    format_summary,
    format_table,
    load_run,
    rank_entries,
    resolve_run_dir,
    summarize,
)

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
