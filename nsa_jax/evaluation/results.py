"""launch.evaluate's evaluation.json: written whole after every (suite, L) cell, read back to skip what is done.

The file holds the suites' results in the shape `suites.assemble` gives them (what the plots and
launch.stages read) and `meta`:
  - `settings`: what makes two cells comparable (`make_settings`): a digest of the weights (another
    checkpoint, or another step of the same run, differs), the config, the depths and samples of needle
    and passkey, the rows, the seed and the text (the files' digests, or the run's validation split; the
    `text` suite's text too);
  - `pending`: the [suite, L] cells the latest command asked for and has not finished ([] once it did:
    launch.stages reads this, `unfinished`);
  - `seconds` {suite: {L: seconds}}, `compiled_bytes` {L: bytes per device}, `ckpt` (the path given).

Every write is whole (`write_whole`: a temporary file in the same folder, flushed to the disk, renamed
over evaluation.json), so a stop, a crash or a full disk at any moment leaves the previous file or the
new one, never a mix and never less than was there. A file made with other settings is refused
(`Mismatch`: one line naming the first differences and the fix) rather than recomputed (that would
overwrite results someone kept) or mixed (incomparable cells side by side in one table).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import threading
from typing import Any, Iterable, Sequence

import numpy as np

from nsa_jax.evaluation.suites import GRID_SUITES, SUITES, Settings, assemble

RESULTS_FILE = "evaluation.json"

Cell = tuple[str, int]


class Mismatch(ValueError):
    """The out folder holds results that cannot be continued with these settings; one line naming the fix."""


def weights_digest(params: Any) -> str:
    """A digest of every array of `params` (path, dtype, shape and bytes): equal exactly when the weights are."""
    import jax  # noqa: PLC0415 - only for the tree walk

    h = hashlib.blake2b(digest_size=16)
    for path, leaf in sorted(jax.tree_util.tree_leaves_with_path(params), key=lambda kv: jax.tree_util.keystr(kv[0])):
        x = np.ascontiguousarray(np.asarray(leaf))
        h.update(f"{jax.tree_util.keystr(path)}|{x.dtype}|{x.shape}|".encode())
        h.update(x.tobytes())
    return h.hexdigest()


def file_digest(path: str | os.PathLike) -> str:
    return hashlib.blake2b(pathlib.Path(path).read_bytes(), digest_size=16).hexdigest()


def make_settings(
    config: dict, weights: str, depths: Sequence[float], samples: int, rows: int, seed: int, text: Sequence[str]
) -> dict:
    """The comparability key of an evaluation (module docstring), as JSON reads it back."""
    settings = {
        "weights": weights,
        "depths": list(depths),
        "samples": samples,
        "rows": rows,
        "seed": seed,
        "text": [{"file": os.path.basename(f), "digest": file_digest(f)} for f in text] or "validation split",
        "config": config,
    }
    return json.loads(json.dumps(settings))


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else k))
    return out


def differences(there: dict, here: dict, most: int = 3) -> list[str]:
    """The first `most` settings that differ, as 'samples 2 there, 4 here' (weights and text by name only)."""
    out = []
    a, b = _flat(there), _flat(here)
    for key in [*b, *(k for k in a if k not in b)]:
        if a.get(key) == b.get(key):
            continue
        if key == "weights":
            out.append("the weights (another checkpoint, or another step of it)")
        elif key.startswith("text"):
            if "the text" not in out:
                out.append("the text")
        else:
            out.append(f"{key.removeprefix('config.')} {a.get(key, '(none)')} there, {b.get(key, '(none)')} here")
    return out[:most]


def write_whole(path: pathlib.Path, text: str) -> None:
    """Writes `text` to `path` so that `path` holds the old text or the new, whole, at every moment."""
    tmp = path.with_name(f".{path.name}.partial")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_cells(doc: dict) -> dict[Cell, dict]:
    """The (suite, L) cells of an evaluation.json document."""
    cells: dict[Cell, dict] = {}
    for suite in GRID_SUITES:
        grid = doc.get(suite)
        if grid:
            rows = grid.get("rows", {})
            for L, acc, lp in zip(grid["lengths"], grid["accuracy"], grid["logprob"]):
                cells[suite, int(L)] = {"accuracy": acc, "logprob": lp}
                if str(L) in rows:
                    cells[suite, int(L)]["rows"] = rows[str(L)]
    for suite in SUITES:
        if suite not in GRID_SUITES and suite in doc:
            for L, r in doc[suite]["by_length"].items():
                cells[suite, int(L)] = r
    return cells


# What must match for two evaluations' rows to be the same prompts (the weights and config may differ).
_PROMPT_SETTINGS = ("depths", "samples", "seed", "text")


def read_document(where: str | os.PathLike) -> dict:
    """The evaluation.json of an out folder (or the file itself); Mismatch (one line) when there is none."""
    path = pathlib.Path(where)
    path = path / RESULTS_FILE if path.is_dir() else path
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise Mismatch(f"{where}: no readable {RESULTS_FILE} ({e}); name the --out folder of an evaluation") from None


_COUNTS = ("rows", "base", "other", "both", "other_only", "other_lower", "logp_gap")


def agreement(base: dict, other: dict) -> list[dict]:
    """Prompt by prompt, two evaluations' answers on the rows both kept: for each (suite, L) grid cell both hold,
    {'suite', 'L', 'rows', 'base', 'other', 'both', 'other_only', 'other_lower', 'logp_gap'} (rows right by each;
    right by both; right by `other` alone; rows where `other` gives the key a lower log-probability; the sum over
    rows of other's log p minus base's) and the same per depth under 'by_depth'. Mismatch when the rows are not
    the same prompts (other depths, samples, seed or text) or no pair of cells kept its rows.
    """
    a, b = (doc.get("meta", {}).get("settings", {}) for doc in (base, other))
    diff = differences({k: a.get(k) for k in _PROMPT_SETTINGS}, {k: b.get(k) for k in _PROMPT_SETTINGS})
    if diff:
        raise Mismatch(
            f"the two evaluations asked different prompts ({'; '.join(diff)}); compare runs of the same "
            "--depths, --samples, --seed and --text"
        )
    cells_a, cells_b = read_cells(base), read_cells(other)
    out = []
    both_kept = [c for c in set(cells_a) & set(cells_b) if "rows" in cells_a[c] and "rows" in cells_b[c]]
    for suite, L in sorted(both_kept, key=lambda c: (GRID_SUITES.index(c[0]), c[1])):  # only grid cells keep rows
        ra = {(r["depth"], r["sample"]): r for r in cells_a[suite, L]["rows"]}
        rb = {(r["depth"], r["sample"]): r for r in cells_b[suite, L]["rows"]}
        by_depth: dict[float, dict] = {}
        for k in sorted(ra.keys() & rb.keys()):
            x, y = ra[k], rb[k]
            d = by_depth.setdefault(k[0], dict.fromkeys(_COUNTS, 0))
            d["rows"] += 1
            d["base"] += x["right"]
            d["other"] += y["right"]
            d["both"] += x["right"] and y["right"]
            d["other_only"] += y["right"] and not x["right"]
            d["other_lower"] += y["logprob"] < x["logprob"]
            d["logp_gap"] += y["logprob"] - x["logprob"]
        total = {f: sum(d[f] for d in by_depth.values()) for f in _COUNTS}
        out.append({"suite": suite, "L": L, **total, "by_depth": by_depth})
    if not out:
        raise Mismatch(
            "the two evaluations share no needle or passkey cell with each row's answer kept; run the same suites "
            "and lengths with both models (evaluations made before rows were kept hold only means)"
        )
    return out


def unfinished(path: str | os.PathLike) -> list[Cell]:
    """The cells the latest command that wrote `path` asked for and did not finish ([] for a file without `pending`)."""
    doc = json.loads(pathlib.Path(path).read_text())
    return [(s, int(L)) for s, L in doc.get("meta", {}).get("pending", [])]


def describe(cells: Iterable[Cell]) -> str:
    """'needle, kv_recall at L=256, 1,024; needle at L=100,000': lengths ascending, grouped by their suites."""
    by_length: dict[int, set[str]] = {}
    for s, L in cells:
        by_length.setdefault(L, set()).add(s)
    groups: dict[tuple[str, ...], list[int]] = {}
    for L, ss in sorted(by_length.items()):
        groups.setdefault(tuple(s for s in SUITES if s in ss), []).append(L)
    parts = [f"{', '.join(ss)} at L={', '.join(f'{L:,}' for L in Ls)}" for ss, Ls in groups.items()]
    return "; ".join(parts) if parts else "nothing"


class Results:
    """The cells of one out folder: those read back from its evaluation.json and those added since.

    `add` writes the whole file after every cell, holding `lock`; a stop that must name
    what the file holds takes the lock too, so it never reports a cell half-written.
    """

    def __init__(self, out: pathlib.Path | None, settings: dict, suite_settings: Settings, meta: dict):
        self.path = None if out is None else pathlib.Path(out) / RESULTS_FILE
        self.settings, self.suite_settings = settings, suite_settings
        self.meta = {**meta, "settings": settings, "seconds": {}, "compiled_bytes": {}, "pending": []}
        self.cells: dict[Cell, dict] = {}
        self.kept: list[Cell] = []  # the cells on disk, in the order they were written
        self.lock = threading.Lock()

    def read(self) -> list[Cell]:
        """Reads the existing file (Mismatch when it cannot be continued); the cells it holds."""
        if self.path is None or not self.path.exists():
            return []
        out = self.path.parent
        try:
            doc = json.loads(self.path.read_text())
            there = doc.get("meta", {}).get("settings")
        except (OSError, ValueError, AttributeError) as e:
            raise Mismatch(f"--out {out} holds a {RESULTS_FILE} that does not read ({e}); pass another --out") from None
        if there is None:
            raise Mismatch(
                f"--out {out} holds a {RESULTS_FILE} that records no settings (an older evaluation), so it cannot be "
                "continued; pass another --out"
            )
        diff = differences(there, self.settings)
        if diff:
            raise Mismatch(
                f"--out {out} holds the {RESULTS_FILE} of another evaluation ({'; '.join(diff)}); run it with the "
                "settings it was made with to continue it, or pass another --out"
            )
        self.cells = read_cells(doc)
        old = doc["meta"]
        for key in ("seconds", "compiled_bytes"):
            self.meta[key] = old.get(key, {})
        self.kept = list(self.cells)
        return list(self.cells)

    def done(self, suite: str, L: int) -> bool:
        return (suite, L) in self.cells

    def begin(self, pending: Sequence[Cell]) -> None:
        """A command starts on `pending`: an existing file records them (launch.stages reads it as unfinished)."""
        with self.lock:
            self.meta["pending"] = [[s, n] for s, n in pending]
            if self.path is not None and self.path.exists():
                write_whole(self.path, json.dumps(self.document(), indent=1))

    def add(self, suite: str, L: int, result: dict, seconds: float, pending: Sequence[Cell]) -> None:
        """Keeps one finished cell: in memory, and (with an out folder) in the file, written whole."""
        with self.lock:
            self.cells[suite, L] = result
            self.meta["seconds"].setdefault(suite, {})[str(L)] = seconds
            self.meta["pending"] = [[s, n] for s, n in pending]
            if self.path is not None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                write_whole(self.path, json.dumps(self.document(), indent=1))
                self.kept.append((suite, L))

    def document(self) -> dict:
        return {"meta": self.meta, **assemble(self.cells, self.suite_settings)}
