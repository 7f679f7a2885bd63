"""`python -m launch.stages`: staged recipes from configs/recipes/, run, stopped, summarised."""

from __future__ import annotations

import json
import re
import shlex
import signal
import sys
import threading
from pathlib import Path

import pytest
import yaml

from launch import recipe_results, stages
from launch.recipes import RECIPE_DIR, MissingSetup, load_recipe_file

from helpers import cpu_env, run_module


def write_recipe(tmp_path, recipes: dict, **sections) -> str:
    """A recipe file over the tiny smoke settings with `recipes`; returns its --recipe FILE part."""
    smoke = yaml.safe_load((RECIPE_DIR / "smoke.yaml").read_text())
    smoke.update(sections, recipes=recipes)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(smoke))
    return str(path)


def error_of(capsys, argv: list[str]) -> str:
    assert stages.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.slow
def test_two_stage_recipe_runs_end_to_end(tmp_path):
    """smoke:two: stage 2 continues stage 1's checkpoint in the same run folder, then the evaluation
    and the summary; the same command again is refused and changes nothing."""
    out = tmp_path / "out"
    args = ["--recipe", "smoke:two", "--seeds", "1", "--out", str(out)]
    r = run_module("launch.stages", *args, env=cpu_env(), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = out / "two" / "nsa_s1"
    lines = (run / "training.csv").read_text().splitlines()
    assert [int(row.split(",")[0]) for row in lines[1:]] == [1, 2, 3, 4]
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4"]
    log = (out / "two" / "nsa_s1.log").read_text()
    assert "resume: step 2 from" in log and log.count("$ ") == 3  # two stages, one evaluation
    assert json.loads((run / "env.json").read_text())["config"]["train"]["seq_len"] == 256
    needle = json.loads((run / "eval" / "evaluation.json").read_text())["needle"]
    assert needle["lengths"] == [256]
    (summary,) = (out / "two" / "summary.txt").read_text().splitlines()
    assert re.fullmatch(r"nsa seed 1: T=128 \d+ s,T=256 \d+ s \| L=256: mean \d\.\d\d min \d\.\d\d", summary), summary
    for want in ("start two nsa seed 1", "stage 1/2: T=128 to step 2", "stage 2/2: T=256 to step 4", "== two"):
        assert want in r.stdout, want
    assert re.search(r"^\[two nsa s1\] step 4/4 \| loss", r.stdout, re.M)

    again = run_module("launch.stages", *args, env=cpu_env(), timeout=120)
    assert again.returncode == 2 and again.stderr.startswith("error: --out") and "--resume" in again.stderr
    assert (out / "two" / "summary.txt").read_text().splitlines() == [summary]


def test_every_shipped_recipe_loads_and_runs_its_stages_in_order(capsys):
    """--dry-run over every recipe file: every stage's configuration loads, and a run's stages share
    its folder, its seed and its variant, with train.steps rising stage by stage."""
    files = sorted(RECIPE_DIR.glob("*.yaml"))
    assert files
    for path in files:
        try:
            rf = load_recipe_file(path.stem)
        except MissingSetup as e:  # a recipe whose set-up (a converted model, prepared data) was not run here
            assert "needs artifacts/" in str(e) and "run the commands at its top" in str(e)
            assert stages.main(["--recipe", f"{path.stem}:x", "--seeds", "1", "--out", "/nonexistent/out"]) == 2
            continue
        spec = f"{path.stem}:{','.join(rf.recipes)}"
        assert stages.main(["--recipe", spec, "--seeds", "3,4", "--out", "/nonexistent/out", "--dry-run"]) == 0
        text = capsys.readouterr().out
        blocks = text.split("# ")[1:]
        assert len(blocks) == 2 * len(rf.recipes) * len(rf.variants)
        for block in blocks:
            head, *cmds = block.strip().splitlines()
            folder = head.split(" -> ")[1]
            train = [shlex.split(c) for c in cmds[:-1]]
            recipe, variant, _, seed = head.split(" -> ")[0].split()
            assert len(train) == len(rf.recipes[recipe]) and folder.endswith(f"/{recipe}/{variant}_s{seed}")
            steps = [int(c[c.index("--steps") + 1]) for c in train]
            assert steps == sorted(set(steps))
            assert all(c[c.index("--out-dir") + 1] == folder and f"train.seed={seed}" in c for c in train)
            assert shlex.split(cmds[-1])[1:3] == ["-m", "launch.evaluate"] and f"{folder}/eval" in cmds[-1]
    assert not Path("/nonexistent/out").exists()


def test_runs_start_seed_by_seed_with_every_recipe_and_variant(tmp_path):
    spec = write_recipe(
        tmp_path,
        {"a": [{"steps": 2}], "b": [{"steps": 2}, {"steps": 3}]},
        variants={"nsa": [], "w": ["model.nsa.w=32"]},
    )
    args = stages.build_parser().parse_args(["--recipe", f"{spec}:b,a", "--seeds", "2,1", "--out", str(tmp_path / "o")])
    _, _, runs = stages.plan(args)
    order = [(r.seed, r.recipe, r.variant) for r in runs]
    assert order == [(s, n, v) for s in (2, 1) for n in ("b", "a") for v in ("nsa", "w")]
    assert [len(r.stages) for r in runs[:4]] == [2, 2, 1, 1]
    assert runs[0].dir == (tmp_path / "o" / "b" / "nsa_s2").resolve()


@pytest.mark.parametrize(
    "argv,says",
    [
        (["--recipe", "smoke"], "must look like FILE:NAME"),
        (["--recipe", "nosuchfile:two"], "no recipe file 'nosuchfile'"),
        (["--recipe", "smoke:three"], "has no recipe 'three'; choose from two"),
        (["--recipe", "smoke:two", "--seeds", "1,x"], "--seeds must be comma-separated integers"),
        (["--recipe", "smoke:two", "--seeds", "1,1"], "--seeds repeats"),
        (["--recipe", "smoke:two", "--variants", "full"], "unknown variant 'full'"),
        (["--recipe", "smoke:two", "--parallel", "0"], "--parallel must be >= 1"),
        (["--recipe", "smoke:two", "--deadline", "-1"], "--deadline must be >= 0"),
        (["--recipe", "smoke:two", "--eval-suites", "needles"], "unknown suite 'needles'"),
    ],
)
def test_bad_command_lines_are_one_error_line_and_touch_nothing(tmp_path, capsys, argv, says):
    argv = [*argv, *(["--seeds", "1"] if "--seeds" not in argv else []), "--out", str(tmp_path / "o")]
    assert says in error_of(capsys, argv)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "stage_list,says",
    [
        ([{"steps": 2, "set": ["train.seq_len=128"]}, {"steps": 4, "set": ["train.sequence_len=256"]}], "stage 2"),
        ([{"steps": 4}, {"steps": 4}], "steps must be an integer above the previous stage's (4)"),
        ([{"steps": 2, "sets": ["train.seq_len=128"]}], "unknown key 'sets'"),
        ([{"steps": 2, "set": "train.seq_len=128"}], "must be a list of KEY=VALUE strings"),
        ([{"steps": 2, "set": ["model.n_layers=two"]}], "model.n_layers must be an integer"),
        ([], "non-empty list of stages"),
    ],
)
def test_a_bad_stage_is_named_before_anything_runs(tmp_path, capsys, stage_list, says):
    spec = write_recipe(tmp_path, {"bad": stage_list})
    err = error_of(capsys, ["--recipe", f"{spec}:bad", "--seeds", "1", "--out", str(tmp_path / "o")])
    assert says in err and "recipe bad" in err
    assert not (tmp_path / "o").exists()


