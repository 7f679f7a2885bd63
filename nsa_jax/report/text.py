"""Writing the report: one run's judgement as text and markdown, and several runs as a ranked table.

`format_summary` and `warning_lines` are what `launch.report` prints (the warnings on
stderr); `markdown_summary` and `markdown_table` are its report.md pages (the plots:
plots.py). The judgements come from criteria.py.
"""

from __future__ import annotations

from nsa_jax.report.criteria import Entry, Summary
from nsa_jax.report.reading import Run
from nsa_jax.words import count


def long_eval_line(run: Run) -> str | None:
    """'long eval (step 400): needle_acc_L1024 0.910, ...' from long_eval.csv's last row."""
    if not run.long_eval:
        return None
    figures = {k: v for k, v in run.long_eval.items() if k not in ("step", "long_eval_s")}
    return f"long eval (step {int(run.long_eval['step'])}): " + ", ".join(f"{k} {v:.3f}" for k, v in figures.items())


def format_summary(s: Summary) -> str:
    run = s.run
    out = [f"run: {run.path} ({s.state})", f"window: {s.window}"]
    if run.missing:
        out.append("missing: " + "; ".join(run.missing))
    width = max(len(c.name) for c in s.criteria)
    for c in s.criteria:
        out.append(f"  {c.status:<6} {c.name:<{width}}  {c.detail}")
    if long_eval_line(run):
        out.append(long_eval_line(run))
    fail = s.failing()
    out.append(f"verdict: {s.verdict}" + (f" ({', '.join(fail)})" if fail else ""))
    return "\n".join(out)


def warning_lines(s: Summary) -> list[str]:
    """The run's problems and notes as lines for stderr ('warning: RUN: ...', 'note: RUN: ...')."""
    return [f"warning: {s.run.path}: {p}" for p in s.problems] + [f"note: {s.run.path}: {n}" for n in s.notes]


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_summary(s: Summary, images: dict[str, str], skipped: dict[str, str], level: int = 1) -> str:
    """A report page; `images` maps plot name -> relative PNG path, `skipped` plot name -> why not drawn."""
    h = "#" * level
    run = s.run
    lines = [
        f"{h} Run report: {run.label}",
        "",
        f"- directory: `{run.path}`",
        f"- state: {s.state}",
        f"- window: {s.window}",
        f"- verdict: **{s.verdict}**",
    ]
    if run.missing:
        lines.append("- missing: " + "; ".join(f"`{m}`" for m in run.missing))
    lines += [f"- problem: {_md_escape(p)}" for p in s.problems]
    lines += [f"- note: {_md_escape(n)}" for n in s.notes]
    if long_eval_line(run):
        lines.append(f"- {long_eval_line(run)}")
    lines += ["", "| criterion | verdict | detail |", "|---|---|---|"]
    lines += [f"| {c.name} | {c.status} | {_md_escape(c.detail)} |" for c in s.criteria]
    lines.append("")
    for name, rel in images.items():
        lines += [f"{h}# {name.replace('_', ' ')}", "", f"![{name}]({rel})", ""]
    if skipped:
        lines.append("Plots not drawn: " + "; ".join(f"{k} ({v})" for k, v in skipped.items()))
        lines.append("")
    return "\n".join(lines)


_TABLE_HEAD = ("rank", "run", "status", "tok/s", "pstdev", "n", "step-time CV", "last loss", "verdict")


def table_rows(ranked: list[tuple[int | None, Entry]]) -> list[tuple[str, ...]]:
    out = []
    for rank, e in ranked:
        f = e.summary.figures if e.summary else {}

        def num(key: str, spec: str) -> str:
            v = f.get(key)
            return "-" if v is None else format(v, spec)

        out.append(
            (
                str(rank) if rank else "-",
                e.label,
                e.status,
                num("toks_per_s", ",.1f"),
                num("toks_pstdev", ",.1f"),
                str(f.get("toks_n", "-")),
                num("step_time_cv", ".3f"),
                num("loss_last", ".4f"),
                e.summary.verdict if e.summary else "-",
            )
        )
    return out


def format_table(ranked: list[tuple[int | None, Entry]], last: int, tie_pct: float) -> str:
    rows = [_TABLE_HEAD] + table_rows(ranked)
    widths = [max(len(r[i]) for r in rows) for i in range(len(_TABLE_HEAD))]
    right = {0, 3, 4, 5, 6, 7}
    lines = [
        "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
        for r in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(_ranking_note(ranked, last, tie_pct))
    lines += [f"{e.label}: {e.error}" for _, e in ranked if e.error]
    return "\n".join(lines)


def _ranking_note(ranked: list[tuple[int | None, Entry]], last: int, tie_pct: float) -> str:
    best = next((e.label for r, e in ranked if r == 1), None)
    rule = (
        f"ranked by tok/s (total tokens / total step time) over the last {count(last, 'step')}; "
        f"within {tie_pct:g}% go to the lower pstdev"
    )
    return f"best: {best} ({rule})" if best else f"no run to rank ({rule})"


def markdown_table(ranked: list[tuple[int | None, Entry]], last: int, tie_pct: float) -> str:
    lines = ["| " + " | ".join(_TABLE_HEAD) + " |", "|" + "---|" * len(_TABLE_HEAD)]
    lines += ["| " + " | ".join(_md_escape(c) for c in r) + " |" for r in table_rows(ranked)]
    lines += ["", _ranking_note(ranked, last, tie_pct)]
    lines += [f"- `{e.label}`: {_md_escape(e.error)}" for _, e in ranked if e.error]
    return "\n".join(lines)
