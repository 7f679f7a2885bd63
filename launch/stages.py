"""`python -m launch.stages --recipe FILE:NAME[,NAME...] --seeds 1,2 --out OUT [--parallel N] [--deadline S]`

Staged training recipes, written as data: configs/recipes/FILE.yaml (or a YAML path)
names recipes, each a list of stages. A stage is one `python -m launch.train` on the
run's folder with the stage's own settings and train.steps, so it continues the previous
stage's checkpoint (weights, optimizer state, step; launch.train resumes its out dir).
After the last stage `python -m launch.evaluate` scores the run. The needle recipe:

    python -m launch.stages --recipe needle:ropedecay --seeds 1,2,3 --out OUT --variants nsa
    python -m launch.stages --recipe needle:plain,rope,ropedecay --seeds 1,2,3,4 --out OUT \\
        --variants nsa --parallel 16 --deadline 480 --eval-suites needle --eval-lengths 1024

A recipe file (paths in it are relative to the repository root, where every process runs):
  requires:  [PATH ...]: files the recipe's set-up makes (its header says how); missing: one line
  env:       {VARIABLE: value} for every process started, unless the environment sets it
  train:     config, dataset, data_path, set: [KEY=VALUE ...]: launch.train's flags, every stage
  variants:  {NAME: [KEY=VALUE ...]}: model variants, run side by side (--variants picks;
             default: all, in the file's order)
  evaluate:  suites, lengths, samples, rows, text: launch.evaluate's flags after the last stage
  recipes:   {NAME: [{steps: N, set: [KEY=VALUE ...]}, ...]}: `steps` is train.steps at the
             stage's end (it counts on over the stages), `set` the stage's --set items
Every stage's whole configuration is loaded before anything starts: a bad key or value is
one `error:` line naming the recipe and stage, and nothing runs.

One run per (recipe, variant, seed), started seed by seed (a seed's recipes and variants
together, so that a --deadline cut leaves every recipe with the same seeds), at most
--parallel at a time. A run's stages go in order; a stage that fails ends its run (the
others go on). --deadline S: no run starts later than S - 60 seconds after the command
did, and a stage still going at S is sent SIGTERM (it saves a checkpoint and exits).
Ctrl-C (SIGINT) and SIGTERM are passed to the running stages once each (they save a
checkpoint), and no new stage starts; a second Ctrl-C is passed on too (the stages quit
at once). --resume continues the runs of an earlier command in the same OUT: a finished
stage is a no-op, a stopped one resumes from its checkpoint, an evaluated run keeps its
evaluation, and a stopped evaluation continues where it stopped.

Progress: one line per run start, stage and end on stdout, every line the run's processes
print prefixed with `[recipe variant sSEED]`, once two step lines of a run are in the projected
training time of the whole command (every run's steps x T, scaled from that run's rate), then
each run's summary line and, per variant, each recipe over its seeds (`python -m
experiments.needle_seeds OUT` prints the same from the files later). Writes
  OUT/<recipe>/<variant>_s<seed>/       the run (launch.train's files; eval/ with
                                        evaluation.json and the PNGs; evaluate.log)
  OUT/<recipe>/<variant>_s<seed>.log    everything the run's processes printed
  OUT/<recipe>/summary.txt              a line per run: seconds per stage and the needle
                                        accuracy by length, or where and why it stopped
  --archive FILE.tgz                    OUT without checkpoints, TensorBoard files and heartbeats
Exit status: 0 every run finished (or was cut by --deadline), 1 a stage or an evaluation
failed, 2 bad input (one `error:` line; OUT is not touched), 130 Ctrl-C; after SIGTERM 0 when every
stage it reached saved and exited 0 (as launch.train does), 143 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import threading
import time
from collections import deque
from pathlib import Path

from launch.cli import Parser, UsageError, run_main
from launch.recipe_results import evaluated, read, report, summary_line
from launch.recipes import ROOT, RecipeFile, Stage, check_evaluate, load_recipe_file, set_flags, stages
from nsa_jax.progress_text import fmt_duration
from nsa_jax.rundir import files as run_files
from nsa_jax.words import count

# A run starts only with at least this many seconds left before --deadline.
MIN_START_S = 60
# Seconds a stage sent SIGTERM at the deadline has to save before it is killed.
KILL_AFTER_S = 10
EXIT_FAILED, EXIT_SIGINT, EXIT_SIGTERM = 1, 130, 143


# ---------------------------------------------------------------------------
# running


@dataclasses.dataclass
class Run:
    recipe: str
    variant: str
    seed: int
    stages: list[Stage]
    dir: Path

    @property
    def label(self) -> str:
        return f"{self.recipe} {self.variant} seed {self.seed}"

    @property
    def log(self) -> Path:
        return self.dir.parent / f"{self.dir.name}.log"


def train_command(rf: RecipeFile, run: Run, stage: Stage) -> list[str]:
    return [
        sys.executable,
        "-m",
        "launch.train",
        *rf.train_args(),
        *set_flags(rf.variants[run.variant]),
        *("--set", f"train.seed={run.seed}", "--out-dir", str(run.dir), "--steps", str(stage.steps)),
        *set_flags(stage.overrides),
    ]


def evaluate_command(ev: dict, run: Run) -> list[str]:
    text = ["--text", *ev["text"]] if ev["text"] else []
    return [
        sys.executable,
        "-m",
        "launch.evaluate",
        *("--ckpt", str(run.dir), "--suites", ",".join(ev["suites"])),
        *("--lengths", ",".join(map(str, ev["lengths"])), "--samples", str(ev["samples"])),
        *("--rows", str(ev["rows"])),
        *text,
        *("--out", str(run.dir / "eval")),
    ]


# launch.train's step line (nsa_jax/train/progress.py): `step 40/300 | loss ... | ETA 1m23s`.
STEP_LINE = re.compile(r"step (\d+)/\d+ \|")


class Projection:
    """The command's training time, said once: the seconds a step takes between the first two step
    lines of a run (the first run to print two), per token of its stage's T, times every run's tokens
    (each stage's steps x its T), over `parallel` runs at a time. Evaluations are not counted."""

    def __init__(self, runs: list[Run], parallel: int):
        self.runs, self.parallel = runs, max(1, min(parallel, len(runs)))
        self.first: dict[str, tuple[float, int]] = {}  # run label -> (time, step) of its first step line
        self.said = False

    def step_line(self, run: Run, stage: Stage, line: str) -> str | None:
        """The projection line once two step lines of one run are in, else None."""
        m = STEP_LINE.match(line)
        if self.said or not m:
            return None
        step, now = int(m[1]), time.monotonic()
        t0, s0 = self.first.get(run.label, (now, step))
        if step <= s0:
            self.first[run.label] = (now, step)
            return None
        self.said = True
        per_step = (now - t0) / (step - s0)
        tokens = sum(
            (st.steps - (r.stages[i - 1].steps if i else 0)) * st.seq_len
            for r in self.runs
            for i, st in enumerate(r.stages)
        )
        total = per_step / stage.seq_len * tokens / self.parallel
        return (
            f"projected: about {fmt_duration(total)} of training for the command ({count(len(self.runs), 'run')}, "
            f"{self.parallel} at a time), from {per_step:.2f} s a step at T={stage.seq_len:,} on {run.label}; "
            "other lengths scaled by their tokens, evaluations not counted"
        )


class Runner:
    """Runs the runs, at most `parallel` at a time, each in a thread that starts its processes one by one."""

    def __init__(self, rf: RecipeFile, ev: dict, runs: list[Run], parallel: int, deadline: float):
        self.rf, self.ev, self.runs, self.parallel = rf, ev, runs, parallel
        self.t0 = time.monotonic()
        self.deadline_at = self.t0 + deadline if deadline > 0 else None
        self.lock = threading.RLock()  # RLock: the signal handler runs on the main thread, which may hold it
        self.procs: set[subprocess.Popen] = set()
        self.signals: list[tuple[int, int]] = []  # (signal, processes it was passed to)
        self.results: dict[str, str] = {}  # run dir -> "ok", "deadline", "skipped", "failed", "interrupted"
        self.stop_statuses: list[int] = []  # exit status of each process a signal stopped
        self.lines: list[str] = []  # summary lines, in the order the runs ended
        self.env = rf.child_env()
        self.projection = Projection(runs, parallel)

    def say(self, msg: str) -> None:
        with self.lock:
            print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)

    def on_signal(self, signum, _frame) -> None:
        """Ctrl-C / SIGTERM: passed to every running process (each saves a checkpoint); no new stage starts.
        It prints nothing (it may interrupt a print of the main thread): run_all says what happened."""
        with self.lock:
            procs = list(self.procs)
            self.signals.append((signum, len(procs)))
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signum)

    def process(
        self, cmd: list[str], run: Run, log, also: Path | None = None, stage: Stage | None = None
    ) -> tuple[int, str]:
        """One process of `run`, its output into the run's log (and `also`) and on stdout with the run's
        prefix; (exit status, "" or "deadline" / "interrupted")."""
        prefix = f"[{run.recipe} {run.variant} s{run.seed}] "
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        with self.lock:
            if self.signals:
                return 0, "interrupted"
            proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=self.env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                bufsize=1,
                start_new_session=True,  # signals reach it through on_signal, once each
            )
            self.procs.add(proc)
        extra = open(also, "a") if also else contextlib.nullcontext()

        def pump():
            with extra as f:
                for line in proc.stdout:
                    log.write(line)
                    if f:
                        f.write(line)
                    with self.lock:
                        print(prefix + line, end="", flush=True)
                        note = self.projection.step_line(run, stage, line) if stage is not None else None
                    if note:
                        self.say(note)
            log.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        why = ""
        try:
            while True:
                left = None if self.deadline_at is None else self.deadline_at - time.monotonic()
                if left is not None and left <= 0:
                    why = "deadline"
                    proc.terminate()
                    try:
                        proc.wait(KILL_AFTER_S)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                    break
                try:
                    proc.wait(1.0 if left is None else min(1.0, left))
                    break
                except subprocess.TimeoutExpired:
                    continue
            rc = proc.wait()
        finally:
            with self.lock:
                self.procs.discard(proc)
        reader.join()
        if not why and self.signals:
            why = "interrupted"
        return rc, why

    def stopped(self, run: Run, rc: int, why: str, where: str, t0: float) -> str:
        what = {"deadline": "at the deadline", "interrupted": "by a signal"}.get(why, "failed")
        if why == "interrupted":
            with self.lock:
                self.stop_statuses.append(rc)
        line = f"{run.variant} seed {run.seed}: stopped rc={rc} after {int(time.monotonic() - t0)} s ({what}, {where})"
        if not why:
            line += f"; see {run.log}"
        self.finish(run, line)
        return why or "failed"

    def finish(self, run: Run, line: str) -> None:
        """The run's line in its recipe's summary.txt: added, or in place of the line an earlier
        command (stopped, then --resume) wrote for the same run."""
        path = run.dir.parent / "summary.txt"
        own = f"{run.variant} seed {run.seed}: "
        with self.lock:
            kept = [x for x in path.read_text().splitlines() if not x.startswith(own)] if path.exists() else []
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(x + "\n" for x in [*kept, line]))
            os.replace(tmp, path)
            self.lines.append(f"{run.recipe}: {line}")
        self.say(f"{run.recipe}: {line}")

    def run_one(self, run: Run) -> str:
        t0 = time.monotonic()
        n = len(run.stages)
        times = []
        with open(run.log, "a") as log:
            for i, stage in enumerate(run.stages, 1):
                self.say(f"{run.label}: stage {i}/{n}: T={stage.seq_len} to step {stage.steps}")
                s0 = time.monotonic()
                rc, why = self.process(train_command(self.rf, run, stage), run, log, stage=stage)
                if rc or why:
                    return self.stopped(run, rc, why, f"stage {i}/{n}", t0)
                times.append(f"T={stage.seq_len} {int(time.monotonic() - s0)} s")
            if evaluated(run.dir / "eval"):
                self.say(f"{run.label}: evaluated before; keeping {run.dir / 'eval'}")
            else:
                lengths = ",".join(map(str, self.ev["lengths"]))
                self.say(f"{run.label}: evaluation: {','.join(self.ev['suites'])} at L={lengths}")
                rc, why = self.process(evaluate_command(self.ev, run), run, log, also=run.dir / "evaluate.log")
                if rc or why:
                    return self.stopped(run, rc, why, "evaluation", t0)
        self.finish(run, f"{run.variant} seed {run.seed}: {','.join(times)} | {summary_line(run.dir)}")
        return "ok"

    def _thread(self, run: Run) -> None:
        try:
            result = self.run_one(run)
        except Exception as e:  # an OSError writing the log or the summary: this run ends, the others go on
            self.say(f"{run.label}: failed: {type(e).__name__}: {e}")
            result = "failed"
        with self.lock:
            self.results[str(run.dir)] = result

    def exit_status(self) -> int:
        """130 after Ctrl-C; after SIGTERM 0 when every process it stopped exited 0 (launch.train saves and
        exits 0), 143 otherwise; else 1 when a run failed, 0 when none did."""
        if signal.SIGINT in [s for s, _ in self.signals]:
            return EXIT_SIGINT
        if self.signals and any(self.stop_statuses):
            return EXIT_SIGTERM
        return EXIT_FAILED if "failed" in self.results.values() else 0

    def run_all(self) -> None:
        pending, running, told = deque(self.runs), [], 0
        while pending or running:
            for signum, n in self.signals[told:]:
                passed = count(n, "running process", "running processes")
                self.say(f"{signal.Signals(signum).name}: passed to {passed}; no new stage starts")
            told = len(self.signals)
            while pending and len(running) < self.parallel and not self.signals:
                run = pending.popleft()
                run.dir.parent.mkdir(parents=True, exist_ok=True)
                if self.deadline_at is not None and self.deadline_at - time.monotonic() < MIN_START_S:
                    self.finish(
                        run, f"{run.variant} seed {run.seed}: skipped (under {MIN_START_S} s left before --deadline)"
                    )
                    self.results[str(run.dir)] = "skipped"
                    continue
                self.say(f"start {run.label} ({count(len(run.stages), 'stage')}; log {run.log})")
                t = threading.Thread(target=self._thread, args=(run,), name=run.label)
                t.start()
                running.append((run, t))
            if self.signals and pending:
                for run in pending:
                    self.results[str(run.dir)] = "interrupted"
                pending.clear()
            for run, t in list(running):
                if not t.is_alive():
                    t.join()
                    running.remove((run, t))
                    self.say(
                        f"done {run.label}: {self.results.get(str(run.dir))} "
                        f"({int(time.monotonic() - self.t0)} s since the start)"
                    )
            time.sleep(0.2)