def test_an_earlier_run_or_archive_is_not_overwritten(tmp_path, capsys):
    out = tmp_path / "o"
    (out / "two" / "nsa_s1").mkdir(parents=True)
    argv = ["--recipe", "smoke:two", "--seeds", "1", "--out", str(out)]
    assert "--resume to continue" in error_of(capsys, argv)
    archive = tmp_path / "a.tgz"
    archive.write_bytes(b"x")
    assert "--archive" in error_of(
        capsys, ["--recipe", "smoke:two", "--seeds", "2", "--out", str(out), "--archive", str(archive)]
    )
    assert archive.read_bytes() == b"x" and sorted(p.name for p in (out / "two").iterdir()) == ["nsa_s1"]
    (tmp_path / "file").write_text("")
    assert "is a file" in error_of(capsys, ["--recipe", "smoke:two", "--seeds", "1", "--out", str(tmp_path / "file")])


def fake_runner(tmp_path, monkeypatch, stage_code: list[str], deadline: float = 0, seeds=(1,)) -> stages.Runner:
    """A Runner whose stages are `python -c CODE` (one per stage, in order) and whose evaluation writes
    an evaluation.json: the scheduling without training."""
    spec = write_recipe(tmp_path, {"r": [{"steps": i + 1} for i in range(len(stage_code))]})
    seeds = ",".join(map(str, seeds))
    args = stages.build_parser().parse_args(["--recipe", f"{spec}:r", "--seeds", seeds, "--out", str(tmp_path / "o")])
    rf, ev, runs = stages.plan(args)
    started = tmp_path / "started.txt"

    def train(rf, run, stage):  # as launch.train does, the first stage makes the run's folder
        code = f"import os; os.makedirs({str(run.dir)!r}, exist_ok=True); "
        code += f"open({str(started)!r}, 'a').write('{run.seed}:{stage.steps}\\n'); " + stage_code[stage.steps - 1]
        return [sys.executable, "-c", code]

    def evaluate(ev, run):
        result = {"needle": {"lengths": [256], "accuracy": [[1.0, 0.5]]}}
        write = f"import json, os; os.makedirs({str(run.dir / 'eval')!r}); "
        write += f"open({str(run.dir / 'eval' / 'evaluation.json')!r}, 'w').write({json.dumps(result)!r})"
        return [sys.executable, "-c", write]

    monkeypatch.setattr(stages, "train_command", train)
    monkeypatch.setattr(stages, "evaluate_command", evaluate)
    return stages.Runner(rf, ev, runs, parallel=2, deadline=deadline)


