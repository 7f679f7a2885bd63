"""`python -m launch.trace_summary RUN [--out DIR] [--top N]`: a run's profiler traces, one summary per rank.

RUN is a training run's out_dir (its `traces/rank<r>/`, written by `--profile-steps A:B`), a folder of
such `rank<r>` folders, or one trace folder (jax.profiler's, e.g. benchmarks.profile_step --trace-dir).
For each rank it writes `<out>/rank<r>/summary.csv` and a self-contained `summary.html` (time per
category per device: compute, exposed collectives, exposed memory copies, idle; the share of collective
time overlapped by compute; the top kernels; a timeline), default out `<RUN>/trace_summary`, and prints
a line per device (nsa_jax/report/traces.py).
"""

from __future__ import annotations

import pathlib
import re
import sys

from launch.cli import Parser, UsageError, run_main
from nsa_jax.report import traces as ts


def build_parser() -> Parser:
    p = Parser(description=__doc__.splitlines()[0], in_process=True)
    p.add_argument("run", help="a run's out_dir, a folder of rank<r> trace folders, or one trace folder")
    p.add_argument("--out", default=None, help="where the rank<r>/summary.* go (default: RUN/trace_summary)")
    p.add_argument("--top", type=int, default=15, help="kernels listed per rank")
    return p


def rank_folders(root: pathlib.Path) -> dict[int, pathlib.Path]:
    """{rank: the folder holding its trace}: RUN/traces/rank<r>, RUN/rank<r>, or RUN itself as rank 0."""
    for base in (root / "traces", root):
        ranks = {
            int(m.group(1)): p
            for p in sorted(base.glob("rank*"))
            if p.is_dir() and (m := re.fullmatch(r"rank(\d+)", p.name))
        }
        if ranks:
            return ranks
    return {0: root}


def run(args) -> int:
    root = pathlib.Path(args.run)
    if not root.is_dir():
        raise UsageError(f"{root} is not a folder: name a run's out_dir or a trace folder")
    if args.top < 1:
        raise UsageError("--top must be at least 1")
    found = {}
    for rank, folder in rank_folders(root).items():
        trace = ts.find_trace(folder)
        if trace is None:
            raise UsageError(
                f"no trace under {folder} (looked for perfetto_trace.json.gz or *.trace.json.gz): train with "
                "--profile-steps A:B, or name a jax.profiler trace folder"
            )
        found[rank] = trace
    out = pathlib.Path(args.out) if args.out else root / "trace_summary"
    for rank, trace in found.items():
        try:
            summary = ts.summarise(ts.read_trace(trace), args.top)
        except (ValueError, OSError, EOFError) as e:
            raise UsageError(f"cannot read the trace {trace}: {e}") from None
        folder = out / f"rank{rank}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            ts.write_csv(summary, rank, folder / "summary.csv")
            ts.write_html(summary, rank, folder / "summary.html", str(trace))
        except OSError as e:
            raise UsageError(f"cannot write the summary under {folder}: {e}") from None
        for device, d in summary["devices"].items():
            parts = ", ".join(f"{name} {ms:.2f} ms" for name, ms in d["ms"].items())
            share = d["collective_overlapped"]
            overlap = "" if share is None else f"; collectives {100 * share:.0f}% overlapped"
            print(f"rank {rank} {device}: window {d['wall_ms']:.2f} ms: {parts}{overlap}")
        print(f"rank {rank}: {folder / 'summary.html'}, {folder / 'summary.csv'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(build_parser, run, argv)


if __name__ == "__main__":
    sys.exit(main())
