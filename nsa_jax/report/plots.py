"""PNG plots of run artifacts (matplotlib, Agg canvas; no pyplot, so no global figure state).

`run_figures(run)` draws one run: loss (and validation loss), tokens/s (with the
window mean), step time, memory per rank, gate means and entropy, and the share of
selected blocks beyond the sliding window. `comparison_figures(runs)` overlays
several runs (one line per run). Each returns (figures by name, plots not drawn with
the reason) so a report can say what is absent instead of drawing empty axes.
"""

from __future__ import annotations

import pathlib
from typing import Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from nsa_jax.report.summary import GATE_COLUMNS, GIB, Run, Summary, memory_series

_SIZE = (8, 4)
_DPI = 100


def _figure(rows: int = 1) -> tuple[Figure, list]:
    fig = Figure(figsize=(_SIZE[0], _SIZE[1] * (1 if rows == 1 else 0.75 * rows)), dpi=_DPI)
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    for ax in axes:
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("step")
    return fig, list(axes)


def run_figures(run: Run, summary: Summary | None = None) -> tuple[dict[str, Figure], dict[str, str]]:
    figs: dict[str, Figure] = {}
    skipped: dict[str, str] = {}
    src = run.series_path.name if run.series_path else "no step rows"

    steps, loss = run.series("loss")
    if steps:
        fig, (ax,) = _figure()
        ax.plot(steps, loss, label="train loss", lw=1)
        if run.val:
            ax.plot([s for s, _ in run.val], [v for _, v in run.val], "o-", label="val loss", ms=4)
        ax.set_ylabel("loss")
        ax.set_title(f"{run.label}: loss ({src})")
        ax.legend(loc="best")
        figs["loss"] = fig
    else:
        skipped["loss"] = "no loss values"

    steps, toks = run.series("toks_per_s")
    if steps:
        fig, (ax,) = _figure()
        ax.plot(steps, toks, lw=1, label="tokens/s")
        f = summary.figures if summary else {}
        if f.get("toks_mean") is not None:
            ax.axhline(f["toks_mean"], color="C1", ls="--", lw=1,
                       label=f"mean of last {f['toks_n']}: {f['toks_mean']:,.1f} (pstdev {f['toks_pstdev']:,.1f})")
            ax.axvspan(f["window_first_step"], f["window_last_step"], color="C1", alpha=0.08)
        ax.set_ylabel("tokens/s")
        ax.set_title(f"{run.label}: throughput")
        ax.legend(loc="best")
        figs["throughput"] = fig
    else:
        skipped["throughput"] = "no toks_per_s values"

    steps, st = run.series("step_time_s")
    if steps:
        fig, (ax,) = _figure()
        ax.plot(steps, [v * 1e3 for v in st], lw=1)
        ax.set_ylabel("step time (ms)")
        ax.set_title(f"{run.label}: step time")
        figs["step_time"] = fig
    else:
        skipped["step_time"] = "no step_time_s values"

    mem = memory_series(run)
    if mem:
        fig, (ax,) = _figure()
        for rank, pts in mem.items():
            ax.plot([p[0] for p in pts], [p[1] / GIB for p in pts], lw=1, label=f"rank {rank}")
        ax.set_ylabel("bytes in use (GiB)")
        ax.set_title(f"{run.label}: memory (heartbeats)")
        ax.legend(loc="best")
        figs["memory"] = fig
    else:
        skipped["memory"] = "no heartbeat memory readings"

    if all(run.has_column(c) for c in GATE_COLUMNS + ("gate_entropy",)):
        fig, (ax, ax2) = _figure(2)
        for c in GATE_COLUMNS:
            s, v = run.series(c)
            ax.plot(s, v, lw=1, label=c[5:])
        ax.set_ylabel("gate mean")
        ax.set_title(f"{run.label}: branch gates (mean over layers)")
        ax.legend(loc="best")
        s, v = run.series("gate_entropy")
        ax2.plot(s, v, lw=1, color="C3")
        ax2.set_ylabel("gate entropy (nats)")
        figs["gates"] = fig
    else:
        skipped["gates"] = "no gate columns (aux stats off)"

    steps, far = run.series("sel_far_frac")
    if steps:
        fig, (ax,) = _figure()
        ax.plot(steps, far, lw=1)
        ax.set_ylabel("share of selected blocks")
        ax.set_title(f"{run.label}: selected blocks beyond the sliding window")
        figs["selection"] = fig
    else:
        skipped["selection"] = "no sel_far_frac column (aux stats off)"
    return figs, skipped


def comparison_figures(runs: Sequence[Run]) -> tuple[dict[str, Figure], dict[str, str]]:
    """One line per run that has the series."""
    figs: dict[str, Figure] = {}
    skipped: dict[str, str] = {}
    specs = (("loss", "loss", "loss", 1.0), ("throughput", "toks_per_s", "tokens/s", 1.0),
             ("step_time", "step_time_s", "step time (ms)", 1e3))
    for name, col, ylabel, scale in specs:
        have = [(r, r.series(col)) for r in runs if r.has_column(col)]
        if not have:
            skipped[name] = f"no run has {col}"
            continue
        fig, (ax,) = _figure()
        for r, (s, v) in have:
            ax.plot(s, [x * scale for x in v], lw=1, label=r.label)
        ax.set_ylabel(ylabel)
        ax.set_title(name.replace("_", " "))
        ax.legend(loc="best", fontsize="small")
        figs[name] = fig
    have = [(r, memory_series(r).get(0)) for r in runs]
    have = [(r, pts) for r, pts in have if pts]
    if have:
        fig, (ax,) = _figure()
        for r, pts in have:
            ax.plot([p[0] for p in pts], [p[1] / GIB for p in pts], lw=1, label=r.label)
        ax.set_ylabel("rank 0 bytes in use (GiB)")
        ax.set_title("memory")
        ax.legend(loc="best", fontsize="small")
        figs["memory"] = fig
    else:
        skipped["memory"] = "no run has heartbeat memory readings"
    return figs, skipped


def save_figures(figs: dict[str, Figure], out_dir: pathlib.Path, prefix: str = "") -> dict[str, pathlib.Path]:
    """Writes <out_dir>/<prefix><name>.png for each figure; returns name -> path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, fig in figs.items():
        path = out_dir / f"{prefix}{name}.png"
        fig.savefig(path, dpi=_DPI, bbox_inches="tight")
        paths[name] = path
    return paths
