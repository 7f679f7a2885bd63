"""`python -m launch.sweep --set-values KEY=V1,V2,... [--out-root DIR] [report flags] -- <launch.train arguments>`

Runs one training per value, one after another:
  python -m launch.train <arguments> --set KEY=V --out-dir <root>/KEY=V
(the sweep's --set comes last, so it wins over the same key in the arguments or
in NSA_* variables), keeps each variant's console output in <root>/logs/KEY=V.log,
and ends with the comparison of `launch.report`: every variant's go/no-go summary and
a table ranked by mean tokens/s over the last N steps (ties to the lower pstdev).
The runbook's bucket sweep:
  python -m launch.sweep --set-values parallel.bucket_mb=25,50,100 -- --config a100_pcie --steps 200

A variant that exits non-zero is marked failed in the table (and not ranked); the
sweep goes on with the next one and exits 1 at the end. Bad sweep arguments: one
`error:` line, exit 2.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys

from launch.cli import Parser
from launch.report import add_report_args, comparison_text, thresholds_from_args, write_comparison
from nsa_jax.report.criteria import Entry, summarize
from nsa_jax.report.reading import load_run
from nsa_jax.report.text import warning_lines


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m launch.sweep", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--set-values",
        required=True,
        metavar="KEY=V1,V2,...",
        help="the config key to sweep and its comma-separated values",
    )
    p.add_argument("--out-root", metavar="DIR", help="parent of the variants' out dirs (default artifacts/sweep/KEY)")
    p.add_argument("--dry-run", action="store_true", help="print the commands and stop")
    add_report_args(p)
    return p


def parse_values(spec: str) -> tuple[str, list[str]]:
    """'KEY=V1,V2' -> ('KEY', ['V1', 'V2']); ValueError on a malformed spec."""
    key, sep, rest = spec.partition("=")
    key = key.strip()
    values = [v.strip() for v in rest.split(",")]
    if not sep or not key or not rest.strip():
        raise ValueError(f"--set-values {spec!r} must look like KEY=V1,V2,...")
    if any(not v for v in values):
        raise ValueError(f"--set-values {spec!r} has an empty value")
    if len(set(values)) != len(values):
        raise ValueError(f"--set-values {spec!r} repeats a value")
    if key == "train.out_dir":
        raise ValueError("--set-values cannot sweep train.out_dir; the sweep sets each variant's out dir")
    return key, values


def check_train_args(train_args: list[str]) -> None:
    """The sweep owns the out dir of every variant."""
    for i, a in enumerate(train_args):
        nxt = train_args[i + 1] if i + 1 < len(train_args) else ""
        if a == "--out-dir" or a.startswith("--out-dir="):
            raise ValueError("the training arguments must not set --out-dir; use --out-root")
        if (a == "--set" and nxt.startswith("train.out_dir=")) or a.startswith("--set=train.out_dir="):
            raise ValueError("the training arguments must not set train.out_dir; use --out-root")


def variant_command(train_args: list[str], key: str, value: str, out: pathlib.Path) -> list[str]:
    return [sys.executable, "-m", "launch.train", *train_args, "--set", f"{key}={value}", "--out-dir", str(out)]


def run_variant(cmd: list[str], name: str, log: pathlib.Path) -> tuple[int, str]:
    """Runs one variant, echoing its output with a `[name]` prefix; (exit status, last error line)."""
    last_error, last_line = "", ""
    with (
        open(log, "w") as f,
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) as proc,
    ):
        try:
            for line in proc.stdout:
                f.write(line)
                print(f"[{name}] {line}", end="", flush=True)
                if line.strip():
                    last_line = line.strip()
                    if line.startswith(("error:", "Traceback", "halt:")) or "Error" in line.split(":")[0]:
                        last_error = line.strip()
            rc = proc.wait()
        except KeyboardInterrupt:
            # Stop only the child this sweep started, then let the interrupt end the sweep.
            proc.terminate()
            proc.wait()
            raise
    return rc, last_error or last_line


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def print_comparison(entries, last: int, tie_pct: float) -> None:
    """The runs' summaries and ranked table on stdout; problems reading their files and notes on stderr."""
    print()
    print(comparison_text(entries, last, tie_pct))
    for e in entries:
        for line in warning_lines(e.summary) if e.summary else ():
            print(line, file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    own, train_args = split_argv(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(own)
    try:
        key, values = parse_values(args.set_values)
        check_train_args(train_args)
        if args.last < 1:
            raise ValueError("--last must be at least 1")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    root = pathlib.Path(args.out_root) if args.out_root else pathlib.Path("artifacts", "sweep", key)
    # A value with a path separator would nest directories; the name keeps the value readable.
    names = [f"{key}={v}".replace(os.sep, "_") for v in values]
    cmds = [variant_command(train_args, key, v, root / n) for v, n in zip(values, names)]
    if args.dry_run:
        for c in cmds:
            print(subprocess.list2cmdline(c))
        return 0
    try:
        (root / "logs").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"error: cannot create {root / 'logs'}: {e}", file=sys.stderr)
        return 2

    results: dict[str, tuple[str, str, bool]] = {}
    interrupted = False
    for i, (name, cmd) in enumerate(zip(names, cmds), 1):
        print(f"== [{i}/{len(cmds)}] {name}: {subprocess.list2cmdline(cmd)}", flush=True)
        try:
            rc, err = run_variant(cmd, name, root / "logs" / f"{name}.log")
        except KeyboardInterrupt:
            results[name] = ("interrupted", "stopped by the user", True)
            interrupted = True
            break
        results[name] = ("ok", "", False) if rc == 0 else (f"failed (exit {rc})", f"exit {rc}: {err}", True)
        print(f"== [{i}/{len(cmds)}] {name}: {results[name][0]}", flush=True)

    th = thresholds_from_args(args)
    entries = []
    for name in names:
        status, err, failed = results.get(name, ("not run", "", True))
        out = root / name
        summary = summarize(load_run(out, name), args.last, th) if out.is_dir() else None
        entries.append(Entry(name, summary, failed=failed, status=status, error=err))
    print_comparison(entries, args.last, args.tie_pct)
    try:
        print(f"report: {write_comparison(entries, root / 'comparison', args.last, args.tie_pct)}")
    except OSError as e:
        print(f"error: cannot write the report: {e}", file=sys.stderr)
    if interrupted:
        return 130
    return 1 if any(e.failed for e in entries) else 0


if __name__ == "__main__":
    sys.exit(main())
