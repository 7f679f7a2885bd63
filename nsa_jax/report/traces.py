"""One process's profiler trace, summarised per device: time per category, the share of collective time that
compute overlaps, the top kernels, and a self-contained HTML page with a timeline.

A device's window runs from its first op to its last. Inside it every moment is one of: compute (some
non-collective, non-copy op runs), an exposed collective (a collective runs, no compute), an exposed
memory copy (a copy runs, neither of the others), idle (nothing). The four add up to the window, so a
page shows at a glance how much of a step the reduction costs and whether the overlap worked
(`parallel.overlap_reduce`): `collective overlapped` = |collective AND compute| / |collective|.

The device's ops: on a GPU or TPU the events of its device tracks ('/device:GPU:0' processes); on the
CPU the XLA thunk events, which carry `device_ordinal` and `hlo_op`. A kernel is a collective when its
name reads as one (NCCL's, or an HLO all-reduce / all-gather / reduce-scatter / collective-permute /
all-to-all, jax's psum), a memory copy when it is a memcpy/memset or an async copy.
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import gzip
import html
import json
import pathlib
import re

COLLECTIVE = re.compile(
    r"nccl|all[-_]?reduce|all[-_]?gather|reduce[-_]?scatter|collective[-_]?permute|all[-_]?to[-_]?all|psum|ppermute",
    re.I,
)
MEMCPY = re.compile(r"memcpy|memset|copy-start|copy-done", re.I)
# Thunks that only hold others (the CPU trace times a while loop and its body's ops both): left out.
CONTAINER = re.compile(r"(while|conditional|call|command_buffer)(\.\d+)?")
CATEGORIES = ("compute", "collective (exposed)", "memory copy (exposed)", "idle")
COLORS = {"compute": "#3b78c2", "collective": "#e8871e", "memory copy": "#4aa564"}


def category_of(name: str) -> str:
    """'collective', 'memory copy' or 'compute', from a kernel's or an HLO op's name."""
    if COLLECTIVE.search(name):
        return "collective"
    if MEMCPY.search(name):
        return "memory copy"
    return "compute"


def read_trace(path: pathlib.Path) -> list[dict]:
    """The events of one Chrome/Perfetto trace file (.json.gz or .json)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def find_trace(folder: pathlib.Path) -> pathlib.Path | None:
    """The newest trace file under `folder` (jax.profiler writes plugins/profile/<time>/...), or None."""
    files = sorted(folder.rglob("perfetto_trace.json.gz")) or sorted(folder.rglob("*.trace.json.gz"))
    return files[-1] if files else None


@dataclasses.dataclass
class Op:
    device: str
    name: str
    start_us: float
    end_us: float


def device_tracks(events: list[dict]) -> dict:
    """{pid: 'GPU:0'} of the accelerator tracks ('/device:GPU:0 ...'); empty on a CPU-only trace."""
    tracks = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            m = re.search(r"/device:(GPU|TPU):(\d+)", str((e.get("args") or {}).get("name", "")))
            if m:
                tracks[e.get("pid")] = f"{m.group(1)}:{m.group(2)}"
    return tracks


def device_ops(events: list[dict]) -> list[Op]:
    """Every op the devices ran, as (device, name, start, end) in microseconds."""
    tracks = device_tracks(events)
    ops = []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        args = e.get("args") or {}
        if tracks:
            if e.get("pid") not in tracks:
                continue
            device, name = tracks[e["pid"]], str(e.get("name", ""))
        elif "device_ordinal" in args and "hlo_op" in args:
            device, name = f"CPU:{args['device_ordinal']}", str(args["hlo_op"])
        else:
            continue
        if CONTAINER.fullmatch(name):
            continue
        start = float(e["ts"])
        ops.append(Op(device, name, start, start + float(e["dur"])))
    return ops


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(merged: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in merged)


def _intersect(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def summarise_device(ops: list[Op]) -> dict:
    """One device's window and its time per category (ms), the overlapped share of its collectives."""
    spans = {c: _merge([(o.start_us, o.end_us) for o in ops if category_of(o.name) == c]) for c in COLORS}
    start, end = min(o.start_us for o in ops), max(o.end_us for o in ops)
    comp, coll, mem = spans["compute"], spans["collective"], spans["memory copy"]
    comp_or_coll = _merge(comp + coll)
    busy = _length(_merge(comp_or_coll + mem))
    coll_len = _length(coll)
    coll_hidden = _length(_intersect(coll, comp))
    ms = {
        "compute": _length(comp) / 1e3,
        "collective (exposed)": (coll_len - coll_hidden) / 1e3,
        "memory copy (exposed)": (_length(mem) - _length(_intersect(mem, comp_or_coll))) / 1e3,
        "idle": (end - start - busy) / 1e3,
    }
    return {
        "wall_ms": (end - start) / 1e3,
        "ms": ms,
        "collective_ms": coll_len / 1e3,
        "collective_overlapped": coll_hidden / coll_len if coll_len else None,
        "start_us": start,
        "end_us": end,
        "spans": spans,
    }


def summarise(events: list[dict], top: int = 15) -> dict:
    """Per device (summarise_device) and the top kernels by total time over every device of the trace."""
    ops = device_ops(events)
    if not ops:
        raise ValueError("the trace holds no device ops (no /device:GPU|TPU tracks and no CPU thunk events)")
    by_device = collections.defaultdict(list)
    for o in ops:
        by_device[o.device].append(o)
    kernels = collections.defaultdict(lambda: [0.0, 0])
    for o in ops:
        kernels[o.name][0] += (o.end_us - o.start_us) / 1e3
        kernels[o.name][1] += 1
    total = sum(ms for ms, _ in kernels.values())
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "devices": {d: summarise_device(v) for d, v in sorted(by_device.items())},
        "kernels": [
            {"name": n, "ms": ms, "calls": calls, "share": ms / total if total else 0.0, "category": category_of(n)}
            for n, (ms, calls) in ranked
        ],
    }


