"""`python -m launch.evaluate`: long-context evaluation of a checkpoint (needle, loss by position, kv_recall).

    python -m launch.evaluate --ckpt OUT [--config NAME] [--set KEY=VALUE ...]
        [--suites needle,loss-by-position,kv_recall] [--lengths 1024,2048,4096]
        [--depths 0,0.1,...,1] [--samples 2] [--rows 4] [--batch-size 2]
        [--text FILE ...] [--out DIR] [--device-memory BYTES] [--seed S]
    python -m launch.evaluate --random-init --config cpu_tiny --lengths 512 --out /tmp/ev

Weights: the formats `launch.generate` reads (a training checkpoint, a directory
with config.yaml + params.msgpack, or `--random-init --config X`). Held-out text: the
run's validation split (its data config, through the data pipelines), or `--text`
files. Lengths may exceed the training length. Every L is compiled first; one whose
compiled forward needs more than the device's memory (or `--device-memory`) is
refused with one `error:` line naming both figures. Results: `<out>/evaluation.json`
and one PNG per suite (needle.png: L x depth heatmap; loss_by_position.png;
kv_recall.png). The summary is printed. Suites and scoring: nsa_jax/evaluation.

Before the suites run, one `note:` line on stderr names the lengths beyond the
training length (train.seq_len: positions never trained), and one says when the
checkpoint was trained on synthetic data where a suite reads text (needle, --text).
The progress bar (stderr) is redrawn every few seconds, so its clock moves while a
long forward or a compile runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import sys
import threading
import time

from tqdm import tqdm

from launch.cli import Parser, UsageError, run_main
from launch.generate import check_params, load_model
from nsa_jax.config import ConfigError
from nsa_jax.data import make_tokenizer
from nsa_jax.data.needle import min_row_len
from nsa_jax.evaluation.scorer import ModelScorer
from nsa_jax.evaluation.suites import DEFAULT_DEPTHS, SUITES, TextRows, count_batches, run_suites
from nsa_jax.inference.notes import synthetic_note, times, trained_positions

RESULTS_FILE = "evaluation.json"
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
    p.add_argument("--random-init", action="store_true", help="random params of --config instead of a checkpoint")
    p.add_argument("--config", default=None, help="config name in configs/ or a YAML path")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--suites", type=_suites, default=list(SUITES), help=f"comma-separated, of {', '.join(SUITES)}")
    p.add_argument("--lengths", type=_ints, default=[1024, 2048], help="row lengths L (tokens the model reads)")
    p.add_argument("--depths", type=_fractions, default=list(DEFAULT_DEPTHS), help="needle depths in [0, 1]")
    p.add_argument("--samples", type=int, default=2, help="needles (haystacks and pass keys) per L x depth cell")
    p.add_argument("--rows", type=int, default=4, help="rows per L for loss-by-position and kv_recall")
    p.add_argument("--batch-size", type=int, default=2, help="rows per forward")
    p.add_argument("--text", nargs="+", default=[], metavar="FILE", help="held-out text files (default: val split)")
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
        if not pathlib.Path(f).is_file():
            raise UsageError(f"--text {f} not found")
    if args.out and (pathlib.Path(args.out) / RESULTS_FILE).exists():
        raise UsageError(f"--out {args.out} already holds {RESULTS_FILE}; pass another --out or move it away")


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
    if "needle" in args.suites:
        why.append("the needle rows' text and question are new to it, so expect needle accuracy near 0")
    if args.text:
        why.append("the --text files are text it never learned")
    if why and (line := synthetic_note(cfg, "; ".join(why))):
        out.append(line)
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
    if "needle" in results:
        r = results["needle"]
        lines.append(f"needle accuracy ({r['samples']} per cell), depths {', '.join(f'{d:g}' for d in r['depths'])}:")
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
    return lines


def run(args) -> int:
    _check_args(args)
    try:
        cfg, params = load_model(args)
        text = TextRows(cfg, args.text)
        need = min_row_len(make_tokenizer(cfg.data))
    except (ConfigError, ValueError, OSError) as e:
        raise UsageError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    if "needle" in args.suites and min(args.lengths) < need:
        raise UsageError(f"--lengths {min(args.lengths)} is too short for a needle row; use L >= {need}")
    params = check_params(cfg, params)
    scorer = ModelScorer(cfg.model, params, args.batch_size, args.device_memory)
    total = count_batches(args.suites, args.lengths, args.depths, args.samples, args.rows, args.batch_size)
    t0 = time.perf_counter()
    bar = tqdm(total=total, desc="evaluate", unit="batch", disable=args.no_progress, file=sys.stderr)
    with bar, _redrawn(bar):
        try:
            for L in args.lengths:
                bar.set_postfix_str(f"compiling L={L}")
                scorer.prepare(L)
            bar.set_postfix_str("")
            for line in notes(args, cfg):
                tqdm.write(line, file=sys.stderr)
            results = run_suites(
                scorer,
                cfg,
                args.suites,
                args.lengths,
                text=text,
                depths=args.depths,
                samples=args.samples,
                rows=args.rows,
                seed=args.seed,
                advance=bar.update,
            )
        except ValueError as e:  # WontFitError, too little held-out text, a kv_recall row too short
            raise UsageError(str(e).splitlines()[0]) from None
    seconds = time.perf_counter() - t0
    for line in summary_lines(results):
        print(line)
    print(f"evaluated in {seconds:.1f} s")
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {
            "ckpt": args.ckpt,
            "config": cfg.to_dict(),
            "seconds": seconds,
            "compiled_bytes": {str(L): scorer.bytes.get(L) for L in args.lengths},
        }
        from nsa_jax.report.plots import evaluation_figures, save_figures  # noqa: PLC0415 - matplotlib: only for --out

        paths = save_figures(evaluation_figures(results), out)
        (out / RESULTS_FILE).write_text(json.dumps({"meta": meta, **results}, indent=1))
        print(f"wrote {out / RESULTS_FILE} and {', '.join(p.name for p in paths.values())}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(build_parser, run, argv)


if __name__ == "__main__":
    sys.exit(main())