def test_a_failed_stage_ends_its_run_and_the_others_go_on(tmp_path, monkeypatch, capsys):
    # seed 1 fails in stage 2 (exit 3); stage 3 never starts.
    runner = fake_runner(tmp_path, monkeypatch, ["print('one')", "import sys; sys.exit(3)", "pass"], seeds=(1, 2))
    runner.run_all()
    assert sorted(runner.results.values()) == ["failed", "failed"]
    assert sorted((tmp_path / "started.txt").read_text().split()) == ["1:1", "1:2", "2:1", "2:2"]
    summary = (tmp_path / "o" / "r" / "summary.txt").read_text()
    assert "nsa seed 1: stopped rc=3 after" in summary and "(failed, stage 2/3); see" in summary
    assert "[r nsa s1] one" in capsys.readouterr().out
    assert "$ " in (tmp_path / "o" / "r" / "nsa_s1.log").read_text()


def test_finished_runs_get_the_summary_line_and_the_report(tmp_path, monkeypatch):
    runner = fake_runner(tmp_path, monkeypatch, ["pass", "pass"], seeds=(1, 2))
    runner.run_all()
    assert set(runner.results.values()) == {"ok"}
    lines = sorted((tmp_path / "o" / "r" / "summary.txt").read_text().splitlines())
    for seed, line in zip((1, 2), lines):
        assert re.fullmatch(rf"nsa seed {seed}: T=256 \d+ s,T=256 \d+ s \| L=256: mean 0.75 min 0.50", line), line
    text = "\n".join(recipe_results.report(recipe_results.read(tmp_path / "o")))
    assert "2 evaluated: mean 0.75" in text and ">= 0.90 at every depth: 0" in text


def test_a_resumed_run_replaces_its_summary_line(tmp_path, monkeypatch):
    # Seed 2 finishes; seed 1 fails in stage 2; the same OUT continued (as --resume does) finishes seed 1.
    summary = tmp_path / "o" / "r" / "summary.txt"
    fake_runner(tmp_path, monkeypatch, ["pass", "pass"], seeds=(2,)).run_all()
    (done2,) = summary.read_text().splitlines()
    fake_runner(tmp_path, monkeypatch, ["pass", "import sys; sys.exit(3)"], seeds=(1,)).run_all()
    assert summary.read_text().splitlines()[1].startswith("nsa seed 1: stopped rc=3")
    fake_runner(tmp_path, monkeypatch, ["pass", "pass"], seeds=(1,)).run_all()
    lines = summary.read_text().splitlines()
    assert len(lines) == 2 and lines[0] == done2 and lines[1].startswith("nsa seed 1: T=256"), lines


