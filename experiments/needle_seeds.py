"""Reads what benchmarks/needle_seeds.sh wrote: each recipe over its seeds, side by side.

    python -m experiments.needle_seeds OUT_DIR [--json FILE]

Per run: the digit recall on the validation rows at every evaluation (val.csv
`retrieval_acc`) and the needle exact match at each evaluated length (mean over depths,
and the worst depth). Per recipe: the mean, the spread over seeds, and how many seeds
reach the target (>= 0.90 at every depth at the first length).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path

TARGET = 0.90


def read_run(run: Path) -> dict:
    """One run directory (nsa_sSEED): its recall series and needle accuracy, whatever exists."""
    out: dict = {"seed": int(run.name.rsplit("_s", 1)[1]), "recall": [], "needle": {}}
    val = run / "val.csv"
    if val.exists():
        with val.open() as f:
            rows = [r for r in csv.DictReader(f) if r["retrieval_acc"]]
        out["recall"] = [(int(r["step"]), float(r["retrieval_acc"])) for r in rows]
    ev = run / "eval" / "evaluation.json"
    if ev.exists():
        needle = json.loads(ev.read_text())["needle"]
        for length, acc in zip(needle["lengths"], needle["accuracy"]):
            out["needle"][int(length)] = {"mean": sum(acc) / len(acc), "min": min(acc), "by_depth": acc}
    return out


def summary_line(run: str | Path) -> str:
    """needle_recipe.sh's summary of one run's evaluation: "L=1024: mean M min N  L=2048: ..."."""
    needle = read_run(Path(run))["needle"]
    return "  ".join(f"L={n}: mean {v['mean']:.2f} min {v['min']:.2f}" for n, v in sorted(needle.items()))


def read(out_dir: Path) -> dict[str, list[dict]]:
    """{recipe name: [run, ...] by seed}."""
    recipes = {}
    for d in sorted(p for p in out_dir.iterdir() if p.is_dir()):
        runs = sorted((read_run(r) for r in d.glob("nsa_s*") if r.is_dir()), key=lambda r: r["seed"])
        if runs:
            recipes[d.name] = runs
    return recipes


def report(recipes: dict[str, list[dict]]) -> list[str]:
    lines = []
    for name, runs in recipes.items():
        lines.append(f"== {name}")
        means = []
        reached = 0
        for r in runs:
            series = " ".join(f"{s}:{a:.2f}" for s, a in r["recall"])
            needle = "  ".join(f"L={n}: {v['mean']:.2f} (min {v['min']:.2f})" for n, v in sorted(r["needle"].items()))
            lines.append(f"  seed {r['seed']:>2} | {needle or 'not evaluated'} | recall {series}")
            if r["needle"]:
                first = r["needle"][min(r["needle"])]
                means.append(first["mean"])
                reached += first["min"] >= TARGET
        if means:
            spread = statistics.pstdev(means) if len(means) > 1 else 0.0
            lines.append(
                f"  {len(means)} evaluated: mean {statistics.mean(means):.2f} (sd {spread:.2f}, "
                f"{min(means):.2f}-{max(means):.2f}); >= {TARGET:.2f} mean: {sum(m >= TARGET for m in means)}; "
                f">= {TARGET:.2f} at every depth: {reached}"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--json", type=Path, help="write the per-run figures here")
    a = p.parse_args(argv)
    if not a.out_dir.is_dir():
        print(f"error: {a.out_dir} is not a directory (the OUT_DIR of benchmarks/needle_seeds.sh)", file=sys.stderr)
        return 2
    recipes = read(a.out_dir)
    if not recipes:
        print(f"error: no runs (NAME/nsa_sSEED) under {a.out_dir}", file=sys.stderr)
        return 2
    print("\n".join(report(recipes)))
    if a.json:
        a.json.write_text(json.dumps(recipes, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
