"""The run directory's schema: file names, CSV columns, heartbeat events, exit codes.

One module, no jax, so the trainer (nsa_jax/train), the report (nsa_jax/report), the external watchdog
(launch/watchdog.py), the health code (nsa_jax/ops/health.py) and the launcher agree on what a run
writes without importing each other (docs/RUNBOOK.md, "Artifacts"):
  <out_dir>/training.csv             one row per optimizer step: TRAIN_COLUMNS (+ AUX_COLUMNS)
  <out_dir>/val.csv                  one row per evaluation: VAL_COLUMNS
  <out_dir>/long_eval.csv            with eval.suites: one row per evaluation, long_eval_columns
  <out_dir>/heartbeat_rank<r>.jsonl  one JSON object per line: HEARTBEAT_FIELDS + `event` (EVENTS)
  <out_dir>/env.json                 versions, devices, config, compile statistics
  <out_dir>/tb/                      TensorBoard event files
  <out_dir>/.HALT, .anomaly_type     a stop request and its kind (trainer, watchdog, operator)
  <out_dir>/stackdump_<ts>_rank<r>.txt  every thread's stack (SIGUSR1, stall watchdog)
  <out_dir>/checkpoints/<step>/      orbax checkpoints (nsa_jax/rundir/checkpoint.py)
  <out_dir>/checkpoints_corrupt/     checkpoints that did not read back, moved aside
  <out_dir>/previous/<utc-time>/     an earlier attempt that saved no checkpoint, moved aside
CSV files are written with `CsvWriter` (the `csv` module: quoting, one header row) and read with
`read_csv` / `CsvRows`, which skip what they cannot parse (a line cut short by a kill, a repeated step,
a non-numeric cell) and say so, instead of raising.
"""

from __future__ import annotations

import csv
import io
import math
import os
import pathlib
from typing import Any, Iterable, TextIO

from nsa_jax.config import BRANCHES

TRAINING_CSV = "training.csv"
VAL_CSV = "val.csv"
LONG_EVAL_CSV = "long_eval.csv"
ENV_JSON = "env.json"
TB_DIR = "tb"
HALT_FILE = ".HALT"
ANOMALY_FILE = ".anomaly_type"
HEARTBEAT_GLOB = "heartbeat_rank*.jsonl"
STACKDUMP_GLOB = "stackdump_*.txt"
CHECKPOINT_DIR = "checkpoints"
# A model folder (rundir/model_dir.py): a model's config and parameters without a run around them.
MODEL_CONFIG_FILE = "config.yaml"
MODEL_PARAMS_FILE = "params.safetensors"
MODEL_PARAMS_FILES = (MODEL_PARAMS_FILE, "params.msgpack")  # the one written; an earlier version's, still read


def folder_tokenizer(folder: str | os.PathLike, name: str) -> str:
    """The tokenizer of model folder `folder` whose config.yaml names `name`, as a path to read: a
    relative name is the folder's own file (launch.convert writes `tokenizer.json`), an absolute one
    itself, or, when that file is gone (the folder was moved or copied elsewhere), the copy beside
    config.yaml; a built-in tokenizer (byte, gpt2, tiktoken:...) stays as it is."""
    if name == "byte" or name.startswith(("gpt2", "tiktoken:")):
        return name
    path = pathlib.Path(name)
    if not path.is_absolute() and (pathlib.Path(folder) / path).is_file():
        return str((pathlib.Path(folder) / path).absolute())
    if path.is_file():
        return name
    own = pathlib.Path(folder) / path.name
    return str(own.absolute()) if own.is_file() else name


CORRUPT_DIR = "checkpoints_corrupt"
PREVIOUS_DIR = "previous"
# Files of a run, besides the globbed heartbeats and stack dumps and the tb/ folder.
RUN_FILES = (TRAINING_CSV, VAL_CSV, LONG_EVAL_CSV, ENV_JSON, HALT_FILE, ANOMALY_FILE)


def heartbeat_name(rank: int) -> str:
    return f"heartbeat_rank{rank}.jsonl"