def test_the_deadline_stops_a_stage_and_no_run_starts_too_late(tmp_path, monkeypatch):
    monkeypatch.setattr(stages, "MIN_START_S", 1.0)
    runner = fake_runner(tmp_path, monkeypatch, ["import time; time.sleep(60)"], deadline=1.5, seeds=(1, 2, 3))
    runner.parallel = 1
    runner.run_all()
    assert runner.results == {
        str(tmp_path.resolve() / "o" / "r" / f"nsa_s{s}"): want
        for s, want in ((1, "deadline"), (2, "skipped"), (3, "skipped"))
    }
    summary = (tmp_path / "o" / "r" / "summary.txt").read_text()
    assert "nsa seed 1: stopped rc=" in summary and "(at the deadline, stage 1/1)" in summary
    assert "nsa seed 3: skipped (under" in summary
    assert (tmp_path / "started.txt").read_text().split() == ["1:1"]


def test_read_and_report_count_the_seeds_at_the_target(tmp_path):
    """Two recipes written by hand: recall series from val.csv, needle figures from evaluation.json."""

    def run(recipe, seed, recall, acc_by_len, variant="nsa"):
        d = tmp_path / recipe / f"{variant}_s{seed}"
        (d / "eval").mkdir(parents=True)
        lines = ["step,tokens,val_loss,val_ppl,retrieval_acc,answers,elapsed_s,eval_s"]
        lines += [f"{s},0,1.0,2.7,{a},320,1.0,0.1" for s, a in recall]
        (d / "val.csv").write_text("\n".join(lines) + "\n")
        if acc_by_len is not None:
            needle = {"lengths": list(acc_by_len), "accuracy": list(acc_by_len.values())}
            (d / "eval" / "evaluation.json").write_text(json.dumps({"needle": needle}))

    run("plain", 1, [(800, 0.98), (1100, 0.97)], {1024: [1.0, 0.9375, 0.9375], 2048: [0.5, 0.0, 0.25]})
    run("plain", 2, [(800, 0.99), (1100, 0.60)], {1024: [0.0, 0.0, 0.25]})
    run("plain", 3, [(800, 0.97)], None)  # stopped before its evaluation
    run("gradual", 1, [(800, 0.98)], {1024: [1.0, 0.875, 1.0]})
    run("gradual", 1, [(800, 0.5)], {1024: [0.0]}, variant="full")
    found = recipe_results.read(tmp_path)
    assert sorted(found) == ["gradual", "plain"]
    plain = {r["seed"]: r for r in found["plain"]}
    assert plain[2]["recall"] == [(800, 0.99), (1100, 0.60)]
    assert plain[1]["needle"][2048]["mean"] == pytest.approx(0.25)
    assert plain[1]["needle"][1024]["min"] == pytest.approx(0.9375)
    assert plain[3]["needle"] == {}
    assert (
        recipe_results.summary_line(tmp_path / "plain" / "nsa_s1")
        == "L=1024: mean 0.96 min 0.94  L=2048: mean 0.25 min 0.00"
    )
    text = "\n".join(recipe_results.report(found))
    # plain: seeds 1 and 2 evaluated, mean of (0.9583, 0.0833); seed 1 alone reaches 0.90 at every depth.
    assert "2 evaluated: mean 0.52" in text and ">= 0.90 at every depth: 1" in text
    # gradual: 0.875 at one depth misses the target although its mean (0.958) is above 0.90.
    assert "1 evaluated: mean 0.96" in text.split("== plain")[0]
    assert ">= 0.90 mean: 1; >= 0.90 at every depth: 0" in text.split("== plain")[0]
    full = recipe_results.read(tmp_path, "full")
    assert list(full) == ["gradual"] and full["gradual"][0]["needle"][1024]["mean"] == 0.0


def test_a_signal_reaches_the_running_stages_once_and_nothing_new_starts(tmp_path, monkeypatch):
    runner = fake_runner(tmp_path, monkeypatch, ["import time; time.sleep(60)", "pass"], seeds=(1, 2, 3))
    runner.parallel = 2
    started = tmp_path / "started.txt"

    def stop_when_both_run():
        while not started.exists() or len(started.read_text().split()) < 2:
            threading.Event().wait(0.05)
        runner.on_signal(signal.SIGTERM, None)

    threading.Thread(target=stop_when_both_run, daemon=True).start()
    runner.run_all()
    assert sorted(runner.results.values()) == ["interrupted"] * 3
    assert sorted(started.read_text().split()) == ["1:1", "2:1"]  # no second stage, no third seed
    assert runner.signals == [(signal.SIGTERM, 2)]
    summary = (tmp_path / "o" / "r" / "summary.txt").read_text()
    assert summary.count("(by a signal, stage 1/2)") == 2
    assert runner.exit_status() == 143  # the stages did not save: killed by the signal


