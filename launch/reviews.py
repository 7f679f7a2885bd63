"""`python -m launch.reviews OUT.parquet`: a small labelled set in Yelp Review Full's layout, from this Python.

The strategy study's fine-tune (`data.dataset: reviews`, configs/recipes/reviews.yaml) reads examples with a
`label` (0-4) and a `text` column. Yelp Review Full itself is a download; this writes a set every machine
with Python can make: the module, class and function docstrings of five standard-library packages
(nsa_jax/data/reviews.py STDLIB_PACKAGES), each package a label, as one parquet file. It never overwrites.
"""

from __future__ import annotations

import collections
import pathlib
import sys

from launch.cli import Parser, UsageError, run_main
from nsa_jax.data.reviews import STDLIB_PACKAGES, stdlib_reviews, write_reviews


def build_parser() -> Parser:
    p = Parser(prog="python -m launch.reviews", description=__doc__.splitlines()[0], in_process=True)
    p.add_argument("out", help="the parquet file to write (its folder is made; an existing file is refused)")
    p.add_argument("--min-chars", type=int, default=40, help="shortest docstring kept (default 40)")
    return p


def run(args) -> int:
    out = pathlib.Path(args.out)
    if out.suffix != ".parquet":
        raise UsageError(f"{out}: name a .parquet file")
    if out.exists():
        raise UsageError(f"{out} exists; remove it or name another file")
    if args.min_chars < 1:
        raise UsageError("--min-chars must be at least 1")
    labels, texts = stdlib_reviews(args.min_chars)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_reviews(out, labels, texts)
    except OSError as e:
        raise UsageError(f"cannot write {out}: {e}") from None
    counts = collections.Counter(labels)
    per = ", ".join(f"{label} {STDLIB_PACKAGES[label]} {counts[label]}" for label in sorted(counts))
    print(f"reviews: wrote {out}: {len(labels):,} examples (label package count: {per})")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(build_parser, run, argv)


if __name__ == "__main__":
    sys.exit(main())