def heartbeat_rank(name: str) -> int | None:
    """The rank of a heartbeat file name, None for any other name."""
    stem = "heartbeat_rank"
    if not (name.startswith(stem) and name.endswith(".jsonl")):
        return None
    digits = name[len(stem) : -len(".jsonl")]
    return int(digits) if digits.isdigit() else None


def write_halt(out_dir: str | os.PathLike, kind: str, msg: str) -> None:
    """`.anomaly_type` (the kind, one word) then `.HALT` (one line saying why): the trainer and
    launch.watchdog stop a run this way."""
    out = pathlib.Path(out_dir)
    (out / ANOMALY_FILE).write_text(kind + "\n")
    (out / HALT_FILE).write_text(msg.rstrip("\n") + "\n")


def run_files(out_dir: str | os.PathLike) -> list[pathlib.Path]:
    """The files and folders of an earlier run in `out_dir` (checkpoints not included)."""
    out = pathlib.Path(out_dir)
    found = [out / n for n in RUN_FILES if (out / n).exists()]
    found += sorted(out.glob(HEARTBEAT_GLOB)) + sorted(out.glob(STACKDUMP_GLOB))
    if (out / TB_DIR).is_dir():
        found.append(out / TB_DIR)
    return found


# ---------------------------------------------------------------------------
# training.csv and val.csv

# step, loss, lr, toks_per_s first: the runbooks' scripts read column 3 as tokens/s.
# step_time_s and toks_per_s are the optimizer step's own time: evaluation and the
# blocking part of a checkpoint save are not in it (eval_s: the evaluation after this
# step, blocking; save times are in the `checkpoint_start` heartbeat event).
TRAIN_COLUMNS = (
    "step",
    "loss",
    "lr",
    "toks_per_s",
    "grad_norm",
    "step_time_s",
    "tokens",
    "elapsed_s",
    "skipped",
    "val_loss",
    "eval_s",
)
# Layer means of the NSA statistics (logging.aux_stats); per-layer values go to TensorBoard.
GATE_COLUMNS = tuple(f"gate_{b}" for b in BRANCHES)
# cmp_*_ratio: RMS of the compressed keys (values) over the selection branch's, largest layer.
# Above CMP_SCALE_WARN the loop warns once (event branch_scale): on kv_recall the MLP compressor's
# output grew to 30-180x and stopped the lookup (docs/EXPERIMENTS.md, fourth round).
CMP_SCALE_WARN = 10.0
SCALE_COLUMNS = ("cmp_k_ratio", "cmp_v_ratio")
AUX_COLUMNS = (*GATE_COLUMNS, "gate_entropy", "sel_far_frac", *SCALE_COLUMNS)
VAL_COLUMNS = ("step", "tokens", "val_loss", "val_ppl", "retrieval_acc", "answers", "elapsed_s", "eval_s")
# long_eval.csv: per suite its figures (nsa_jax/evaluation/suites.scalars), one column per length L:
# needle accuracy (mean over depths) and answer log-probability, the mean loss and the loss of the
# last position bucket (the farthest context), kv_recall accuracy.
LONG_EVAL_METRICS = {
    "needle": ("needle_acc", "needle_logp"),
    "loss-by-position": ("loss", "loss_far"),
    "kv_recall": ("kv_acc",),
}


def long_eval_column(metric: str, length: int) -> str:
    return f"{metric}_L{length}"


def long_eval_columns(suites, lengths) -> tuple[str, ...]:
    """long_eval.csv's header for these suites and lengths."""
    cols = [long_eval_column(m, L) for s in suites for m in LONG_EVAL_METRICS[s] for L in lengths]
    return ("step", "tokens", *cols, "long_eval_s")


# The torch trainer's header-less training.csv.
LEGACY_COLUMNS = ("step", "loss", "lr", "toks_per_s")
# A header-less file of ours is read in this order.
DOCUMENTED_COLUMNS = (*TRAIN_COLUMNS, *AUX_COLUMNS)


def training_columns(aux_stats: bool) -> tuple[str, ...]:
    return TRAIN_COLUMNS + (AUX_COLUMNS if aux_stats else ())