def write_archive(out: Path, archive: Path) -> None:
    """OUT packed into `archive` without checkpoints, TensorBoard files or heartbeats (written whole, then renamed)."""
    tmp = archive.with_name(archive.name + ".tmp")

    def keep(info: tarfile.TarInfo):
        base = os.path.basename(info.name)
        if (
            base in (run_files.CHECKPOINT_DIR, run_files.CORRUPT_DIR, run_files.TB_DIR)
            or run_files.heartbeat_rank(base) is not None
        ):
            return None
        if base == tmp.name:
            return None
        return info

    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(out, arcname=out.name, filter=keep)
    os.replace(tmp, archive)


# ---------------------------------------------------------------------------
# command line


def _ints(text: str, flag: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not out or min(out) < 0:
        raise UsageError(f"{flag} must be comma-separated integers >= 0, got {text!r}")
    if len(set(out)) != len(out):
        raise UsageError(f"{flag} repeats a value: {text!r}")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m launch.stages",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        in_process=True,
    )
    p.add_argument("--recipe", required=True, metavar="FILE:NAME[,NAME...]", help="e.g. needle:ropedecay")
    p.add_argument("--seeds", required=True, metavar="S[,S...]", help="train.seed of each run, e.g. 1,2,3")
    p.add_argument("--out", required=True, metavar="DIR", help="folder for the runs (OUT/<recipe>/<variant>_s<seed>)")
    p.add_argument("--variants", metavar="V[,V...]", help="variants of the recipe file to run (default: all)")
    p.add_argument("--parallel", type=int, default=1, metavar="N", help="runs at a time (default 1)")
    p.add_argument("--deadline", type=float, default=0, metavar="S", help="seconds from the start (0: none)")
    p.add_argument("--eval-suites", metavar="S[,S...]", help="replace the recipe file's evaluation suites")
    p.add_argument("--eval-lengths", metavar="L[,L...]", help="replace the recipe file's evaluation lengths")
    p.add_argument("--archive", type=Path, metavar="FILE.tgz", help="pack OUT (without checkpoints) at the end")
    p.add_argument("--resume", action="store_true", help="continue the runs of an earlier command in OUT")
    p.add_argument("--dry-run", action="store_true", help="print every run's commands and stop")
    return p


