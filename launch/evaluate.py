"""`python -m launch.evaluate`: long-context evaluation of a checkpoint (needle, loss by position, kv_recall,
passkey, text).

    python -m launch.evaluate --ckpt OUT [--config NAME] [--set KEY=VALUE ...]
        [--suites needle,loss-by-position,kv_recall,passkey,text] [--lengths 1024,2048,4096]
        [--depths 0,0.1,...,1] [--samples 2] [--rows 4] [--batch-size 2]
        [--text FILE ...] [--out DIR] [--device-memory BYTES] [--seed S]
    python -m launch.evaluate --random-init --config cpu_tiny --lengths 512 --out /tmp/ev
    python -m launch.evaluate --ckpt smollm2-dense --suites text,passkey --text FILE ... --lengths 1024,2048
    python -m launch.evaluate --agree BASE_OUT OTHER_OUT

Suites (default: the first three, which training's eval.suites also runs):
  - needle: a pass key at each of --depths of a held-out row of L + 1 tokens, asked for at the
    end; greedy exact match and the answer's log-probability per L x depth (needle.png);
  - loss-by-position: mean loss per log-spaced bucket of positions of --rows held-out rows;
  - kv_recall: accuracy by distance on rows of the key-value recall task;
  - passkey: the needle test for a pretrained model: a row of exactly L tokens of the text
    ("The pass key is 51234. Remember it. 51234 is the pass key." at each depth, "What is
    the pass key? The pass key is" and the key at the end), read whole by the model; the key
    retrieved when its greedy answer is every digit (one teacher-forced forward); accuracy per
    L x depth and per L over --samples keys (passkey.png);
  - text: the --text files' text with the model's own tokenizer (required; a text shorter
    than the longest L is refused): the mean next-token loss and perplexity of its first L
    tokens (the L - 1 predictions of a forward over them) and of all its non-overlapping
    L-token windows, with their count.

Weights: the formats `launch.generate` reads (a training checkpoint, a directory
with config.yaml + params.safetensors, or `--random-init --config X`). Held-out text: the
run's validation split (its data config, through the data pipelines), or `--text`
files (the text suite, and passkey's filler for a pretrained model: --text). Lengths may exceed
the training length. Every L is compiled first; one whose
compiled forward needs more than the device's memory (or `--device-memory`) is
refused with one `error:` line naming both figures. The summary is printed.
Suites and scoring: nsa_jax/evaluation.

Kept as it goes: the lengths run shortest first, and each (suite, L) is written to
`<out>/evaluation.json` as soon as it is done, the whole file each time (a temporary
file renamed over it: a stop or a crash leaves the previous file or the new one,
never less; nsa_jax/evaluation/results.py). The PNGs (needle.png, passkey.png: L x depth heatmaps;
loss_by_position.png; kv_recall.png) are drawn from the file at the end. The same
command run again skips the cells the file holds, saying so in one line, and adds
the rest; lengths or suites added to the command are added to the file. Results
made with other weights (another checkpoint, or another step of the same run) or
other settings (config, depths, samples, rows, seed, text) are refused with one
`error:` line naming the difference and the fix (the same settings, or another
--out): recomputing would overwrite what was kept, and mixing would put
incomparable results in one table.

How long: each length starts with a line giving what it runs and a projected time
for the length and for the rest of the command, from the measured time of a batch
at a shorter length scaled by the attention cost model (nsa_jax/evaluation/timing.py);
with nothing measured, a length whose batch would cost PROBE_RATIO times one at
PROBE_LENGTH or more first times one batch there (seconds), so the projection never
waits for a batch that takes minutes. After a length's first batch a second line
projects from its own rate. The line says which it used.

Prompt by prompt: needle and passkey keep each row's answer (right or not, and its log-probability), so
`--agree BASE_OUT OTHER_OUT` compares two evaluations of the same prompts (the same --depths, --samples,
--seed and --text; any weights or config): for each length, how many prompts each got right, on how
many of BASE's right answers OTHER is right too, and the key's log-probability, OTHER's less BASE's,
prompt against prompt, by depth. It reads the two evaluation.json files and runs nothing.

Stopping: SIGTERM or Ctrl-C (SIGINT) ends the command at once, even inside a long
forward (the batch in flight belongs to no kept result), with one line on stderr
naming what evaluation.json keeps and the command that continues: exit status 0
after SIGTERM, 130 after Ctrl-C, as a training run. A second signal while the line
waits for a write in progress quits at once.

Before the suites run, one `note:` line on stderr names the lengths beyond the
training length (train.seq_len: positions never trained), and one says when the
checkpoint was trained on synthetic data where a suite reads text (needle, passkey, --text),
and one per (suite, L) whose rows (a needle or passkey haystack per --samples, a loss-by-position
row per --rows) outnumber the rows of L + 1 tokens the --text files hold: those rows repeat text
that another row already holds, so give more text for prompts that differ.
The progress bar (stderr) is redrawn every few seconds, so its clock moves while a
long forward or a compile runs.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import shlex
import sys
import threading
import time

import jax
import numpy as np
from tqdm import tqdm

from launch.cli import Parser, UsageError, add_overrides, run_main
from launch.generate import check_params, load_model
from nsa_jax.config import EVAL_SUITES, ConfigError
from nsa_jax.data import make_tokenizer
from nsa_jax.data.needle import min_row_len
from nsa_jax.evaluation.results import (
    Mismatch,
    Results,
    agreement,
    describe,
    make_settings,
    read_document,
    weights_digest,
)
from nsa_jax.evaluation.scorer import ModelScorer
from nsa_jax.evaluation.suites import DEFAULT_DEPTHS, GRID_SUITES, SUITES, Settings, TextRows, cell, cell_batches
from nsa_jax.evaluation.timing import CostModel, Rates
from nsa_jax.inference.notes import synthetic_note, times, trained_positions
from nsa_jax.ops.memory import WontFitError
from nsa_jax.ops.preemption import QuitOnSignal
from nsa_jax.progress_text import fmt_duration, fmt_seconds

# A length with no measured rate that costs PROBE_RATIO times a batch at PROBE_LENGTH or more
# (the cost model's ratio), with no length that long measured, is projected from one batch timed at
# PROBE_LENGTH first: its own first batch may take minutes, and the projection is due sooner.
PROBE_LENGTH = 1024
PROBE_RATIO = 10.0
# Seconds between redraws of the progress bar while nothing advances it.
REFRESH_S = 5.0


def _ints(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return out


def _fractions(s: str) -> list[float]:
    try:
        out = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers in [0, 1], got {s!r}") from None
    if not out or min(out) < 0 or max(out) > 1:
        raise argparse.ArgumentTypeError(f"depths must lie in [0, 1], got {s!r}")
    return out


def _suites(s: str) -> list[str]:
    out = [x.strip() for x in s.split(",") if x.strip()]
    bad = [x for x in out if x not in SUITES]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"unknown suite {bad[0] if bad else s!r}; choose from {', '.join(SUITES)}")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m launch.evaluate", description="Long-context evaluation of a checkpoint.", in_process=True
    )
    p.add_argument("--ckpt", help="checkpoint path (the formats launch.generate reads)")
    p.add_argument(
        "--agree",
        nargs=2,
        metavar=("BASE_OUT", "OTHER_OUT"),
        help="compare two evaluations' needle / passkey answers prompt by prompt, and run nothing",
    )
    p.add_argument("--random-init", action="store_true", help="random params of --config instead of a checkpoint")
    p.add_argument("--config", default=None, help="config name in configs/ or a YAML path")
    add_overrides(p)
    p.add_argument(
        "--suites",
        type=_suites,
        default=list(EVAL_SUITES),
        help=f"comma-separated, of {', '.join(SUITES)} (default: {','.join(EVAL_SUITES)}; text needs --text)",
    )
    p.add_argument("--lengths", type=_ints, default=[1024, 2048], help="row lengths L (tokens the model reads)")
    p.add_argument(
        "--depths", type=_fractions, default=list(DEFAULT_DEPTHS), help="needle and passkey depths in [0, 1]"
    )
    p.add_argument(
        "--samples", type=int, default=2, help="needle / passkey rows (haystacks and pass keys) per L x depth cell"
    )
    p.add_argument("--rows", type=int, default=4, help="rows per L for loss-by-position and kv_recall")
    p.add_argument("--batch-size", type=int, default=2, help="rows per forward")
    p.add_argument(
        "--text",
        nargs="+",
        default=[],
        metavar="FILE",
        help="held-out text files (default: val split); the text suite's text",
    )
    p.add_argument("--out", default=None, help="folder for evaluation.json and the PNGs")
    p.add_argument("--device-memory", type=int, default=None, help="bytes per device (default: the device's own)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _check_args(args) -> None:
    for name in ("samples", "rows", "batch_size"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for f in args.text:
        p = pathlib.Path(f)
        if p.is_dir():
            raise UsageError(f"--text {f} is a folder; name its text files (e.g. --text {f}/*.txt)")
        if not p.is_file():
            raise UsageError(f"--text {f} not found; name a UTF-8 text file")
        try:
            with open(p, encoding="utf-8") as fh:
                while fh.read(1 << 20):  # the whole file decodes, read in pieces
                    pass
        except UnicodeDecodeError as e:
            raise UsageError(
                f"--text {f} is not UTF-8 text (byte {e.start:,} does not decode); pass a text file, "
                "or convert it first (e.g. iconv -f latin1 -t utf-8)"
            ) from None


def notes(args, cfg) -> list[str]:
    """The `note:` lines printed before the suites run (none for --random-init: nothing was trained)."""
    if args.random_init:
        return []
    out = []
    T = cfg.train.seq_len
    over = [L for L in args.lengths if L > T]
    if over:
        which = ", ".join(f"L={L:,} ({times(L, cfg)})" for L in over)
        verb = "is" if len(over) == 1 else "are"
        out.append(
            f"note: {which} {verb} beyond {trained_positions(cfg)}, so expect lower scores there (docs/LONG_CONTEXT.md)"
        )
    why = []
    if set(GRID_SUITES) & set(args.suites):
        why.append("the needle rows' text and question are new to it, so expect needle accuracy near 0")
    if args.text:
        why.append("the --text files are text it never learned")
    if why and (line := synthetic_note(cfg, "; ".join(why))):
        out.append(line)
    return out


def repeat_notes(args, text: TextRows) -> list[str]:
    """A `note:` per (suite, L) that takes more rows of --text than it holds: the later rows repeat its text
    (a needle or passkey haystack per --samples, a loss-by-position row per --rows)."""
    out = []
    for suite in (s for s in args.suites if s in (*GRID_SUITES, "loss-by-position")):
        n, flag = (args.samples, "--samples") if suite in GRID_SUITES else (args.rows, "--rows")
        for L in args.lengths:
            have = text.distinct_rows(L)
            if have is not None and n > have:
                out.append(
                    f"note: {suite} at L={L:,}: --text holds {have} row{'s' if have != 1 else ''} of {L + 1:,} tokens, "
                    f"so {n - have} of its {n} rows ({flag}) {'repeats' if n - have == 1 else 'repeat'} that text; "
                    "give more text (--text FILE ...) for rows that differ"
                )
    return out


@contextlib.contextmanager
def _redrawn(bar, every: float = REFRESH_S):
    """Redraws `bar` every `every` seconds (its elapsed time moves during one long call)."""
    stop = threading.Event()

    def loop():
        while not stop.wait(every):
            bar.refresh()

    thread = threading.Thread(target=loop, name="progress", daemon=True)
    thread.start()
    try:
        yield bar
    finally:
        stop.set()
        thread.join()


def summary_lines(results: dict) -> list[str]:
    lines = []
    for suite in (s for s in GRID_SUITES if s in results):
        r = results[suite]
        lines.append(f"{suite} accuracy ({r['samples']} per cell), depths {', '.join(f'{d:g}' for d in r['depths'])}:")
        for L, acc, lp in zip(r["lengths"], r["accuracy"], r["logprob"]):
            mean_acc, mean_lp = sum(acc) / len(acc), sum(lp) / len(lp)
            cells = " ".join(f"{a:.2f}" for a in acc)
            stats = f"mean {mean_acc:.2f} min {min(acc):.2f} | mean log p(answer) {mean_lp:.2f}"
            lines.append(f"  L={L:>6}: {cells} | {stats}")
    if "loss-by-position" in results:
        for L, r in results["loss-by-position"]["by_length"].items():
            last = next(v for v in reversed(r["loss"]) if v is not None)
            lines.append(f"loss L={L}: mean {r['mean']:.4f}, last bucket [{r['edges'][-2]}, {L}) {last:.4f}")
    if "kv_recall" in results:
        for L, r in results["kv_recall"]["by_length"].items():
            by = ", ".join(f"<{hi}: {a:.2f}" for (_, hi), a in zip(r["edges"], r["accuracy"]))
            lines.append(f"kv_recall L={L}: {r['mean']:.3f} ({by})")
    for L, r in results.get("text", {}).get("by_length", {}).items():
        first, win = r["first"], r["windows"]
        lines.append(
            f"text L={L}: first {L} tokens loss {first['loss']:.4f} ppl {first['ppl']:.2f} | "
            f"{win['count']} window{'s' if win['count'] != 1 else ''} loss {win['loss']:.4f} ppl {win['ppl']:.2f}"
        )
    return lines


def rerun_command(argv: list[str]) -> str:
    """The command line that runs this evaluation again (the same command continues it)."""
    return shlex.join(["python", "-m", "launch.evaluate", *argv])


def projection_line(L: int, what: str, rates: Rates, left_here: int, left_after: list[tuple[int, int]]) -> str:
    """'L=...: <what>: projected T for this length, T for the command (<how>)'.

    `left_here`: batches still to run at L; `left_after`: (L', batches) of the longer lengths still to run.
    """
    per_batch, how = rates.per_batch(L)
    this = left_here * per_batch
    parts = [f"{fmt_seconds(this)} for this length"] if left_here else []
    if left_after:
        rest = fmt_seconds(this + rates.total(left_after))
        parts.append(f"{rest} for the command" if left_here else f"{rest} for the rest of the command")
        if how == "measured" and any(n not in rates.measured for n, _ in left_after):
            how = "this length's first batch; the longer ones scaled by the attention cost model"
    if how == "measured":
        how = "this length's first batch"
    return f"L={L:,}: {what}: projected {', '.join(parts)} ({how})"


class TimedScorer:
    """The scorer, each call timed: `rates` gets the seconds a batch at L took and `on_batch(L, seconds)` is told."""

    def __init__(self, scorer, rates: Rates, on_batch):
        self.scorer, self.rates, self.on_batch = scorer, rates, on_batch
        self.batch = scorer.batch

    def prepare(self, L: int):
        return self.scorer.prepare(L)

    def __call__(self, tokens_BxT1):
        t0 = time.perf_counter()
        out = self.scorer(tokens_BxT1)
        seconds = time.perf_counter() - t0
        L = tokens_BxT1.shape[1] - 1
        self.rates.add(L, seconds)
        self.on_batch(L, seconds)
        return out


class Evaluation:
    """One command's run: what it compiles and scores, what it says, and the line a stop signal prints."""

    def __init__(self, args, argv: list[str], cfg, params, settings: Settings, results: Results):
        self.args, self.argv, self.cfg, self.params = args, argv, cfg, params
        self.settings, self.results = settings, results
        lengths = sorted(set(args.lengths))
        self.skipped = [(s, L) for L in lengths for s in args.suites if results.done(s, L)]
        self.todo = [(s, L) for L in lengths for s in args.suites if not results.done(s, L)]
        self.batches_at: dict[int, int] = {}  # batches to run at each length
        for s, L in self.todo:
            self.batches_at[L] = self.batches_at.get(L, 0) + cell_batches(s, settings, args.batch_size, L)
        self.done_at = dict.fromkeys(self.batches_at, 0)  # batches run at each length
        n_params = sum(int(np.size(x)) for x in jax.tree.leaves(params))
        cost = CostModel(cfg.model, n_params, jax.default_backend())
        self.rates = Rates(cost)
        self.bar = None
        self.added = 0

    def say(self, line: str) -> None:
        """One line on stderr, above the progress bar."""
        if self.bar is None:
            print(line, file=sys.stderr, flush=True)
        else:
            tqdm.write(line, file=sys.stderr)

    def stop_line(self, name: str) -> str:
        """What a stop by `name` leaves: the cells on disk, and the command that continues."""
        with self.results.lock:  # not in the middle of a write: the line names what the file holds
            kept = list(self.results.kept)
        if self.bar is not None:
            self.bar.close()  # its last state stays on screen; the line goes below it
        again = rerun_command(self.argv)
        if self.results.path is None:
            return (
                f"stopped by {name}: nothing kept (no --out); pass --out DIR to keep each result as it is done: {again}"
            )
        path = self.results.path
        if not kept:
            return f"stopped by {name}: nothing kept yet ({path} not written); the same command starts again: {again}"
        left = [c for c in self.todo if c not in kept]
        then = f"from L={left[0][1]:,}" if left else "and draw the figures"
        return (
            f"stopped by {name}: {path} keeps {describe(kept)} ({self.added} added by this run); "
            f"to continue {then} run the same command: {again}"
        )

    def left_after(self, L: int) -> list[tuple[int, int]]:
        return [(n, b) for n, b in sorted(self.batches_at.items()) if n > L]

    def on_batch(self, L: int, seconds: float) -> None:
        """Counts a batch; after the first one at a length, the projection from its own rate."""
        if L not in self.done_at:  # the probe
            return
        self.done_at[L] += 1
        left_here = self.batches_at[L] - self.done_at[L]
        if self.done_at[L] == 1 and (left_here or self.left_after(L)):
            what = f"first batch {fmt_seconds(seconds)}"
            self.say(projection_line(L, what, self.rates, left_here, self.left_after(L)))
        self.bar.update(1)

    def probe(self, scorer, L: int) -> None:
        """Times one batch at PROBE_LENGTH when nothing that long is measured and L costs far more (a projection
        in seconds; with a shorter length measured too, the growth between the two scales the rest)."""
        cost = self.rates.cost
        longest = max(self.rates.measured, default=0)
        if longest >= PROBE_LENGTH or L <= PROBE_LENGTH or cost(L) < PROBE_RATIO * cost(PROBE_LENGTH):
            return
        self.say(f"L={L:,}: timing one batch at L={PROBE_LENGTH:,} first, to project how long L={L:,} takes")
        try:
            scorer.prepare(PROBE_LENGTH)
        except WontFitError:
            return
        rng = np.random.default_rng(0)
        rows = rng.integers(0, self.cfg.model.vocab_size, (scorer.batch, PROBE_LENGTH + 1), dtype=np.int32)
        scorer(rows)

    def run(self, scorer) -> None:
        """Compiles every length to run (refusing one that does not fit), then scores the cells, lengths ascending."""
        args, results = self.args, self.results
        timed = TimedScorer(scorer, self.rates, self.on_batch)
        lengths = sorted(self.batches_at)
        total = sum(self.batches_at.values())
        self.bar = tqdm(total=total, desc="evaluate", unit="batch", disable=args.no_progress, file=sys.stderr)
        with self.bar, _redrawn(self.bar):
            for L in lengths:
                self.bar.set_postfix_str(f"compiling L={L}")
                results.meta["compiled_bytes"][str(L)] = scorer.prepare(L)
            self.bar.set_postfix_str("")
            for line in [*notes(args, self.cfg), *repeat_notes(args, self.settings.text)]:
                self.say(line)
            results.begin(self.todo)
            for i, L in enumerate(lengths, 1):
                self.probe(timed, L)
                cells = [s for s, n in self.todo if n == L]
                sizes = ", ".join(f"{s} {cell_batches(s, self.settings, args.batch_size, L)}" for s in cells)
                rows = f"{args.batch_size} row{'s' if args.batch_size > 1 else ''}"
                what = f"length {i} of {len(lengths)}, batches of {rows}: {sizes}"
                if self.rates.measured:
                    self.say(projection_line(L, what, self.rates, self.batches_at[L], self.left_after(L)))
                else:
                    self.say(f"L={L:,}: {what}: the projected time follows its first batch")
                t_length = time.perf_counter()
                for s in cells:
                    t0 = time.perf_counter()
                    result = cell(timed, s, L, self.settings)
                    left = [c for c in self.todo if c != (s, L) and not results.done(*c)]
                    results.add(s, L, result, time.perf_counter() - t0, left)
                    self.added += 1
                where = f"kept in {results.path}" if results.path else "not kept (no --out)"
                self.say(f"L={L:,}: done in {fmt_seconds(time.perf_counter() - t_length)}; {where}")


def agreement_lines(base: str, other: str, cells: list[dict]) -> list[str]:
    """What `--agree` prints: a line per (suite, L), then its depths."""
    lines = []
    for c in cells:
        of_base = f"{c['both'] / c['base']:.2f} of BASE's right answers" if c["base"] else "BASE got none right"
        lines.append(
            f"{c['suite']} L={c['L']:,}: BASE right on {c['base']} of {c['rows']}, OTHER on {c['other']}; both on "
            f"{c['both']} ({of_base}); OTHER alone on {c['other_only']}; log p(key) OTHER - BASE: mean "
            f"{c['logp_gap'] / c['rows']:+.2f}, lower on {c['other_lower']} of {c['rows']}"
        )
        for depth, d in c["by_depth"].items():
            lines.append(
                f"  depth {depth:g}: BASE {d['base']} of {d['rows']}, OTHER {d['other']}, both {d['both']}, "
                f"OTHER alone {d['other_only']}; log p(key) OTHER - BASE {d['logp_gap'] / d['rows']:+.2f}"
            )
    return [f"BASE {base}, OTHER {other}: the same prompts, answered greedily", *lines]


def run(args, argv: list[str]) -> int:
    if args.agree:
        try:
            cells = agreement(*(read_document(where) for where in args.agree))
        except Mismatch as e:
            raise UsageError(str(e)) from None
        print("\n".join(agreement_lines(*args.agree, cells)))
        return 0
    _check_args(args)
    ev: Evaluation | None = None

    def stop_line(name: str) -> str:
        if ev is None:
            return f"stopped by {name} before anything ran; nothing kept"
        return ev.stop_line(name)

    guard = QuitOnSignal(stop_line, lambda line: ev.say(line) if ev else print(line, file=sys.stderr, flush=True))
    guard.install()
    try:
        ev = _prepare(args, argv)
        if ev.skipped:
            where = ev.results.path
            ev.say(f"skipping {describe(ev.skipped)}: in {where} already (the same weights and settings)")
        t0 = time.perf_counter()
        if ev.todo:
            scorer = ModelScorer(ev.cfg.model, ev.params, args.batch_size, args.device_memory)
            try:
                ev.run(scorer)
            except ValueError as e:  # WontFitError, too little held-out text, a kv_recall row too short
                raise UsageError(str(e).splitlines()[0]) from None
        ev.bar = None
        _finish(ev, time.perf_counter() - t0)
    finally:
        guard.uninstall()
    return 0


def _prepare(args, argv: list[str]) -> Evaluation:
    """The checkpoint, the settings and what the out folder holds; UsageError for input that cannot run."""
    try:
        cfg, params = load_model(args)
        text = TextRows(cfg, args.text)
        need = min_row_len(make_tokenizer(cfg.data))
    except (ConfigError, ValueError, OSError) as e:
        raise UsageError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    for suite in (s for s in GRID_SUITES if s in args.suites):
        if min(args.lengths) < need:
            raise UsageError(f"--lengths {min(args.lengths)} is too short for a {suite} row; use L >= {need}")
    if "text" in args.suites:
        _check_text(args, text)
    params = check_params(cfg, params)
    settings = Settings(cfg, text, tuple(args.depths), args.samples, args.rows, args.seed)
    digest = weights_digest(params)
    key = make_settings(cfg.to_dict(), digest, args.depths, args.samples, args.rows, args.seed, args.text)
    out = pathlib.Path(args.out) if args.out else None
    results = Results(out, key, settings, {"ckpt": args.ckpt})
    try:
        results.read()
    except Mismatch as e:
        raise UsageError(str(e)) from None
    return Evaluation(args, argv, cfg, params, settings, results)


def _check_text(args, text: TextRows) -> None:
    """The text suite's text: given, and at least as long as every L (UsageError, one line)."""
    if text.text_tokens is None:
        raise UsageError("--suites text needs --text FILE [FILE ...]: the text whose loss it measures")
    n, L = len(text.text_tokens), max(args.lengths)
    if n < L:
        files = " ".join(args.text)
        verb = "holds" if len(args.text) == 1 else "hold together"
        raise UsageError(
            f"--text {files} {verb} {n:,} tokens (the model's tokenizer), fewer than L={L:,}; "
            f"drop L={L:,} from --lengths or give a longer text"
        )


def _finish(ev: Evaluation, seconds: float) -> None:
    """The summary of every cell the out folder holds (or this run scored), and the figures."""
    results = ev.results
    doc = results.document()
    for line in summary_lines(doc):
        print(line)
    if ev.todo:
        print(f"evaluated {describe(ev.todo)} in {fmt_duration(seconds)}")
    else:
        print(f"nothing to run: {results.path} holds every result asked for")
    if results.path is not None and results.cells:
        from nsa_jax.report.plots import evaluation_figures, save_figures  # noqa: PLC0415 - matplotlib: only for --out

        paths = save_figures(evaluation_figures(doc), results.path.parent)
        figures = ", ".join(p.name for p in paths.values()) or "none (the text suite draws none)"
        print(f"{results.path} holds {describe(results.cells)}; figures: {figures}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    return run_main(build_parser, lambda args: run(args, argv), argv)


if __name__ == "__main__":
    sys.exit(main())