def format_cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


class CsvWriter:
    """A header row, then one row per `write`, flushed line by line (watchdogs tail the file).

    `keep`: rows of an earlier file to start with (a resume), written with the header to
    a temporary file that replaces `path` atomically, so a kill at any moment leaves
    either the old file or the kept rows.
    """

    def __init__(self, path: str | os.PathLike, columns: Iterable[str], keep: Iterable[dict[str, Any]] = ()):
        self.path, self.columns = pathlib.Path(path), tuple(columns)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", newline="") as f:
            w = csv.writer(f, lineterminator="\n")
            w.writerow(self.columns)
            for row in keep:
                w.writerow(format_cell(row.get(c)) for c in self.columns)
        os.replace(tmp, self.path)
        self.f: TextIO = open(self.path, "a", buffering=1, newline="")
        self._w = csv.writer(self.f, lineterminator="\n")

    def write(self, row: dict[str, Any]) -> None:
        self._w.writerow(format_cell(row.get(c)) for c in self.columns)

    def close(self) -> None:
        self.f.close()


def split_line(line: str) -> list[str]:
    """The cells of one CSV line (quoted cells may hold commas)."""
    return [c.strip() for c in next(csv.reader(io.StringIO(line)), [])]


def to_number(cell: str) -> float | None:
    """'' -> None; a number -> float; ValueError otherwise."""
    cell = cell.strip()
    return None if cell == "" else float(cell)


class CsvRows:
    """Incremental, tolerant parser of one CSV file's lines -> rows of numbers.

    The first line is the header when its first cell is not a number; otherwise the
    file is header-less and read with `headerless` columns. A row with the wrong number
    of cells, a non-numeric cell outside `text_columns`, no step, or a step seen before
    is skipped and described in `bad`.
    """

    def __init__(self, headerless: tuple[str, ...] = DOCUMENTED_COLUMNS, text_columns: tuple[str, ...] = ()):
        self.headerless, self.text_columns = headerless, set(text_columns)
        self.columns: tuple[str, ...] | None = None
        self.bad: list[str] = []
        self._seen: set[float] = set()

    def feed(self, line: str, lineno: int | None = None) -> dict[str, Any] | None:
        """The row of one line, or None (a header, a blank or a malformed line)."""
        if not line.strip():
            return None
        where = f"line {lineno}" if lineno is not None else "a line"
        cells = split_line(line)
        if self.columns is None:
            try:
                float(cells[0])
            except ValueError:
                self.columns = tuple(cells)
                return None
            self.columns = tuple(
                self.headerless[i] if i < len(self.headerless) else f"col{i}" for i in range(len(cells))
            )
        if len(cells) != len(self.columns):
            self.bad.append(f"{where} has {len(cells)} fields, header {len(self.columns)}; skipped")
            return None
        row: dict[str, Any] = {}
        for c, v in zip(self.columns, cells):
            try:
                row[c] = to_number(v)
            except ValueError:
                if c not in self.text_columns:
                    self.bad.append(f"{where} has a non-numeric value in {c}; skipped")
                    return None
                row[c] = v
        step = row.get("step")
        if not isinstance(step, float) or not math.isfinite(step):
            self.bad.append(f"{where} has no step; skipped")
            return None
        if step in self._seen:
            self.bad.append(f"{where} repeats step {int(step)}; skipped")
            return None
        self._seen.add(step)
        return row

    def reset(self) -> None:
        self.columns, self.bad, self._seen = None, [], set()


def read_lines(path: str | os.PathLike) -> tuple[list[tuple[int, str]], bool]:
    """Numbered non-blank lines; True when the last line has no newline (still being written or cut off)."""
    text = pathlib.Path(path).read_text(errors="replace")
    parts = text.split("\n")
    partial = bool(parts[-1].strip())
    return [(i + 1, s.rstrip("\r")) for i, s in enumerate(parts[:-1]) if s.strip()], partial


