"""`python -m launch.report OUT [OUT ...] [--last N] [--out REPORT_DIR] [thresholds]`

One run: prints the acceptance summary of OUT (throughput over the last N steps of
OUT/training.csv as total tokens / total step time and the median step's rate, loss
finite and falling, step-time spread (1.4826 x MAD / median), memory
plateau from the heartbeats, gate health, halts and anomalies, heartbeats), one
GO / NO-GO / N/A line per criterion, and writes PNG plots plus report.md into
REPORT_DIR (default OUT/report).

Several runs: the same judgement for each, then a table ranked by tokens/s (total
tokens / total step time; within --tie-pct percent to the lower pstdev), as the bucket sweep asks;
overlaid plots and comparison.md go to REPORT_DIR (default <common parent>/comparison).

A run that is still going, died, or lacks some artifacts is reported from what is
there, with the rest named as missing. What could not be read (a malformed or cut-off
line) is a `warning:` line on stderr and makes the `files` criterion NO-GO; remarks
that are no damage (a run still writing its last line) are `note:` lines on stderr.
A path that does not exist, or a folder that holds no run (an empty folder, the parent
of runs: the error names the runs inside it): one `error:` line, exit status 2, and
nothing is written. Exit status 0 otherwise; with --strict, 1 when a verdict is not GO.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys
from typing import Sequence

from launch.cli import Parser
from nsa_jax.report.criteria import GO, Entry, Summary, Thresholds, rank_entries, summarize
from nsa_jax.report.plots import comparison_figures, run_figures, save_figures
from nsa_jax.report.reading import RunPathError, load_run, resolve_run_dir
from nsa_jax.report.text import format_summary, format_table, markdown_summary, markdown_table, warning_lines

_THRESHOLD_HELP = {
    "min_toks_per_s": "throughput: lowest window tok/s, total tokens / total step time (the torch runbook's 39 on "
    "2xA100 is no floor here: one H200 runs a100_pcie at 231k; take your box's phase 1 figure less 10%%)",
    "min_loss_drop": "loss: the last-k mean must be below the first-k mean by more than this",
    "max_step_cv": "step time: highest robust coefficient of variation (1.4826 x MAD / median) over the window",
    "max_mem_growth": "memory: highest growth of bytes in use, last vs first half of the window (0.05 = 5%%)",
    "mem_growth_floor_gib": "memory: growth is a leak only when it is also above this many GiB",
    "max_mem_gib": "memory: highest peak bytes in use per rank, GiB",
    "min_gate_entropy": "gates: lowest window-mean gate entropy in nats (uniform over 3 branches: 1.099)",
    "max_gate_mean": "gates: highest window-mean gate of any branch",
    "max_heartbeat_gap_s": "heartbeats: longest silence between events after the first step, seconds",
}


def add_report_args(p: argparse.ArgumentParser) -> None:
    """--last, --tie-pct and one flag per threshold (shared with launch.sweep)."""
    p.add_argument("--last", type=int, default=50, metavar="N", help="judge the last N steps (default 50)")
    p.add_argument(
        "--tie-pct",
        type=float,
        default=1.0,
        metavar="P",
        help="ranking: means within P%% of the better one tie; the lower pstdev wins (default 1)",
    )
    g = p.add_argument_group("thresholds")
    for f in dataclasses.fields(Thresholds):
        g.add_argument(
            "--" + f.name.replace("_", "-"),
            type=float,
            default=f.default,
            metavar="X",
            help=f"{_THRESHOLD_HELP[f.name]} (default {f.default:g})",
        )


def thresholds_from_args(args: argparse.Namespace) -> Thresholds:
    return Thresholds(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Thresholds)})


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m launch.report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("runs", nargs="+", metavar="OUT", help="run output directories (or their training.csv)")
    p.add_argument("--out", metavar="REPORT_DIR", help="where plots and the markdown page go")
    p.add_argument("--strict", action="store_true", help="exit 1 when any run's verdict is not GO")
    add_report_args(p)
    return p


def write_run_report(summary: Summary, out_dir: pathlib.Path) -> tuple[pathlib.Path, int]:
    """PNGs and report.md of one run; returns the page and the number of plots."""
    figs, skipped = run_figures(summary.run, summary)
    paths = save_figures(figs, out_dir)
    page = out_dir / "report.md"
    images = {k: p.name for k, p in paths.items()}
    page.write_text(markdown_summary(summary, images, skipped) + "\n")
    return page, len(paths)


def labels_for(dirs: Sequence[pathlib.Path]) -> list[str]:
    """Directory names, or paths below the common parent where names repeat."""
    names = [d.resolve().name for d in dirs]
    if len(set(names)) == len(names):
        return names
    common = pathlib.Path(os.path.commonpath([str(d.resolve()) for d in dirs]))
    return [str(d.resolve().relative_to(common)) or d.name for d in dirs]


def default_comparison_dir(dirs: Sequence[pathlib.Path]) -> pathlib.Path:
    common = pathlib.Path(os.path.commonpath([str(d.resolve()) for d in dirs]))
    if any(common == d.resolve() for d in dirs):
        common = common.parent
    if common == pathlib.Path(common.anchor):  # runs share no parent: do not write at the top of the tree
        common = pathlib.Path.cwd()
    return common / "comparison"


def comparison_text(entries: Sequence[Entry], last: int, tie_pct: float) -> str:
    """Each run's summary, then the ranked table."""
    lines = []
    for e in entries:
        lines += [f"== {e.label}: {e.status}", format_summary(e.summary) if e.summary else "no artifacts", ""]
    lines.append(format_table(rank_entries(entries, tie_pct), last, tie_pct))
    return "\n".join(lines)


