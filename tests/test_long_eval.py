"""Long-context evaluation: the needle format, the scoring, the suites with stub scorers, the command line."""

from __future__ import annotations

import json
import re

import jax
import numpy as np
import pytest

from nsa_jax.config import load_config
from nsa_jax.data.needle import QUESTION, answer_mask, make_needle_row, needle_pieces
from nsa_jax.data.tokenizers import ByteTokenizer
from nsa_jax.evaluation import scoring
from nsa_jax.evaluation.suites import run_suites

from helpers import cpu_env, run_module, set_flags

# The model of the tests that build one: one layer, narrow.
SMALL = ["model.n_layers=1", "model.d_model=48", "model.d_ff=64"]
TOK = ByteTokenizer()
HAY = "Grass grows. The sky is blue. Water flows downhill and the sun sets in the west. " * 40


def text_rows(L, n):
    """n rows of L + 1 byte tokens of HAY, each starting at its own offset."""
    ids = np.asarray(TOK.encode(HAY * (2 + (n * (L + 1)) // len(HAY))), np.int32)
    return np.stack([ids[7 * i : 7 * i + L + 1] for i in range(n)])


def needle_at(row_T1):
    """Index of the needle's first token in a row, found from the tokens alone (None: no needle)."""
    hits = [m.start() for m in re.finditer(r"The pass key is \d{5}\. Remember", TOK.decode(row_T1))]
    assert len(hits) <= 1  # byte tokens: a character index is a token index
    return hits[0] if hits else None


class Stub:
    """A scorer whose answers are known: `retrieves(row) -> bool` says whether it gets a row right.

    Where it retrieves, every target is its argmax with probability 0.9; elsewhere every
    target has probability 0.01 and is never the argmax.
    """

    def __init__(self, retrieves, batch=3):
        self.retrieves, self.batch, self.calls = retrieves, batch, 0

    def prepare(self, L):
        return 0

    def __call__(self, tokens_BxT1):
        assert len(tokens_BxT1) == self.batch
        self.calls += 1
        ok_B = np.array([self.retrieves(r) for r in tokens_BxT1])
        T = tokens_BxT1.shape[1] - 1
        nll = np.where(ok_B[:, None], -np.log(0.9), -np.log(0.01)) * np.ones((1, T))
        return nll, np.repeat(ok_B[:, None], T, axis=1)


CFG = load_config("cpu_tiny", ["data.kv_pairs=4", "data.kv_queries=2", "model.nsa.w=16"])
DEPTHS = [0.0, 0.25, 0.5, 0.75, 1.0]


def test_needle_row_layout():
    L = 300
    hay = text_rows(L, 1)[0]
    for depth in (0.0, 0.5, 1.0):
        row = make_needle_row(hay, L, depth, "12345", TOK)
        needle, question, answer = needle_pieces(TOK, "12345")
        n_hay = L + 1 - len(needle) - len(question) - len(answer)
        assert row.tokens_T1.shape == (L + 1,)
        assert row.needle_pos == round(depth * n_hay) == needle_at(row.tokens_T1)
        assert TOK.decode(row.tokens_T1[row.answer_start :]) == "12345"
        text = TOK.decode(row.tokens_T1)
        assert text.endswith(QUESTION + "12345") and text.count("The pass key is 12345.") == 1
        # The answer mask marks the targets (tokens[1:]) that are the answer.
        assert TOK.decode(row.tokens_T1[1:][answer_mask(row)]) == "12345"
    with pytest.raises(ValueError, match="needs L >="):
        make_needle_row(hay, 50, 0.5, "12345", TOK)


def test_scoring_by_hand():
    assert scoring.log2_edges(8) == [0, 1, 2, 4, 8]
    assert scoring.log2_edges(6) == [0, 1, 2, 4, 6]
    # nll = position: buckets [0,1) [1,2) [2,4) [4,8) -> 0, 1, 2.5, 5.5
    r = scoring.loss_by_position(np.tile(np.arange(8.0), (3, 1)))
    assert r["loss"] == [0.0, 1.0, 2.5, 5.5] and r["tokens"] == [3, 3, 6, 12]
    nll = np.array([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    hit = np.array([[False, True, True], [True, False, True]])
    ans = np.array([[False, True, True], [False, True, True]])
    lp, exact = scoring.answer_scores(nll, hit, ans)
    assert lp.tolist() == [-5.0, -5.0] and exact.tolist() == [True, False]
    # kv: queries at key positions 20 and 30, pairs at 18 (distance 2) and 3 (distance 27).
    hit_BxT = np.zeros((1, 32), bool)
    hit_BxT[0, 20] = True
    r = scoring.kv_by_distance(hit_BxT, np.array([[18, 3]]), np.array([[20, 30]]), 32)
    assert r["edges"] == [[2, 4], [16, 32]] and r["accuracy"] == [1.0, 0.0] and r["mean"] == 0.5


@pytest.mark.parametrize(
    "name, retrieves",
    [
        ("always", lambda row: True),
        ("never", lambda row: False),
        ("first half", lambda row: needle_at(row) is not None and needle_at(row) < len(row) // 2),
    ],
)
def test_suites_with_stub_scorers(name, retrieves):
    lengths, samples = [200, 400], 3
    stub = Stub(retrieves)
    res = run_suites(stub, CFG, ["needle"], lengths, text=text_rows, depths=DEPTHS, samples=samples)["needle"]
    acc, logp = np.array(res["accuracy"]), np.array(res["logprob"])
    assert acc.shape == logp.shape == (2, 5)
    # Independent expectation of each cell, from the needle positions of freshly built rows.
    for i, L in enumerate(lengths):
        for j, depth in enumerate(DEPTHS):
            oks = [
                retrieves(make_needle_row(text_rows(L, samples)[s], L, depth, "11111", TOK).tokens_T1)
                for s in range(samples)
            ]
            assert acc[i, j] == pytest.approx(np.mean(oks))
            n_answer = 5
            want = np.mean([n_answer * np.log(0.9) if ok else n_answer * np.log(0.01) for ok in oks])
            assert logp[i, j] == pytest.approx(want)
    if name == "first half":  # the stub's shape: early depths retrieved, late ones not
        assert acc[:, 0].tolist() == [1.0, 1.0] and acc[1, -1] == 0.0
    assert stub.calls == 2 * -(-(5 * samples) // stub.batch)


def test_loss_and_kv_suites_with_stubs():
    res = run_suites(Stub(lambda r: True), CFG, ["loss-by-position", "kv_recall"], [64, 128], text=text_rows, rows=4)
    for L in ("64", "128"):
        lbp = res["loss-by-position"]["by_length"][L]
        assert lbp["edges"][-1] == int(L) and all(v == pytest.approx(-np.log(0.9)) for v in lbp["loss"])
        assert res["kv_recall"]["by_length"][L]["mean"] == 1.0
    res = run_suites(Stub(lambda r: False), CFG, ["kv_recall"], [64], text=text_rows, rows=4)
    kv = res["kv_recall"]["by_length"]["64"]
    assert kv["mean"] == 0.0 and sum(kv["answers"]) == 4 * 2
    # Every answered distance lies beyond the window (kv_recall's layout).
    assert min(lo for lo, _ in kv["edges"]) >= 16 // 2


def test_figures_and_json_cells(tmp_path):
    from nsa_jax.report.plots import evaluation_figures, save_figures

    stub = Stub(lambda row: needle_at(row) is not None and needle_at(row) < len(row) // 2)
    res = run_suites(stub, CFG, ["needle", "loss-by-position"], [200, 400], text=text_rows, depths=DEPTHS, samples=2)
    figs = evaluation_figures(res)
    assert set(figs) == {"needle", "loss_by_position"}
    # The heatmap's cells are the accuracy grid: row i = lengths[i], column j = depths[j].
    image = np.asarray(figs["needle"].axes[0].images[0].get_array())
    np.testing.assert_array_equal(image, np.array(res["needle"]["accuracy"]))
    labels = [t.get_text() for t in figs["needle"].axes[0].get_yticklabels()]
    assert labels == ["200", "400"]
    paths = save_figures(figs, tmp_path)
    assert all(p.stat().st_size > 1000 for p in paths.values())
    (tmp_path / "e.json").write_text(json.dumps(res))
    back = json.loads((tmp_path / "e.json").read_text())
    assert back["needle"]["accuracy"][0][0] == 1.0 and back["needle"]["accuracy"][1][-1] == 0.0


def test_model_scorer_matches_logits(tmp_path):
    """nll/hit of the compiled scorer against a numpy log-softmax of the model's forward logits."""
    from nsa_jax.evaluation.scorer import ModelScorer
    from nsa_jax.inference.decode import inference_config
    from nsa_jax.model import NSALM, init_params

    cfg = load_config("cpu_tiny", SMALL).model
    params = jax.jit(lambda k: init_params(cfg, k))(jax.random.PRNGKey(0))
    tokens = text_rows(96, 2)
    nll, hit = ModelScorer(cfg, params, 2)(tokens)
    forward = jax.jit(NSALM(inference_config(cfg)).apply)
    logits = np.asarray(forward({"params": params}, tokens[:, :-1]), np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    want = -np.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(nll, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(hit, logits.argmax(-1) == tokens[:, 1:])


def _cli(*args):
    return run_module("launch.evaluate", *args, env=cpu_env(devices=None), timeout=300)


TINY = set_flags(SMALL)


@pytest.mark.slow
def test_cli_end_to_end(tmp_path):
    """A tiny checkpoint directory evaluated by `python -m launch.evaluate`: JSON and PNGs with every cell."""
    from launch.generate import write_inference_dir
    from nsa_jax.model import init_params

    cfg = load_config("cpu_tiny", [*SMALL, "model.nsa.w=16"])
    write_inference_dir(tmp_path / "ckpt", cfg, jax.jit(lambda k: init_params(cfg.model, k))(jax.random.PRNGKey(0)))
    text = tmp_path / "hay.txt"
    text.write_text(HAY)
    out = tmp_path / "eval"
    args = ["--ckpt", str(tmp_path / "ckpt"), "--lengths", "128,256", "--depths", "0,0.5,1", "--text", str(text)]
    proc = _cli(*args, "--samples", "2", "--rows", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "needle accuracy" in proc.stdout and "evaluate" in proc.stderr  # the summary and the progress bar
    # cpu_tiny trains on synthetic data: said once, on stderr; 128 and 256 are within its training length.
    assert proc.stderr.count("note: this checkpoint was trained on synthetic data") == 1
    assert "beyond the training length" not in proc.stderr
    res = json.loads((out / "evaluation.json").read_text())
    assert res["needle"]["lengths"] == [128, 256] and res["needle"]["depths"] == [0.0, 0.5, 1.0]
    acc = np.array(res["needle"]["accuracy"])
    assert acc.shape == (2, 3)
    for L, row in zip([128, 256], acc):  # one summary line per L, with the mean and the worst depth
        want = f"L={L:>6}: " + " ".join(f"{a:.2f}" for a in row) + f" | mean {row.mean():.2f} min {row.min():.2f} |"
        assert sum(want in line for line in proc.stdout.splitlines()) == 1, (want, proc.stdout)
    assert list(res["loss-by-position"]["by_length"]) == ["128", "256"]
    assert res["loss-by-position"]["by_length"]["256"]["edges"][-1] == 256
    assert set(res["kv_recall"]["by_length"]) == {"128", "256"}
    assert res["meta"]["compiled_bytes"]["256"] > 0
    assert {p.name for p in out.glob("*.png")} == {"needle.png", "loss_by_position.png", "kv_recall.png"}
    # The results are never overwritten.
    again = _cli(*args, "--out", str(out))
    assert again.returncode == 2 and again.stderr.strip().splitlines() == [
        f"error: --out {out} already holds evaluation.json; pass another --out or move it away"
    ]


def test_over_memory_length_is_refused(tmp_path, capsys):
    from launch.evaluate import main

    text = tmp_path / "hay.txt"
    text.write_text(HAY)
    argv = ["--random-init", "--config", "cpu_tiny", *TINY, "--text", str(text), "--no-progress"]
    argv += ["--suites", "loss-by-position", "--out", str(tmp_path / "eval"), "--batch-size", "1"]
    # 128 fits in 20 MB, 4096 (logits alone: 4096 x 256 x 4 bytes = 4.2 MB, x several) does not.
    assert main([*argv, "--lengths", "128,4096", "--device-memory", "4000000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: L=4096 needs ") and "4.00 MB (given limit)" in err[0]
    assert not (tmp_path / "eval").exists()


@pytest.mark.slow
def test_training_runs_the_suites_and_the_report_shows_them(tmp_path):
    """eval.suites during `launch.train`: long_eval.csv and TensorBoard get the figures, launch.report prints them."""
    from nsa_jax.report.reading import load_run

    out = tmp_path / "run"
    sets = [*SMALL, "train.seq_len=128", "train.global_batch=2", "train.eval_every=2", "train.eval_batches=1"]
    sets += ["eval.suites=needle,loss-by-position", "eval.lengths=128,256", "eval.depths=0,1", "eval.samples=1"]
    proc = run_module("launch.train", "--config", "cpu_tiny", "--steps", "2", "--out-dir", str(out), *set_flags(sets))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"^long eval: step 2 \| needle_acc_L128 \d\.\d{3} ", proc.stdout, re.M), proc.stdout
    lines = (out / "long_eval.csv").read_text().splitlines()
    header = lines[0].split(",")
    assert header == [
        "step",
        "tokens",
        "needle_acc_L128",
        "needle_acc_L256",
        "needle_logp_L128",
        "needle_logp_L256",
        "loss_L128",
        "loss_L256",
        "loss_far_L128",
        "loss_far_L256",
        "long_eval_s",
    ]
    row = dict(zip(header, lines[1].split(",")))
    assert len(lines) == 2 and row["step"] == "2" and 0 <= float(row["needle_acc_L256"]) <= 1
    assert float(row["needle_logp_L128"]) < 0 and float(row["loss_far_L256"]) > 0
    assert any(b"long/needle_acc_L256" in f.read_bytes() for f in (out / "tb").rglob("*") if f.is_file())
    assert load_run(out).long_eval["loss_L256"] == pytest.approx(float(row["loss_L256"]), rel=1e-5)
    report = run_module("launch.report", str(out))
    assert re.search(r"^long eval \(step 2\): needle_acc_L128 \d\.\d{3}, ", report.stdout, re.M), report.stdout


def test_scalars_name_the_long_eval_columns(tmp_path):
    from nsa_jax.evaluation.suites import scalars
    from nsa_jax.report.reading import load_run
    from nsa_jax.report.text import long_eval_line
    from nsa_jax.rundir import files as rf

    res = run_suites(Stub(lambda r: True), CFG, ["needle", "loss-by-position", "kv_recall"], [200], text=text_rows)
    got = scalars(res)
    cols = rf.long_eval_columns(["needle", "loss-by-position", "kv_recall"], [200])
    assert set(got) == set(cols) - {"step", "tokens", "long_eval_s"}
    assert got["needle_acc_L200"] == 1.0 and got["kv_acc_L200"] == 1.0
    assert got["loss_far_L200"] == pytest.approx(-np.log(0.9))
    w = rf.CsvWriter(tmp_path / rf.LONG_EVAL_CSV, cols)
    w.write({"step": 4, "tokens": 100, **got, "long_eval_s": 1.5})
    w.close()
    line = long_eval_line(load_run(tmp_path))
    assert line.startswith("long eval (step 4): needle_acc_L200 1.000, needle_logp_L200 -0.527, ")


def test_text_rows_from_the_validation_split(tmp_path):
    """Without files the rows come from the run's val split through the data pipeline, at any length."""
    from nsa_jax.evaluation.suites import TextRows

    for i in range(4):
        (tmp_path / f"doc{i}.txt").write_text(f"Document {i}. " + HAY)
    over = ["data.dataset=text", f"data.path={tmp_path}", "data.val_fraction=0.99", "model.vocab_size=320"]
    cfg = load_config("cpu_tiny", over)
    rows = TextRows(cfg)(300, 2)
    assert rows.shape == (2, 301) and rows.dtype == np.int32
    assert "Water flows downhill" in TOK.decode(rows[0])
    # Files given instead: the text itself, cut in order.
    rows = TextRows(cfg, [str(tmp_path / "doc0.txt")])(100, 2)
    assert TOK.decode(rows[0]) == ("Document 0. " + HAY)[:101]


def test_needle_training_source_and_its_loss_weights(tmp_path):
    """`dataset: needle`: rows in the evaluation's format, every target in the loss, the key weighted; exact state."""
    from nsa_jax.data import make_dataset
    from nsa_jax.data.targets import loss_weights

    (tmp_path / "hay.txt").write_text(HAY)
    over = ["data.dataset=needle", f"data.path={tmp_path / 'hay.txt'}", "train.seq_len=200", "train.global_batch=3"]
    over.append("data.needle_answer_weight=7.5")
    cfg = load_config("cpu_tiny", over)
    ds = make_dataset(cfg, "train")
    first = next(ds)
    assert first.shape == (3, 201) and first.dtype == np.int32
    for row in first:
        text = TOK.decode(row)
        key = text[-5:]
        assert key.isdigit() and text.endswith(QUESTION + key) and f"The pass key is {key}. Remember" in text
    weight = np.asarray(loss_weights(first, cfg))
    # The key's targets, found in the text: the targets (tokens 1..200) that are the last five characters.
    expected = np.ones((3, 200), np.float32)
    for i, row in enumerate(first):
        key_at = len(TOK.decode(row)) - 5  # byte tokenizer: character index = token index
        expected[i, key_at - 1 :] = 7.5
    np.testing.assert_array_equal(weight, expected)
    state = ds.get_state()
    second = next(ds)
    ds.set_state(state)
    np.testing.assert_array_equal(next(ds), second)
    assert not np.array_equal(next(make_dataset(cfg, "val")), first)


def test_cli_notes_lengths_beyond_training_and_synthetic_data():
    """One note names the lengths beyond train.seq_len; one says the checkpoint saw synthetic data where
    a suite reads text; --random-init (nothing trained) gets neither."""
    from launch.evaluate import build_parser, notes

    def args(*extra):
        return build_parser().parse_args(["--ckpt", "x", *extra])

    cfg = load_config("cpu_tiny", ["train.seq_len=256"])  # data.dataset: synthetic
    got = notes(args("--lengths", "128,512,4096"), cfg)
    assert got == [
        "note: L=512 (2.0x), L=4,096 (16x) are beyond the training length (train.seq_len=256): positions from 256 "
        "on were never trained, so expect lower scores there (docs/LONG_CONTEXT.md)",
        "note: this checkpoint was trained on synthetic data (data.dataset=synthetic: Markov-chain token rows, not "
        "text): the needle rows' text and question are new to it, so expect needle accuracy near 0",
    ]
    assert notes(args("--lengths", "256", "--suites", "kv_recall,loss-by-position"), cfg) == []
    text = notes(args("--lengths", "300", "--suites", "loss-by-position", "--text", __file__), cfg)
    assert text[0].startswith("note: L=300 (1.2x) is beyond the training length (train.seq_len=256)")
    assert text[1].endswith("not text): the --text files are text it never learned")
    rope = load_config("cpu_tiny", ["train.seq_len=256", "train.rope_positions=1024", "data.dataset=text"])
    assert notes(args("--lengths", "1024"), rope) == [
        "note: L=1,024 (4.0x) is beyond the training length (train.seq_len=256; RoPE positions up to 1,023, "
        "train.rope_positions): rows longer than 256 tokens were never trained, so expect lower scores there "
        "(docs/LONG_CONTEXT.md)"
    ]
    assert notes(build_parser().parse_args(["--random-init", "--lengths", "4096"]), cfg) == []


def test_progress_bar_is_redrawn_while_nothing_advances_it():
    import time

    from launch.evaluate import _redrawn

    class Bar:
        n = 0

        def refresh(self):
            self.n += 1

    bar = Bar()
    with _redrawn(bar, every=0.05):
        time.sleep(0.4)
    after = bar.n
    time.sleep(0.15)
    assert after >= 3 and bar.n == after  # redrawn while inside, not after
