"""Reads what `python -m launch.stages` wrote: each recipe over its seeds, side by side.

    python -m experiments.needle_seeds OUT_DIR [--variant nsa] [--json FILE]

Per run: the digit recall on the validation rows at every evaluation (val.csv
`retrieval_acc`) and the needle exact match at each evaluated length (mean over depths,
and the worst depth). Per recipe: the mean, the spread over seeds, and how many seeds
reach the target (>= 0.90 at every depth at the first length). launch.stages prints the
same at the end of its runs; this reads an OUT_DIR later (one unpacked from its --archive,
or one whose runs were stopped).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from launch.recipe_results import read, report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--variant", default="nsa", help="the runs OUT_DIR/<recipe>/<variant>_sSEED to read (default nsa)")
    p.add_argument("--json", type=Path, help="write the per-run figures here")
    a = p.parse_args(argv)
    if not a.out_dir.is_dir():
        print(f"error: {a.out_dir} is not a directory (the --out of python -m launch.stages)", file=sys.stderr)
        return 2
    recipes = read(a.out_dir, a.variant)
    if not recipes:
        print(f"error: no runs (NAME/{a.variant}_sSEED) under {a.out_dir}", file=sys.stderr)
        return 2
    print("\n".join(report(recipes)))
    if a.json:
        a.json.write_text(json.dumps(recipes, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