def plan(args) -> tuple[RecipeFile, dict, list[Run]]:
    """Everything checked before OUT is touched: (recipe file, evaluation, runs in start order)."""
    file_name, sep, names = args.recipe.rpartition(":")
    if not sep or not file_name or not names.strip():
        which = "e.g. needle:ropedecay"
        with contextlib.suppress(UsageError):
            rf = load_recipe_file(file_name or names)
            which = f"{rf.path} has {', '.join(rf.recipes)}"
        raise UsageError(f"--recipe {args.recipe!r} must look like FILE:NAME[,NAME...] ({which})")
    rf = load_recipe_file(file_name)
    names = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in names if n not in rf.recipes]
    if unknown:
        raise UsageError(f"--recipe: {rf.path} has no recipe '{unknown[0]}'; choose from {', '.join(rf.recipes)}")
    if len(set(names)) != len(names):
        raise UsageError(f"--recipe {args.recipe!r} repeats a recipe")
    seeds = _ints(args.seeds, "--seeds")
    variants = list(rf.variants)
    if args.variants is not None:
        variants = [v.strip() for v in args.variants.split(",") if v.strip()]
        bad = [v for v in variants if v not in rf.variants]
        if bad or not variants:
            which = bad[0] if bad else args.variants
            raise UsageError(f"--variants: unknown variant {which!r}; {rf.path} has {', '.join(rf.variants)}")
        if len(set(variants)) != len(variants):
            raise UsageError(f"--variants {args.variants!r} repeats a variant")
    if args.parallel < 1:
        raise UsageError(f"--parallel must be >= 1, got {args.parallel}")
    if args.deadline < 0:
        raise UsageError(f"--deadline must be >= 0 seconds (0: none), got {args.deadline:g}")
    ev = dict(rf.evaluate)
    if args.eval_suites is not None:
        ev["suites"] = args.eval_suites
    if args.eval_lengths is not None:
        ev["lengths"] = args.eval_lengths
    ev = check_evaluate(ev, "--eval-suites/--eval-lengths" if args.eval_suites or args.eval_lengths else str(rf.path))
    out = Path(args.out).resolve()
    by_recipe = {(n, v): stages(rf, n, v) for n in names for v in variants}
    runs = [Run(n, v, s, by_recipe[n, v], out / n / f"{v}_s{s}") for s in seeds for n in names for v in variants]
    return rf, ev, runs