def write_comparison(entries: Sequence[Entry], out_dir: pathlib.Path, last: int, tie_pct: float) -> pathlib.Path:
    """Overlaid PNGs and comparison.md (ranked table, then each run's criteria)."""
    runs = [e.summary.run for e in entries if e.summary is not None]
    figs, skipped = comparison_figures(runs)
    paths = save_figures(figs, out_dir)
    ranked = rank_entries(entries, tie_pct)
    lines = ["# Run comparison", "", markdown_table(ranked, last, tie_pct), ""]
    for name, p in paths.items():
        lines += [f"## {name.replace('_', ' ')}", "", f"![{name}]({p.name})", ""]
    if skipped:
        lines += ["Plots not drawn: " + "; ".join(f"{k} ({v})" for k, v in skipped.items()), ""]
    for _, e in ranked:
        if e.summary is not None:
            lines += [markdown_summary(e.summary, {}, {}, level=2), ""]
        else:
            lines += [f"## Run report: {e.label}", "", f"- {e.status}; no artifacts", ""]
    page = out_dir / "comparison.md"
    page.write_text("\n".join(lines))
    return page


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.last < 1:
        print("error: --last must be at least 1", file=sys.stderr)
        return 2
    try:
        dirs = [resolve_run_dir(p, require_run=True) for p in args.runs]
    except RunPathError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    th = thresholds_from_args(args)
    summaries = [summarize(load_run(d, label), args.last, th) for d, label in zip(dirs, labels_for(dirs))]
    for s in summaries:
        for line in warning_lines(s):
            print(line, file=sys.stderr)
    try:
        if len(summaries) == 1:
            s = summaries[0]
            print(format_summary(s))
            page, n = write_run_report(s, pathlib.Path(args.out) if args.out else dirs[0] / "report")
            print(f"report: {page} ({n} plots)")
        else:
            entries = [Entry(s.run.label, s) for s in summaries]
            print(comparison_text(entries, args.last, args.tie_pct))
            out = pathlib.Path(args.out) if args.out else default_comparison_dir(dirs)
            out.mkdir(parents=True, exist_ok=True)
            print(f"report: {write_comparison(entries, out, args.last, args.tie_pct)}")
    except OSError as e:
        print(f"error: cannot write the report: {e}", file=sys.stderr)
        return 2
    if args.strict and any(s.verdict != GO for s in summaries):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
