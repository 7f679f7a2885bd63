"""Shared command-line conventions: bad input is one `error: ...` line and exit status 2.

`Parser` is argparse with that one line instead of the usage block. By default a bad
flag ends the process, as argparse does. With `in_process=True` it raises `UsageError`
instead, so a `main(argv)` that is also called from Python (tests, other tools) can
report bad flags through the same `except UsageError` as its own input checks and
return 2 rather than raise `SystemExit`.
"""

from __future__ import annotations

import argparse
import sys


class UsageError(Exception):
    """Bad command-line input: reported as one `error:` line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error instead of the usage block."""

    def __init__(self, *args, in_process: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.in_process = in_process

    def error(self, message: str):
        if self.in_process:
            raise UsageError(message)
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def run_main(build_parser, run, argv: list[str] | None = None) -> int:
    """`run(build_parser().parse_args(argv))`, with a UsageError as one `error:` line and status 2.

    For a tool whose parser is built with `in_process=True`, so bad flags and its own
    input checks end the same way whether it runs as a process or from Python.
    """
    try:
        return run(build_parser().parse_args(argv))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def add_overrides(p: argparse.ArgumentParser, example: str = "model.n_layers=2") -> None:
    """The `--set KEY=VALUE` flag every launcher takes (repeatable), collected in `args.overrides`."""
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"dotted config override, e.g. --set {example} (repeatable)",
    )