def check_out(args, runs: list[Run]) -> Path:
    """OUT usable, and no earlier run in it unless --resume; the archive new unless --resume."""
    out = Path(args.out).resolve()
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {args.out} is a file; pass a folder")
    if not args.resume:
        for run in runs:
            for p in (run.dir, run.log):
                if p.exists():
                    raise UsageError(
                        f"--out {args.out} already holds {p} (an earlier command's run); "
                        "pass another --out, or --resume to continue its stages"
                    )
        if args.archive is not None and args.archive.exists():
            raise UsageError(f"--archive {args.archive} exists; pass another file, or move it away")
    if args.archive is not None and not args.archive.resolve().parent.is_dir():
        raise UsageError(f"--archive {args.archive}: folder {args.archive.resolve().parent} does not exist")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out {args.out}: cannot create it: {e}") from None
    return out


def run(args) -> int:
    rf, ev, runs = plan(args)
    if args.dry_run:
        for r in runs:
            print(f"# {r.label} -> {r.dir}")
            for stage in r.stages:
                print(shlex.join(train_command(rf, r, stage)))
            print(shlex.join(evaluate_command(ev, r)))
        return 0
    out = check_out(args, runs)
    runner = Runner(rf, ev, runs, args.parallel, args.deadline)
    previous = {s: signal.signal(s, runner.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        deadline = f", deadline {args.deadline:g} s" if args.deadline else ""
        runner.say(f"{count(len(runs), 'run')} of {rf.path}, {args.parallel} at a time{deadline} -> {out}")
        runner.run_all()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    print()
    print("\n".join(runner.lines))
    recipes = sorted({r.recipe for r in runs})
    variants = list(dict.fromkeys(r.variant for r in runs))
    for variant in variants:
        found = {k: v for k, v in read(out, variant).items() if k in recipes}
        if found and len(variants) > 1:
            print(f"-- variant {variant}")
        print("\n".join(report(found)))
    if args.archive is not None:
        try:
            write_archive(out, args.archive)
            print(f"archive: {args.archive}")
        except OSError as e:
            print(f"error: cannot write --archive {args.archive}: {e}", file=sys.stderr)
            return EXIT_FAILED
    unfinished = [r for r in runs if runner.results.get(str(r.dir)) != "ok"]
    if unfinished:
        print(f"{count(len(unfinished), 'run')} not finished; to go on with them: the same command with --resume")
    return runner.exit_status()


def main(argv: list[str] | None = None) -> int:
    return run_main(build_parser, run, argv)


if __name__ == "__main__":
    sys.exit(main())