def read_csv(
    path: str | os.PathLike, problems: list[str] | None = None, headerless: tuple[str, ...] = DOCUMENTED_COLUMNS
) -> tuple[list[str], list[dict[str, Any]]]:
    """(columns, rows) of a step CSV; what was skipped is appended to `problems` as lines."""
    path = pathlib.Path(path)
    problems = [] if problems is None else problems
    lines, partial = read_lines(path)
    if partial:
        problems.append(f"{path.name}: last line incomplete (no newline: still being written or cut off); ignored")
    parser = CsvRows(headerless)
    rows = [r for n, line in lines if (r := parser.feed(line, n)) is not None]
    problems.extend(f"{path.name}: {b}" for b in parser.bad[:5])
    if len(parser.bad) > 5:
        problems.append(f"{path.name}: {len(parser.bad) - 5} more malformed lines skipped")
    return list(parser.columns or ()), rows


def rows_upto(path: str | os.PathLike, step: int) -> list[dict[str, Any]]:
    """Rows of an earlier CSV with step <= `step` (a resume keeps them); [] when there is no file."""
    path = pathlib.Path(path)
    if not path.is_file():
        return []
    _, rows = read_csv(path)
    return [r for r in rows if r["step"] <= step]


# ---------------------------------------------------------------------------
# heartbeats

# Fields of every heartbeat line; events add their own.
HEARTBEAT_FIELDS = ("ts", "iso", "pid", "rank", "step", "event", "msg", "memory")
EVENTS = {
    "boot": "the process started (devices, processes, tokens_per_step); a resumed run appends after its earlier end",
    "resume": "restored a checkpoint (msg: its path)",
    "loader_start": "opening the data stream",
    "loader_ready": "the first batch arrived",
    "loader_timeout": "no first batch within data.loader_timeout",
    "compile": "the train step compiled (compile_s, memory_analysis)",
    "step_start": "an optimizer step was dispatched",
    "step_end": "a step finished (loss, lr, step_time_s: the step's own time)",
    "progress": "the progress line of a log interval (toks_per_s over the interval's steps)",
    "eval": "an evaluation on the held-out set (val_loss, val_ppl, eval_s)",
    "checkpoint_start": "a checkpoint save started (save_s: how long the loop was blocked)",
    "checkpoint": "a checkpoint step was committed on disk (msg: its path)",
    "checkpoint_failed": "a checkpoint save failed (msg: the cause); the run stops",
    "output_failed": "a run file (training.csv, val.csv, env.json) could not be written (path); the run stops",
    "selection_top_n": "the dense selection (train.dense_selection_steps) is over: top-n from this step",
    "branch_scale": "compressed keys or values first above CMP_SCALE_WARN x the selection branch's (ratio, layer)",
    "anomaly": "a non-finite loss or gradient (anomaly_type)",
    "halt": "the run stops early (.HALT file, SIGTERM, SIGINT)",
    "eval_off": "the run evaluates nothing (msg: why, e.g. no validation split in the data)",
    "projection": "a CPU run's projected time, warned after its first step (step_time_s)",
    "watchdog_dump": "stacks were dumped (reason: sigusr1 or stall)",
    "done": "the run ended normally or by a halt (summary fields)",
    "crash": "the trainer raised (msg: the error)",
}
ANOMALY_EVENTS = ("anomaly", "halt", "watchdog_dump", "loader_timeout", "checkpoint_failed", "output_failed")

# ---------------------------------------------------------------------------
# exit codes of launch.train (launch.watchdog: 0 ended cleanly, 1 anomaly, 2 usage)

EXIT_OK = 0
EXIT_FAILED = 1  # a crash, or a halt on a non-finite loss or gradient
EXIT_USAGE = 2  # bad input, an unusable out_dir, a batch that cannot fit: nothing was trained
EXIT_CHECKPOINT_FAILED = 74  # EX_IOERR: a checkpoint save or a run file write failed (disk full, permission);
# the last committed checkpoint stays
EXIT_STALL = 75  # EX_TEMPFAIL: the stall watchdog ended a hung process; worth a restart
EXIT_INTERRUPTED = 130  # 128 + SIGINT: Ctrl-C; the run stopped after a step and saved a checkpoint