def write_csv(summary: dict, rank: int, path: pathlib.Path) -> None:
    """summary.csv: section (category | overlap | kernel), rank, device, name, ms, share, calls."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["section", "rank", "device", "name", "ms", "share", "calls"])
        for device, d in summary["devices"].items():
            for name, ms in d["ms"].items():
                w.writerow(["category", rank, device, name, f"{ms:.4f}", f"{ms / d['wall_ms']:.4f}", ""])
            w.writerow(["category", rank, device, "wall", f"{d['wall_ms']:.4f}", "1.0000", ""])
            share = d["collective_overlapped"]
            w.writerow(
                ["overlap", rank, device, "collective overlapped", f"{d['collective_ms']:.4f}", "" if share is None
                 else f"{share:.4f}", ""]
            )  # fmt: skip
        for k in summary["kernels"]:
            w.writerow(["kernel", rank, "all", k["name"], f"{k['ms']:.4f}", f"{k['share']:.4f}", k["calls"]])


def _timeline_svg(summary: dict, width: int = 960, row_h: int = 22) -> str:
    """Each device a row, its ops' spans coloured by category over the trace's common window."""
    devices = summary["devices"]
    t0 = min(d["start_us"] for d in devices.values())
    t1 = max(d["end_us"] for d in devices.values())
    scale = (width - 90) / max(t1 - t0, 1e-9)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{row_h * len(devices) + 24}">']
    for row, (device, d) in enumerate(devices.items()):
        y = row * row_h + 2
        parts.append(f'<text x="0" y="{y + 14}" font-size="12">{html.escape(device)}</text>')
        parts.append(f'<rect x="90" y="{y}" width="{width - 90}" height="{row_h - 6}" fill="#eee"/>')
        for cat in ("compute", "memory copy", "collective"):  # collectives last: drawn over the compute they overlap
            merged, last = [], None
            for a, b in d["spans"][cat]:  # spans under half a pixel apart drawn as one
                x0, x1 = 90 + (a - t0) * scale, 90 + (b - t0) * scale
                if last is not None and x0 - last[1] < 0.5:
                    last[1] = x1
                else:
                    last = [x0, x1]
                    merged.append(last)
            for x0, x1 in merged:
                parts.append(
                    f'<rect x="{x0:.1f}" y="{y}" width="{max(x1 - x0, 0.5):.1f}" height="{row_h - 6}" '
                    f'fill="{COLORS[cat]}" fill-opacity="{0.75 if cat == "collective" else 1}"/>'
                )
    span_ms = (t1 - t0) / 1e3
    parts.append(f'<text x="90" y="{row_h * len(devices) + 18}" font-size="11">0 ms</text>')
    parts.append(f'<text x="{width - 60}" y="{row_h * len(devices) + 18}" font-size="11">{span_ms:.1f} ms</text></svg>')
    return "".join(parts)


def write_html(summary: dict, rank: int, path: pathlib.Path, source: str) -> None:
    """summary.html: self-contained (inline CSS and SVG, no script): categories, overlap, timeline, kernels."""
    esc = html.escape
    rows = []
    for device, d in summary["devices"].items():
        cells = "".join(f"<td>{ms:.3f}</td><td>{100 * ms / d['wall_ms']:.1f}%</td>" for ms in d["ms"].values())
        share = d["collective_overlapped"]
        overlap = "no collectives" if share is None else f"{100 * share:.1f}% of {d['collective_ms']:.3f} ms"
        rows.append(f"<tr><td>{esc(device)}</td><td>{d['wall_ms']:.3f}</td>{cells}<td>{overlap}</td></tr>")
    head = "".join(f"<th>{esc(c)} ms</th><th>share</th>" for c in CATEGORIES)
    kernels = "".join(
        f"<tr><td>{esc(k['name'][:120])}</td><td>{esc(k['category'])}</td><td>{k['ms']:.3f}</td>"
        f"<td>{100 * k['share']:.1f}%</td><td>{k['calls']}</td></tr>"
        for k in summary["kernels"]
    )
    legend = " ".join(f'<span style="color:{c}">&#9632;</span> {esc(n)}' for n, c in COLORS.items())
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>trace summary, rank {rank}</title>
<style>body{{font-family:sans-serif;margin:24px}} table{{border-collapse:collapse;margin:8px 0 20px}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}} td:first-child{{text-align:left}}</style></head>
<body><h1>Trace summary: rank {rank}</h1><p>{esc(source)}</p>
<h2>Time per category, per device</h2>
<table><tr><th>device</th><th>window ms</th>{head}<th>collective overlapped by compute</th></tr>{"".join(rows)}</table>
<h2>Timeline</h2><p>{legend}</p>{_timeline_svg(summary)}
<h2>Top kernels (all devices)</h2>
<table><tr><th>kernel / op</th><th>category</th><th>ms</th><th>share</th><th>calls</th></tr>{kernels}</table>
</body></html>
"""
    path.write_text(page)