@pytest.mark.parametrize("stage_exit, status", [(0, 0), (3, 143)])
def test_after_sigterm_the_status_is_0_when_every_stopped_stage_exited_0(tmp_path, monkeypatch, stage_exit, status):
    # As launch.train: SIGTERM -> save, exit 0. The command then exits 0 too (a scheduler's stop is no failure).
    stage = (
        f"import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit({stage_exit})); time.sleep(60)"
    )
    runner = fake_runner(tmp_path, monkeypatch, [stage, "pass"], seeds=(1,))
    started = tmp_path / "started.txt"

    def stop_when_it_runs():
        while not started.exists():
            threading.Event().wait(0.05)
        threading.Event().wait(0.5)  # its handler is installed
        runner.on_signal(signal.SIGTERM, None)

    threading.Thread(target=stop_when_it_runs, daemon=True).start()
    runner.run_all()
    assert runner.stop_statuses == [stage_exit]
    assert runner.exit_status() == status


def test_a_bad_runbook_variable_is_named_before_anything_runs(tmp_path, capsys, monkeypatch):
    # launch.train reads NSA_* variables from the environment the stages run in; a bad one is
    # one error line before OUT exists, not a failed first stage in every run.
    monkeypatch.setenv("NSA_LR", "fast")
    err = error_of(capsys, ["--recipe", "smoke:two", "--seeds", "1", "--out", str(tmp_path / "o")])
    assert "NSA_LR='fast' must be a number" in err
    assert not (tmp_path / "o").exists()
    # A good one passes: the stages load with it.
    monkeypatch.setenv("NSA_LR", "1e-3")
    args = stages.build_parser().parse_args(["--recipe", "smoke:two", "--seeds", "1", "--out", str(tmp_path / "o")])
    _, _, (run,) = stages.plan(args)
    assert [s.seq_len for s in run.stages] == [128, 256]


def test_an_evaluation_left_unfinished_is_run_again(tmp_path):
    """launch.evaluate records the cells it has not finished; --resume keeps only a finished evaluation."""
    ev = tmp_path / "eval"
    assert not stages.evaluated(ev)
    ev.mkdir()
    doc = {"meta": {"pending": [["needle", 4096]]}, "needle": {"lengths": [1024], "accuracy": [[1.0]]}}
    (ev / "evaluation.json").write_text(json.dumps(doc))
    assert not stages.evaluated(ev)
    doc["meta"]["pending"] = []
    (ev / "evaluation.json").write_text(json.dumps(doc))
    assert stages.evaluated(ev)
    (ev / "evaluation.json").write_text(json.dumps({"needle": doc["needle"]}))  # written before pending was kept
    assert stages.evaluated(ev)
    (ev / "evaluation.json").write_text("{")  # unreadable: launch.evaluate is run, and says why
    assert not stages.evaluated(ev)


def test_the_command_s_training_time_is_projected_from_the_first_two_step_lines(tmp_path, monkeypatch, capsys):
    """Two runs, stages to steps 1 and 2 at T=256 (2 steps a run): a run's step lines 0.5 s apart
    project 4 steps of about 0.5 s over 2 runs at a time: about 1 s, said once."""
    code = "import time; print('step 1/2 | loss 1.0 | ETA 1s', flush=True); time.sleep(0.5); "
    code += "print('step 2/2 | loss 1.0 | ETA 0s', flush=True)"
    runner = fake_runner(tmp_path, monkeypatch, ["pass", code], seeds=(1, 2))
    runner.run_all()
    out = capsys.readouterr().out
    lines = [x for x in out.splitlines() if "projected: about" in x]
    assert len(lines) == 1, out
    want = r"projected: about (\d+)s of training for the command \(2 runs, 2 at a time\), "
    want += r"from ([\d.]+) s a step at T=256"
    m = re.search(want, lines[0])
    # The gap is read where the lines arrive: the first may be read late on a loaded host (0.49 s seen).
    assert m and 0.3 <= float(m[2]) < 1.5, lines[0]
    assert int(m[1]) == round(4 * float(m[2]) / 2), lines[0]
