"""Long-context evaluation: the needle format, the scoring, the suites with stub scorers, the command line."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time

import jax
import numpy as np
import pytest

from nsa_jax.config import load_config, replace
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


@pytest.mark.slow
def test_model_scorer_matches_logits(tmp_path):
    """nll/hit of the compiled scorer against a numpy log-softmax of the model's forward logits."""
    from nsa_jax.evaluation.scorer import ModelScorer, make_score_fn
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
    # Logits made 40 positions at a time (95 targets: two whole chunks and a padded one).
    nll_c, hit_c = jax.jit(make_score_fn(cfg, chunk=40))(params, tokens)
    np.testing.assert_allclose(nll_c, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(hit_c, logits.argmax(-1) == tokens[:, 1:])


@pytest.mark.slow
def test_chunked_scores_of_an_untied_head_match_its_whole_logits():
    """scored_chunks with lm_head's own kernel (tie_embeddings false) against numpy over the whole logits."""
    from nsa_jax.evaluation.scorer import scored_chunks

    cfg = load_config("cpu_tiny", [*SMALL, "model.tie_embeddings=false"]).model
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 70, cfg.d_model)).astype(np.float32)
    w = (rng.standard_normal((cfg.d_model, cfg.vocab_size)) * 0.3).astype(np.float32)
    targets = rng.integers(0, cfg.vocab_size, (2, 70))
    logits = x.astype(np.float64) @ w.astype(np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    params = {"lm_head": {"kernel": w}}
    nll, hit = jax.jit(lambda p, *a: scored_chunks(cfg, p, *a, chunk=32))(params, x, targets)
    np.testing.assert_allclose(nll, -np.take_along_axis(logp, targets[..., None], -1)[..., 0], rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(hit, logits.argmax(-1) == targets)


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
    # The results are never overwritten: other settings are refused.
    again = _cli(*args, "--out", str(out))
    assert again.returncode == 2 and again.stderr.strip().splitlines() == [
        f"error: --out {out} holds the evaluation.json of another evaluation (rows 2 there, 4 here); run it with "
        "the settings it was made with to continue it, or pass another --out"
    ]


@pytest.mark.slow
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
    from nsa_jax.data.targets import LabeledRows, row_targets

    (tmp_path / "hay.txt").write_text(HAY)
    over = ["data.dataset=needle", f"data.path={tmp_path / 'hay.txt'}", "train.seq_len=200", "train.global_batch=3"]
    over.append("data.needle_answer_weight=7.5")
    cfg = load_config("cpu_tiny", over)
    ds = make_dataset(cfg, "train")
    batch = next(ds)
    assert isinstance(batch, LabeledRows)  # the weights ride beside the tokens: no tokenizer in the step
    first = batch.tokens
    assert first.shape == (3, 201) and first.dtype == np.int32
    for row in first:
        text = TOK.decode(row)
        key = text[-5:]
        assert key.isdigit() and text.endswith(QUESTION + key) and f"The pass key is {key}. Remember" in text
    tokens, weight, answers = (np.asarray(x) for x in row_targets(batch, cfg))
    np.testing.assert_array_equal(tokens, first)
    # The key's targets, found in the text: the targets (tokens 1..200) that are the last five characters.
    expected = np.ones((3, 200), np.float32)
    for i, row in enumerate(first):
        key_at = len(TOK.decode(row)) - 5  # byte tokenizer: character index = token index
        expected[i, key_at - 1 :] = 7.5
    np.testing.assert_array_equal(weight, expected)
    np.testing.assert_array_equal(answers, expected == 7.5)
    state = ds.get_state()
    second = next(ds)
    ds.set_state(state)
    for got, want in zip(next(ds), second):
        np.testing.assert_array_equal(got, want)
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


def test_a_suite_that_takes_more_rows_than_the_text_holds_says_its_rows_repeat(tmp_path):
    """A needle/passkey haystack per --samples and a loss-by-position row per --rows: where the --text file
    holds fewer distinct rows of L + 1 tokens, one note per (suite, L) says how many repeat it."""
    from launch.evaluate import build_parser, repeat_notes
    from nsa_jax.evaluation.suites import TextRows

    f = tmp_path / "hay.txt"
    f.write_text("".join(f"{i:04d}" for i in range(250)))  # bytes: 1,000 tokens, and 2 of the blank line after
    cfg = load_config("cpu_tiny", ["train.seq_len=256"])
    text = TextRows(cfg, [str(f)])
    # 1,002 tokens: 3 rows of 256 (and 234 more) at L = 255, 2 of 501 at L = 500, none of 1,025 at L = 1,024.
    argv = ["--ckpt", "x", "--text", str(f), "--lengths", "255,500,1024", "--samples", "3", "--rows", "2"]
    got = repeat_notes(build_parser().parse_args([*argv, "--suites", "passkey,loss-by-position,text"]), text)
    assert got == [
        "note: passkey at L=500: --text holds 2 rows of 501 tokens, so 1 of its 3 rows (--samples) repeats that "
        "text; give more text (--text FILE ...) for rows that differ",
        "note: passkey at L=1,024: --text holds 0 rows of 1,025 tokens, so 3 of its 3 rows (--samples) repeat "
        "that text; give more text (--text FILE ...) for rows that differ",
        "note: loss-by-position at L=1,024: --text holds 0 rows of 1,025 tokens, so 2 of its 2 rows (--rows) "
        "repeat that text; give more text (--text FILE ...) for rows that differ",
    ]
    rows = text(255, 4)  # the 4th: the last 234 tokens, then the text's first 22 again
    assert len({r.tobytes() for r in rows[:3]}) == 3 and (rows[3][234:] == rows[0][:22]).all()
    assert repeat_notes(build_parser().parse_args(argv[:-6] + ["--lengths", "255"]), TextRows(cfg)) == []


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


# ---------------------------------------------------------------------------
# launch.evaluate keeps each (suite, L) as it is done, projects its time, and stops on a signal


def _key(**over):
    """The comparability key of an evaluation of CFG (results.make_settings), with `over` changed."""
    from nsa_jax.evaluation.results import make_settings

    kw = dict(config=CFG.to_dict(), weights="w1", depths=DEPTHS, samples=2, rows=4, seed=0, text=[])
    return make_settings(**{**kw, **over})


def _suite_settings(samples=2):
    from nsa_jax.evaluation.suites import Settings

    return Settings(CFG, text_rows, tuple(DEPTHS), samples, 4, 0)


def test_results_are_written_after_every_cell_and_read_back_to_skip_them(tmp_path):
    from nsa_jax.evaluation.results import RESULTS_FILE, Results, describe, unfinished
    from nsa_jax.evaluation.suites import cell

    st, stub = _suite_settings(), Stub(lambda row: needle_at(row) is not None and needle_at(row) < len(row) // 2)
    path = tmp_path / RESULTS_FILE
    first = Results(tmp_path, _key(), st, {"ckpt": "ck"})
    assert first.read() == [] and not path.exists()
    first.add("needle", 200, cell(stub, "needle", 200, st), 1.5, pending=[("loss-by-position", 200), ("needle", 400)])
    doc = json.loads(path.read_text())
    assert doc["needle"]["lengths"] == [200] and doc["meta"]["seconds"] == {"needle": {"200": 1.5}}
    assert unfinished(path) == [("loss-by-position", 200), ("needle", 400)]
    first.add("loss-by-position", 200, cell(stub, "loss-by-position", 200, st), 0.5, pending=[("needle", 400)])
    # The same evaluation again: what is on disk is done, the rest is not.
    again = Results(tmp_path, _key(), st, {"ckpt": "ck"})
    assert sorted(again.read()) == [("loss-by-position", 200), ("needle", 200)]
    assert again.done("needle", 200) and not again.done("needle", 400)
    again.add("needle", 400, cell(stub, "needle", 400, st), 2.0, pending=[])
    doc = json.loads(path.read_text())
    whole = run_suites(stub, CFG, ["needle", "loss-by-position"], [200, 400], text=text_rows, depths=DEPTHS)
    assert doc["needle"] == whole["needle"]  # cells joined as the suites join them
    assert doc["loss-by-position"]["by_length"] == {"200": whole["loss-by-position"]["by_length"]["200"]}
    assert unfinished(path) == [] and doc["meta"]["seconds"]["needle"] == {"200": 1.5, "400": 2.0}
    assert describe(again.cells) == "needle, loss-by-position at L=200; needle at L=400"


def test_results_of_other_settings_are_refused_in_one_line(tmp_path):
    from nsa_jax.evaluation.results import RESULTS_FILE, Mismatch, Results
    from nsa_jax.evaluation.suites import cell

    st = _suite_settings()
    Results(tmp_path, _key(), st, {}).add("needle", 200, cell(Stub(lambda r: True), "needle", 200, st), 1.0, [])
    path = tmp_path / RESULTS_FILE
    before = path.read_bytes()
    fix = "run it with the settings it was made with to continue it, or pass another --out"
    other = f"--out {tmp_path} holds the {RESULTS_FILE} of another evaluation"
    cases = {
        "samples 2 there, 3 here": _key(samples=3),
        "the weights (another checkpoint, or another step of it)": _key(weights="w2"),
        "seed 0 there, 1 here; the text": _key(seed=1, text=[__file__]),
        "model.nsa.w 16 there, 32 here": _key(config=replace(CFG, ["model.nsa.w=32"]).to_dict()),
    }
    for said, key in cases.items():
        with pytest.raises(Mismatch) as e:
            Results(tmp_path, key, st, {}).read()
        assert str(e.value) == f"{other} ({said}); {fix}"
    path.write_text(json.dumps({"needle": {"lengths": [200]}}))  # an evaluation.json from before settings were kept
    with pytest.raises(Mismatch, match=r"records no settings \(an older evaluation\), so it cannot be continued"):
        Results(tmp_path, _key(), st, {}).read()
    path.write_bytes(before)
    assert Results(tmp_path, _key(), st, {}).read() == [("needle", 200)]


def test_a_write_that_fails_midway_leaves_the_previous_file_whole(tmp_path, monkeypatch):
    from nsa_jax.evaluation import results
    from nsa_jax.evaluation.suites import cell

    st, stub = _suite_settings(), Stub(lambda r: True)
    kept = results.Results(tmp_path, _key(), st, {})
    kept.add("needle", 200, cell(stub, "needle", 200, st), 1.0, [])
    before = (tmp_path / results.RESULTS_FILE).read_bytes()

    class HalfWrite:
        """A file that takes half the text, then fails, as a crash or a full disk would leave it."""

        def __init__(self, path, *args, **kwargs):
            self.f = open(path, *args, **kwargs)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            self.f.write(text[: len(text) // 2])
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(results, "open", HalfWrite, raising=False)
    with pytest.raises(OSError, match="No space left"):
        kept.add("needle", 400, cell(stub, "needle", 400, st), 1.0, [])
    assert (tmp_path / results.RESULTS_FILE).read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [results.RESULTS_FILE]  # no partial file left behind
    assert ("needle", 400) not in kept.kept  # a stop now names only what the file holds


def test_projections_from_a_shorter_length_and_from_the_first_batch():
    from launch.evaluate import projection_line
    from nsa_jax.evaluation.timing import CostModel, Rates, query_keys
    from nsa_jax.info import keys_per_query

    rates = Rates(lambda L: L * L)
    assert np.isnan(rates.per_batch(100)[0])  # nothing measured: nothing projected
    rates.add(100, 2.0)
    scaled = "scaled from L=100's 2.0s a batch by the attention cost model"
    assert rates.per_batch(100) == (2.0, "measured") and rates.per_batch(200) == (8.0, scaled)
    assert rates.per_batch(50) == (0.5, scaled)  # the shortest measured length above, when none is below
    assert rates.total([(200, 3), (100, 1)]) == 26.0
    assert projection_line(200, "length 2 of 3", rates, 3, [(400, 2)]) == (
        f"L=200: length 2 of 3: projected 24s for this length, 1m28s for the command ({scaled})"
    )
    rates.add(200, 10.0)  # its first batch took longer than projected: the rest follows the measurement
    # Two lengths measured: time grew 5x for 4x the cost, so the cost ratio is raised to log 5 / log 4,
    # and a batch at 400 (4x the cost again) is projected at 10 s x 5 = 50 s.
    assert rates.exponent() == pytest.approx(math.log(5) / math.log(4))
    assert rates.per_batch(400)[0] == pytest.approx(50.0)
    assert projection_line(200, "first batch 10s", rates, 2, [(400, 2)]) == (
        "L=200: first batch 10s: projected 20s for this length, 2m00s for the command (this length's first batch; "
        "the longer ones scaled by the attention cost model)"
    )
    assert projection_line(200, "first batch 10s", rates, 0, [(400, 2)]) == (
        "L=200: first batch 10s: projected 1m40s for the rest of the command (this length's first batch; "
        "the longer ones scaled by the attention cost model)"
    )
    slower = Rates(lambda L: L * L)  # growth below the cost model's is held at the model's
    slower.add(100, 2.0), slower.add(200, 4.0)
    assert slower.exponent() == 1.0 and slower.per_batch(400)[0] == 16.0
    # The cost model: the XLA path (CPU) scores every compressed token for every query; the kernels read the causal
    # keys. Both grow the cost of a row faster than its length.
    tiny = CFG.model
    a = tiny.nsa
    assert query_keys(tiny, 4096, "cpu") == (4096 - a.l) // a.d + 1 + a.n * a.lp + a.query_chunk + a.w - 1
    gpu = load_config("a100_pcie").model
    assert query_keys(gpu, 4096, "gpu") == keys_per_query(gpu, 4096)["nsa_total"]
    # Dense attention (a pretrained model as imported): every earlier key, or a window of them.
    dense = dataclasses.replace(tiny, attention="dense")
    assert query_keys(dense, 4096, "cpu") == a.query_chunk + 4096 - 1  # a chunk of queries against every key
    assert query_keys(dataclasses.replace(gpu, attention="dense"), 4096, "gpu") == 4097 / 2
    assert query_keys(dataclasses.replace(dense, dense_window=100), 4096, "cpu") == a.query_chunk + 99
    cost = CostModel(tiny, 1_000_000, "cpu")
    assert cost.dense == 2 * (1_000_000 - tiny.vocab_size * tiny.d_model)
    assert cost(100_000) / cost(256) > 3 * 100_000 / 256


def test_a_stop_signal_says_what_was_kept_and_exits_as_training_does():
    import os
    import signal
    import threading

    from nsa_jax.ops.preemption import QuitOnSignal

    for sig, status in ((signal.SIGTERM, 0), (signal.SIGINT, 130)):
        said, codes, ended = [], [], threading.Event()
        guard = QuitOnSignal(lambda name: f"stopped by {name}", said.append, lambda c: (codes.append(c), ended.set()))
        before = signal.getsignal(sig)
        guard.install()
        try:
            os.kill(os.getpid(), sig)
            assert ended.wait(5), f"{sig.name} did not end it"
        finally:
            guard.uninstall()
        assert said == [f"stopped by {sig.name}"] and codes == [status]
        assert signal.getsignal(sig) is before
    # A second signal while the first one's line waits (a write finishing): quits at once.
    release, said, codes, ended = threading.Event(), [], [], threading.Event()

    def slow_line(name):
        release.wait(5)
        return "late"

    guard = QuitOnSignal(slow_line, said.append, lambda c: (codes.append(c), ended.set()))
    guard.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGINT)
        assert ended.wait(5)
    finally:
        release.set()
        guard.uninstall()
    assert said[0] == "SIGINT again: quitting now" and codes[0] == 130


def test_the_same_command_skips_what_its_out_folder_holds(tmp_path, capsys):
    """In process, a tiny model: the same command again skips what evaluation.json holds and says so (one that
    adds a length: test_a_stopped_long_evaluation...; one with other settings: test_cli_end_to_end)."""
    from launch.evaluate import main
    from launch.generate import write_inference_dir
    from nsa_jax.inference.decode import inference_config
    from nsa_jax.info import param_shapes

    # A checkpoint directory of random weights drawn on the host: nothing compiles an initialisation.
    cfg = load_config("cpu_tiny", SMALL)
    rng = np.random.default_rng(0)
    shapes = param_shapes(inference_config(cfg.model))
    write_inference_dir(tmp_path / "ckpt", cfg, jax.tree.map(lambda x: 0.02 * rng.standard_normal(x.shape), shapes))
    text = tmp_path / "hay.txt"
    text.write_text(HAY)
    out = tmp_path / "eval"
    argv = ["--ckpt", str(tmp_path / "ckpt"), "--text", str(text), "--no-progress", "--out", str(out)]
    argv += ["--suites", "loss-by-position,kv_recall", "--rows", "1", "--batch-size", "1"]
    assert main([*argv, "--lengths", "256,128"]) == 0
    first = capsys.readouterr()
    assert "L=128: length 1 of 2, batches of 1 row: loss-by-position 1, kv_recall 1: " in first.err
    assert re.search(
        r"^L=256: length 2 of 2, .*: projected [\d.]+s for this length \(scaled from L=128's ", first.err, re.M
    )
    assert "skipping" not in first.err
    doc = json.loads((out / "evaluation.json").read_text())
    assert list(doc["kv_recall"]["by_length"]) == ["128", "256"] and doc["meta"]["pending"] == []
    # The same command again: nothing to run; the summary and the figures come from the file.
    assert main([*argv, "--lengths", "256,128"]) == 0
    again = capsys.readouterr()
    skip = f"skipping loss-by-position, kv_recall at L=128, 256: in {out / 'evaluation.json'} already"
    assert again.err.splitlines() == [f"{skip} (the same weights and settings)"], again.err
    assert f"nothing to run: {out / 'evaluation.json'} holds every result asked for" in again.out
    assert "kv_recall L=256: " in again.out and json.loads((out / "evaluation.json").read_text()) == doc


# A launch.evaluate started as a terminal starts it: SIGINT at its default action (a background job of a
# script inherits it ignored; exec keeps the default this sets). No preexec_fn: this process has jax loaded.
WITH_SIGINT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.executable, sys.argv[1:])"
)


class Evaluate:
    """A `python -m launch.evaluate` subprocess whose stderr lines are read as they come (the progress bar's
    redraws cut off: a line is what follows its last carriage return)."""

    def __init__(self, args: list[str]):
        import subprocess
        import sys
        import threading

        from helpers import ROOT

        cmd = [sys.executable, "-c", WITH_SIGINT, sys.executable, "-m", "launch.evaluate", *args]
        env = cpu_env(devices=None)
        self.p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.err: list[str] = []
        self.out: list[str] = []
        self._out = threading.Thread(target=lambda: self.out.extend(self.p.stdout), daemon=True)
        self._out.start()

    def until(self, text: str, timeout: float = 300) -> str:
        deadline = time.monotonic() + timeout
        for raw in self.p.stderr:
            self.err.append(raw.rstrip("\n").rsplit("\r", 1)[-1])
            if text in self.err[-1]:
                return self.err[-1]
            if time.monotonic() > deadline:
                break
        self.p.kill()
        raise AssertionError(f"no line with {text!r} in:\n" + "\n".join(self.err))

    def finish(self, timeout: float = 60) -> int:
        rc = self.p.wait(timeout)
        self.err.extend(raw.rstrip("\n").rsplit("\r", 1)[-1] for raw in self.p.stderr)
        self._out.join(10)
        return rc


@pytest.fixture
def start_evaluate():
    """Evaluate(args) for the test, killing any still running when it ends: a failed assertion would
    otherwise leave an evaluation at L=100,000 (hours) running after the test."""
    started: list[Evaluate] = []

    def start(args: list[str]) -> Evaluate:
        started.append(Evaluate(args))
        return started[-1]

    yield start
    for e in started:
        if e.p.poll() is None:
            e.p.kill()
            e.p.wait(30)


@pytest.mark.slow
def test_a_stopped_long_evaluation_keeps_what_it_did_and_the_same_command_continues(tmp_path, start_evaluate):
    """cpu_tiny at L=256 then 100,000 (minutes a batch on a CPU): SIGTERM once 256 is done and 100,000 started
    ends it at once (exit 0), keeping L=256 and naming the command; that command skips 256, projects 100,000 from
    one timed batch at 1,024, and a Ctrl-C ends it with 130."""
    import shlex
    import signal

    from launch.generate import write_inference_dir
    from nsa_jax.model import init_params

    cfg = load_config("cpu_tiny")
    write_inference_dir(tmp_path / "ckpt", cfg, jax.jit(lambda k: init_params(cfg.model, k))(jax.random.PRNGKey(0)))
    (tmp_path / "hay.txt").write_text(HAY)
    out = tmp_path / "eval"
    results = out / "evaluation.json"
    args = ["--ckpt", str(tmp_path / "ckpt"), "--lengths", "256,100000", "--suites", "loss-by-position"]
    args += ["--rows", "1", "--batch-size", "1", "--text", str(tmp_path / "hay.txt"), "--out", str(out)]
    again = f"run the same command: python -m launch.evaluate {shlex.join(args)}"

    first = start_evaluate(args)
    line = first.until("L=100,000: length 2 of 2")
    # fmt_duration's forms: a batch at 100,000 takes minutes to hours on a CPU, days on one shared with other work
    minutes = r"(\d+d\d\dh|\d+h\d\dm|\d+m\d\ds)"
    # L=256 alone is too short to project from: one batch is timed at 1,024 first, and the growth from
    # 256 to 1,024 scales the cost model's ratio.
    assert "L=100,000: timing one batch at L=1,024 first, to project how long L=100,000 takes" in first.err
    scaled = rf": projected {minutes} for this length \(scaled from L=1,024's [\d.]+s a batch by the"
    assert re.search(scaled, line), line
    assert any(x.startswith("L=256: done in ") for x in first.err), first.err
    t_sent = time.monotonic()
    first.p.send_signal(signal.SIGTERM)
    assert first.finish() == 0, first.err
    assert time.monotonic() - t_sent < 15  # at once: not after the batch in flight, which takes minutes
    stops = [x for x in first.err if "stopped by" in x]
    assert stops == [
        f"stopped by SIGTERM: {results} keeps loss-by-position at L=256 (1 added by this run); to continue from "
        f"L=100,000 {again}"
    ], first.err
    kept = json.loads(results.read_text())
    assert list(kept["loss-by-position"]["by_length"]) == ["256"]
    assert kept["meta"]["pending"] == [["loss-by-position", 100000]]

    second = start_evaluate(args)
    line = second.until("L=100,000: length 1 of 1")
    assert f"skipping loss-by-position at L=256: in {results} already (the same weights and settings)" in second.err
    assert "L=100,000: timing one batch at L=1,024 first, to project how long L=100,000 takes" in second.err
    assert re.search(rf": projected {minutes} for this length \(scaled from L=1,024's ", line), line
    assert not any(x.startswith("L=256: length") for x in second.err)
    second.p.send_signal(signal.SIGINT)
    assert second.finish() == 130, second.err
    assert [x for x in second.err if "stopped by" in x] == [
        f"stopped by SIGINT: {results} keeps loss-by-position at L=256 (0 added by this run); to continue from "
        f"L=100,000 {again}"
    ], second.err
    assert json.loads(results.read_text())["loss-by-position"] == kept["loss-by-position"]
