"""What the runs of `launch.stages` wrote, read back: each run's recall series and needle accuracy,
and per recipe a report over seeds (`launch.stages` prints it at its end, `python -m
experiments.needle_seeds OUT` from the files later).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from nsa_jax.evaluation.results import RESULTS_FILE, unfinished
from nsa_jax.rundir import files as rf

# Needle exact match a seed must reach at every depth of the first length (the report's target).
TARGET = 0.90


def evaluated(eval_dir: Path) -> bool:
    """Whether the evaluation in `eval_dir` finished: an evaluation.json that a stopped launch.evaluate left with
    results still pending is continued by running the same evaluation again."""
    path = eval_dir / RESULTS_FILE
    try:
        return path.exists() and not unfinished(path)
    except (OSError, ValueError):
        return False  # unreadable: launch.evaluate says why


def read_run(run: Path) -> dict:
    """One run directory (<variant>_sSEED): its recall series and needle accuracy, whatever exists."""
    out: dict = {"seed": int(run.name.rsplit("_s", 1)[1]), "recall": [], "needle": {}}
    val = run / rf.VAL_CSV
    if val.exists():  # a stopped run's file may end in a cut-off line: the run files' reader skips it
        rows = [r for r in rf.read_csv(val)[1] if r.get("retrieval_acc") is not None]
        out["recall"] = [(int(r["step"]), float(r["retrieval_acc"])) for r in rows]
    ev = run / "eval" / "evaluation.json"
    if ev.exists():
        needle = json.loads(ev.read_text()).get("needle")
        if needle:
            for length, acc in zip(needle["lengths"], needle["accuracy"]):
                out["needle"][int(length)] = {"mean": sum(acc) / len(acc), "min": min(acc), "by_depth": acc}
    return out


def summary_line(run: str | Path) -> str:
    """A run's needle accuracy: "L=1024: mean M min N  L=2048: ..."."""
    needle = read_run(Path(run))["needle"]
    return "  ".join(f"L={n}: mean {v['mean']:.2f} min {v['min']:.2f}" for n, v in sorted(needle.items()))


def read(out_dir: Path, variant: str = "nsa") -> dict[str, list[dict]]:
    """{recipe name: [run, ...] by seed}: the `variant` runs of OUT/<recipe>/<variant>_sSEED."""
    recipes = {}
    for d in sorted(p for p in out_dir.iterdir() if p.is_dir()):
        found = (r for r in d.glob(f"{variant}_s*") if r.is_dir() and r.name.rsplit("_s", 1)[1].isdigit())
        runs = sorted((read_run(r) for r in found), key=lambda r: r["seed"])
        if runs:
            recipes[d.name] = runs
    return recipes


def report(recipes: dict[str, list[dict]]) -> list[str]:
    """Per recipe: each seed's needle accuracy and recall series, then the mean and spread over seeds
    and how many seeds reach TARGET at the first length."""
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
