"""PNG plots of run artifacts (matplotlib, Agg canvas; no pyplot, so no global figure state).

`run_figures(run)` draws one run: loss (and validation loss), tokens/s (with the
window mean), step time, memory per rank, gate means and entropy, and the share of
selected blocks beyond the sliding window. `comparison_figures(runs)` overlays
several runs (one line per run). Each returns (figures by name, plots not drawn with
the reason) so a report can say what is absent instead of drawing empty axes.

Every linear axis is labelled with the values themselves (`readable`): no offset
(`1e-5+1.0985`) or scale factor, and a y range of at least MIN_SPAN of the values'
size, so a series that is flat up to float noise (gate entropy at ln 3, a constant
memory reading) is drawn flat instead of as a zoom into its noise.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Callable, Sequence

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import ScalarFormatter

from nsa_jax.report.criteria import GATE_COLUMNS, GIB, Summary
from nsa_jax.report.reading import Run, memory_series

_SIZE = (8, 4)
_DPI = 100
# The least span of a linear y axis, as a share of the largest magnitude it shows.
MIN_SPAN = 0.01


def _plain(axis) -> None:
    formatter = ScalarFormatter(useOffset=False)
    formatter.set_scientific(False)
    axis.set_major_formatter(formatter)


def readable(fig: Figure) -> Figure:
    """Tick labels that read as values on every linear axis with numeric ticks, and y ranges of at
    least MIN_SPAN of their magnitude (see the module docstring)."""
    for ax in fig.axes:
        for axis, scale in ((ax.xaxis, ax.get_xscale()), (ax.yaxis, ax.get_yscale())):
            if scale == "linear" and isinstance(axis.get_major_formatter(), ScalarFormatter):
                _plain(axis)
        if ax.get_yscale() == "linear" and isinstance(ax.yaxis.get_major_formatter(), ScalarFormatter):
            lo, hi = ax.get_ylim()
            need = MIN_SPAN * max(abs(lo), abs(hi))
            if hi - lo < need:
                mid = (lo + hi) / 2
                ax.set_ylim(mid - need / 2, mid + need / 2)
    return fig


def _figure(rows: int = 1) -> tuple[Figure, list]:
    fig = Figure(figsize=(_SIZE[0], _SIZE[1] * (1 if rows == 1 else 0.75 * rows)), dpi=_DPI)
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    for ax in axes:
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("step")
    return fig, list(axes)


@dataclasses.dataclass(frozen=True)
class _Series:
    """One step-row column drawn against step, alone on its axes (one run) or one line per run."""

    name: str  # figure name: the PNG stem and the report section
    column: str  # step-row column
    ylabel: str
    title: str  # after "<run label>: "; "{src}" becomes the step-row file name
    missing: str  # why a run's figure is not drawn when the run has no values
    scale: float = 1.0  # unit of the axis, e.g. 1e3 for seconds -> ms
    label: str | None = None  # legend entry of the run's line; no legend when None
    overlay: Callable[[Axes, Run, Summary | None], None] | None = None  # more marks on the same axes


def _val_loss(ax: Axes, run: Run, summary: Summary | None) -> None:
    if run.val:
        ax.plot([s for s, _ in run.val], [v for _, v in run.val], "o-", label="val loss", ms=4)


def _throughput_window(ax: Axes, run: Run, summary: Summary | None) -> None:
    f = summary.figures if summary else {}
    if f.get("toks_per_s") is not None:
        ax.axhline(
            f["toks_per_s"],
            color="C1",
            ls="--",
            lw=1,
            label=f"last {f['toks_n']} steps: {f['toks_per_s']:,.1f} (median step {f['toks_median']:,.1f})",
        )
        ax.axvspan(f["window_first_step"], f["window_last_step"], color="C1", alpha=0.08)


_SERIES = (
    _Series(
        name="loss",
        column="loss",
        ylabel="loss",
        title="loss ({src})",
        missing="no loss values",
        label="train loss",
        overlay=_val_loss,
    ),
    _Series(
        name="throughput",
        column="toks_per_s",
        ylabel="tokens/s",
        title="throughput",
        missing="no toks_per_s values",
        label="tokens/s",
        overlay=_throughput_window,
    ),
    _Series(
        name="step_time",
        column="step_time_s",
        ylabel="step time (ms)",
        title="step time",
        missing="no step_time_s values",
        scale=1e3,
    ),
    _Series(
        name="selection",
        column="sel_far_frac",
        ylabel="share of selected blocks",
        title="selected blocks beyond the sliding window",
        missing="no sel_far_frac column (aux stats off)",
    ),
)
# The figures of one run, in the order of the report's sections.
_RUN_FIGURES = ("loss", "throughput", "step_time", "memory", "gates", "selection")
# The series that `comparison_figures` overlays across runs.
_COMPARED_SERIES = ("loss", "throughput", "step_time")


def run_figures(run: Run, summary: Summary | None = None) -> tuple[dict[str, Figure], dict[str, str]]:
    figs: dict[str, Figure] = {}
    skipped: dict[str, str] = {}
    src = run.series_path.name if run.series_path else "no step rows"

    for spec in _SERIES:
        steps, values = run.series(spec.column)
        if not steps:
            skipped[spec.name] = spec.missing
            continue
        fig, (ax,) = _figure()
        ax.plot(steps, [v * spec.scale for v in values], lw=1, label=spec.label)
        if spec.overlay is not None:
            spec.overlay(ax, run, summary)
        ax.set_ylabel(spec.ylabel)
        ax.set_title(f"{run.label}: {spec.title.format(src=src)}")
        if spec.label is not None:
            ax.legend(loc="best")
        figs[spec.name] = fig

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

    for fig in figs.values():
        readable(fig)
    return _in_report_order(figs), _in_report_order(skipped)


def _in_report_order(by_figure: dict) -> dict:
    # The series loop draws `selection` before memory and gates; the report keeps it last.
    return {name: by_figure[name] for name in _RUN_FIGURES if name in by_figure}


def comparison_figures(runs: Sequence[Run]) -> tuple[dict[str, Figure], dict[str, str]]:
    """One line per run that has the series."""
    figs: dict[str, Figure] = {}
    skipped: dict[str, str] = {}
    for spec in (s for s in _SERIES if s.name in _COMPARED_SERIES):
        have = [(r, r.series(spec.column)) for r in runs if r.has_column(spec.column)]
        if not have:
            skipped[spec.name] = f"no run has {spec.column}"
            continue
        fig, (ax,) = _figure()
        for r, (s, v) in have:
            ax.plot(s, [x * spec.scale for x in v], lw=1, label=r.label)
        ax.set_ylabel(spec.ylabel)
        ax.set_title(spec.name.replace("_", " "))
        ax.legend(loc="best", fontsize="small")
        figs[spec.name] = fig
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
    for fig in figs.values():
        readable(fig)
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


# ---------------------------------------------------------------------------
# long-context evaluation (nsa_jax/evaluation): one figure per suite


def _eval_figure() -> tuple[Figure, Axes]:
    fig = Figure(figsize=_SIZE, dpi=_DPI)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    return fig, ax


def needle_figure(result: dict, title: str = "needle retrieval") -> Figure:
    """Heatmap: one row per length L, one column per depth, greedy exact-match accuracy as colour."""
    acc = np.asarray(result["accuracy"], float)
    fig, ax = _eval_figure()
    im = ax.imshow(acc, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto", origin="lower")
    ax.set_xticks(range(len(result["depths"])), [f"{100 * d:.0f}" for d in result["depths"]])
    ax.set_yticks(range(len(result["lengths"])), [str(L) for L in result["lengths"]])
    ax.set_xlabel("needle depth (% of the haystack)")
    ax.set_ylabel("context length L (tokens)")
    for (i, j), v in np.ndenumerate(acc):
        ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7)
    ax.set_title(f"{title}: accuracy over {result['samples']} needles per cell")
    fig.colorbar(im, ax=ax, label="exact match")
    return fig


def _by_length_figure(by_length: dict, key: str, ylabel: str, title: str) -> Figure:
    fig, ax = _eval_figure()
    for L, r in by_length.items():
        edges = r["edges"]
        if edges and isinstance(edges[0], list):  # [[lo, hi], ...]
            spans = edges
        else:
            spans = list(zip(edges[:-1], edges[1:]))
        pts = [(max(lo, 1) * (hi / max(lo, 1)) ** 0.5, v) for (lo, hi), v in zip(spans, r[key]) if v is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", ms=3, label=f"L={L}")
    ax.set_xscale("log", base=2)
    ax.grid(True, alpha=0.3)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(loc="best", fontsize="small")
    return readable(fig)


def loss_by_position_figure(result: dict) -> Figure:
    fig = _by_length_figure(result["by_length"], "loss", "mean loss (nats)", "loss by position")
    fig.axes[0].set_xlabel("target position (log-spaced buckets)")
    return fig


def kv_recall_figure(result: dict) -> Figure:
    fig = _by_length_figure(result["by_length"], "accuracy", "accuracy", "kv_recall by distance")
    fig.axes[0].set_xlabel("distance from the pair to its query (tokens)")
    return fig


def passkey_figure(result: dict) -> Figure:
    """needle_figure of the passkey suite (the same grid: L x depth)."""
    return needle_figure(result, "passkey retrieval")


_EVAL_FIGURES = {
    "needle": needle_figure,
    "loss-by-position": loss_by_position_figure,
    "kv_recall": kv_recall_figure,
    "passkey": passkey_figure,
}


def evaluation_figures(results: dict) -> dict[str, Figure]:
    """One figure per suite in `results` (named as the suite, '-' as '_')."""
    return {s.replace("-", "_"): _EVAL_FIGURES[s](r) for s, r in results.items() if s in _EVAL_FIGURES}
