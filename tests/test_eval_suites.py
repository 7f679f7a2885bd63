"""launch.evaluate's suites for a pretrained model: `text` (loss and perplexity of a text) and `passkey`."""

from __future__ import annotations

import json
import re

import jax
import numpy as np
import pytest
from test_long_eval import CFG, DEPTHS, HAY, SMALL, TOK, Stub, needle_at, text_rows

from nsa_jax.data.needle import QUESTION, min_row_len, needle_pieces
from nsa_jax.evaluation import scoring
from nsa_jax.evaluation.suites import Settings, TextRows, cell, needle_rows, run_suites


class KnownNll:
    """A scorer whose nll of each target is a known function of the token it reads and the token it predicts."""

    def __init__(self, batch=2):
        self.batch, self.rows = batch, []

    def prepare(self, L):
        return 0

    @staticmethod
    def nll(inputs, targets):
        return 0.1 * (np.asarray(targets) % 7) + 0.01 * (np.asarray(inputs) % 5) + 0.5

    def __call__(self, tokens_BxT1):
        assert len(tokens_BxT1) == self.batch
        self.rows.extend(np.asarray(tokens_BxT1))
        return self.nll(tokens_BxT1[:, :-1], tokens_BxT1[:, 1:]), np.zeros(tokens_BxT1[:, 1:].shape, bool)


def _settings(text, **kw):
    return Settings(CFG, text, tuple(kw.pop("depths", DEPTHS)), kw.pop("samples", 2), 4, 0)


def test_text_loss_by_hand():
    r = scoring.text_loss(np.array([[1.0, 3.0], [2.0, 6.0]]))
    assert r["first"] == {"loss": 2.0, "ppl": pytest.approx(np.exp(2.0))}
    assert r["windows"] == {"loss": 3.0, "ppl": pytest.approx(np.exp(3.0)), "count": 2}
    # By position over the windows: position 0 (1 and 2) then position 1 (3 and 6).
    assert r["by_position"]["loss"] == [1.5, 4.5] and r["by_position"]["mean"] == 3.0
    with pytest.raises(ValueError, match="at least one of each"):
        scoring.text_loss(np.zeros((0, 4)))


def test_text_tokens_are_the_files_joined_by_a_blank_line(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("first file")
    b.write_text("second")
    rows = TextRows(CFG, [str(a), str(b)])
    assert TOK.decode(rows.text_tokens) == "first file\n\nsecond"
    assert TOK.decode(rows.tokens) == "first file\n\nsecond\n\n"  # the rows of the other suites, as before


def test_text_suite_against_a_numpy_reference(tmp_path):
    """The first window and all windows of a text, from a scorer whose nll is known, against numpy on the tokens."""
    f = tmp_path / "t.txt"
    f.write_text(HAY[:1000])
    st = _settings(TextRows(CFG, [str(f)]))
    tokens = np.asarray(TOK.encode(HAY[:1000]))
    for L in (64, 300):
        stub = KnownNll()
        got = cell(stub, "text", L, st)
        W = len(tokens) // L
        windows = [tokens[k * L : (k + 1) * L] for k in range(W)]
        # The standard definition: window w's L - 1 predictions, token t + 1 from tokens 0..t of the window.
        nll = np.stack([KnownNll.nll(w[:-1], w[1:]) for w in windows])
        assert got["first"]["loss"] == pytest.approx(nll[0].mean())
        assert got["first"]["ppl"] == pytest.approx(np.exp(nll[0].mean()))
        assert got["windows"]["loss"] == pytest.approx(nll.mean()) and got["windows"]["count"] == W
        assert got["windows"]["ppl"] == pytest.approx(np.exp(nll.mean())) and got["tokens"] == len(tokens)
        # The scorer read each window whole (plus the padding token it predicts last, left out), in order.
        assert len(stub.rows) == 2 * -(-W // 2)
        np.testing.assert_array_equal(np.stack(stub.rows[:W])[:, :L], np.stack(windows))
    with pytest.raises(ValueError, match="fewer than L=2,000"):
        cell(KnownNll(), "text", 2000, st)
    with pytest.raises(ValueError, match=r"the text suite needs text files \(--text"):
        cell(KnownNll(), "text", 64, _settings(text_rows))


def test_passkey_rows_hold_the_key_once_at_its_depth_and_exactly_l_tokens():
    L, samples = 300, 3
    built = needle_rows(text_rows, TOK, L, DEPTHS, samples, seed=0, extra=0)
    assert [(d, s) for d, s, _ in built] == [(d, s) for d in range(len(DEPTHS)) for s in range(samples)]
    keys = {s: r.value for d, s, r in built}
    assert len(set(keys.values())) == samples and all(re.fullmatch(r"[1-9]\d{4}", k) for k in keys.values())
    for d, s, r in built:
        assert r.tokens_T1.shape == (L,) and r.value == keys[s]  # one key per sample, the same at every depth
        needle, question, answer = needle_pieces(TOK, r.value)
        text = TOK.decode(r.tokens_T1)
        assert text.endswith(QUESTION + r.value)
        prompt = text[: -len(QUESTION + r.value)]
        # The key is stated once (its needle sentence), before the question; nowhere else in the filler.
        assert prompt.count("The pass key is") == 1 and prompt.count(r.value) == 2
        n_hay = L - len(needle) - len(question) - len(answer)
        assert needle_at(r.tokens_T1) == r.needle_pos == round(DEPTHS[d] * n_hay)
        # Around the needle: the sample's haystack, in order.
        hay = text_rows(L, samples)[s]
        rest = np.concatenate([r.tokens_T1[: r.needle_pos], r.tokens_T1[r.needle_pos + len(needle) : L - 44]])
        np.testing.assert_array_equal(rest, hay[: len(rest)])
    with pytest.raises(ValueError, match="needs L >="):
        needle_rows(text_rows, TOK, min_row_len(TOK) - 1, DEPTHS, 1, seed=0, extra=0)
    needle_rows(text_rows, TOK, min_row_len(TOK), DEPTHS, 1, seed=0, extra=0)  # the shortest passkey row


class MissAt:
    """Every target its argmax except the one at `miss` (an index into the L targets of a padded row)."""

    batch = 2

    def __init__(self, miss):
        self.miss = miss

    def prepare(self, L):
        return 0

    def __call__(self, tokens_BxT1):
        T = tokens_BxT1.shape[1] - 1
        hit = np.ones((len(tokens_BxT1), T), bool)
        hit[:, self.miss] = False
        return np.full(hit.shape, 0.5), hit


def test_passkey_suite_scores_the_answer_digits_of_a_row_read_whole():
    L = 200
    st = _settings(text_rows, depths=[0.0, 1.0], samples=2)
    # The answer's 5 digits are tokens L-5..L-1 of the row: targets L-6..L-2. A miss there fails the key; a miss
    # just before it, or at the padding token's target L-1, does not.
    for miss, acc in ((L - 6, 0.0), (L - 2, 0.0), (L - 7, 1.0), (L - 1, 1.0)):
        got = cell(MissAt(miss), "passkey", L, st)
        assert got["accuracy"] == [acc, acc], miss
        assert got["logprob"] == [pytest.approx(-5 * 0.5)] * 2


def test_passkey_suite_with_stub_scorers():
    lengths, samples = [200, 400], 3
    first_half = Stub(lambda row: needle_at(row) is not None and needle_at(row) < len(row) // 2)
    res = run_suites(first_half, CFG, ["passkey"], lengths, text=text_rows, depths=DEPTHS, samples=samples)["passkey"]
    assert res["lengths"] == lengths and res["depths"] == DEPTHS and res["samples"] == samples
    acc = np.array(res["accuracy"])
    for i, L in enumerate(lengths):
        built = needle_rows(text_rows, TOK, L, DEPTHS, samples, seed=0, extra=0)
        # The stub gets the row of L tokens and a padding token: its needle, as it reads it.
        oks = np.array([needle_at(r.tokens_T1) < (L + 1) // 2 for _, _, r in built]).reshape(len(DEPTHS), samples)
        np.testing.assert_allclose(acc[i], oks.mean(axis=1))
        assert res["accuracy_by_length"][i] == pytest.approx(oks.mean())
    assert acc[:, 0].tolist() == [1.0, 1.0] and acc[1, -1] == 0.0  # the stub's shape: early depths retrieved


def test_passkey_keeps_each_prompt_and_two_models_are_compared_prompt_by_prompt(tmp_path, capsys):
    """Each row's answer is kept beside the means; `--agree` counts, per length and depth, the prompts both stubs
    get right, from the needle's place in each row (found from its tokens), not from the suite's own counts."""
    from launch.evaluate import main
    from nsa_jax.evaluation.results import make_settings

    lengths, samples = [200, 400], 3
    rules = {"early": lambda at, L: at < 0.3 * L, "late": lambda at, L: at > 0.15 * L}  # early / late needles
    docs = {}
    for name, rule in rules.items():
        res = run_suites(
            Stub(lambda row, rule=rule: rule(needle_at(row), len(row))),
            CFG,
            ["passkey"],
            lengths,
            text=text_rows,
            depths=DEPTHS,
            samples=samples,
        )
        settings = make_settings({"name": name}, name, DEPTHS, samples, 4, 0, [])
        # A cell without rows in both files (a text cell), which `--agree` passes over.
        docs[name] = {"meta": {"settings": settings}, **res, "text": {"by_length": {"200": {"loss": 3.0}}}}
        (tmp_path / name).mkdir()
        (tmp_path / name / "evaluation.json").write_text(json.dumps(docs[name]))
    for i, L in enumerate(lengths):
        built = needle_rows(text_rows, TOK, L, DEPTHS, samples, seed=0, extra=0)
        at = [needle_at(r.tokens_T1) for _, _, r in built]
        early = [rules["early"](a, L + 1) for a in at]
        late = [rules["late"](a, L + 1) for a in at]
        kept = docs["early"]["passkey"]["rows"][str(L)]
        assert [(r["depth"], r["sample"], r["right"]) for r in kept] == [
            (DEPTHS[d], s, h) for (d, s, _), h in zip(built, early)
        ]
        assert [r["logprob"] for r in kept] == pytest.approx([5 * np.log(0.9 if h else 0.01) for h in early])
        both = sum(h and t for h, t in zip(early, late))
        alone = sum(t and not h for h, t in zip(early, late))
        assert 0 < both < sum(early) and alone > 0  # the rules disagree both ways at this length
        assert main(["--agree", str(tmp_path / "early"), str(tmp_path / "late")]) == 0
        out = capsys.readouterr().out
        # The stubs' key log p: 5 log 0.9 where right, 5 log 0.01 where not.
        gap = sum(5 * (t - h) * np.log(0.9 / 0.01) for h, t in zip(early, late)) / len(at)
        lower = sum(h and not t for h, t in zip(early, late))
        assert (
            f"passkey L={L}: BASE right on {sum(early)} of {len(at)}, OTHER on {sum(late)}; both on {both} "
            f"({both / sum(early):.2f} of BASE's right answers); OTHER alone on {alone}; log p(key) OTHER - BASE: "
            f"mean {gap:+.2f}, lower on {lower} of {len(at)}"
        ) in out
        d0 = [k for k, (d, _, _) in enumerate(built) if d == 0]
        assert f"  depth 0: BASE {sum(early[k] for k in d0)} of {samples}, OTHER {sum(late[k] for k in d0)}," in out
    # Other prompts, or files without each row's answer: one line, exit status 2.
    docs["late"]["meta"]["settings"]["seed"] = 1
    (tmp_path / "late" / "evaluation.json").write_text(json.dumps(docs["late"]))
    assert main(["--agree", str(tmp_path / "early"), str(tmp_path / "late")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the two evaluations asked different prompts (seed 0 there, 1 here)"), err
    del docs["early"]["passkey"]["rows"]
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "evaluation.json").write_text(json.dumps(docs["early"]))
    assert main(["--agree", str(tmp_path / "old"), str(tmp_path / "early")]) == 2
    assert "share no needle or passkey cell with each row's answer kept" in capsys.readouterr().err
    assert main(["--agree", str(tmp_path / "old"), str(tmp_path / "none")]) == 2
    assert "no readable evaluation.json" in capsys.readouterr().err


def _tiny_model(tmp_path):
    """A tiny model folder of random weights drawn on the host, and its (config, params)."""
    from launch.generate import write_inference_dir
    from nsa_jax.config import load_config
    from nsa_jax.inference.decode import inference_config
    from nsa_jax.info import param_shapes

    cfg = load_config("cpu_tiny", SMALL)
    rng = np.random.default_rng(0)
    shapes = param_shapes(inference_config(cfg.model))
    params = jax.tree.map(lambda x: (0.05 * rng.standard_normal(x.shape)).astype(np.float32), shapes)
    write_inference_dir(tmp_path / "ckpt", cfg, params)
    return cfg, params


def _reference_nll(cfg, params, rows_NxL):
    """numpy: the nll of tokens 1..L-1 of each row from the model's logits of a forward over the row."""
    from nsa_jax.inference.decode import inference_config
    from nsa_jax.model import NSALM

    logits = np.asarray(NSALM(inference_config(cfg.model)).apply({"params": params}, rows_NxL), np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    return -np.take_along_axis(logp[:, :-1], rows_NxL[:, 1:, None], -1)[..., 0]


@pytest.mark.slow
def test_text_and_passkey_through_launch_evaluate_kept_and_continued(tmp_path, capsys):
    """In process, a tiny model: text figures against numpy on the model's own logits, passkey's grid, the same
    command skipping what evaluation.json holds, other settings and short texts refused in one line."""
    from launch.evaluate import main

    cfg, params = _tiny_model(tmp_path)
    text = tmp_path / "hay.txt"
    text.write_text(HAY[:700])
    out = tmp_path / "eval"
    argv = ["--ckpt", str(tmp_path / "ckpt"), "--text", str(text), "--no-progress", "--out", str(out)]
    argv += ["--depths", "0,1", "--samples", "1", "--batch-size", "2"]
    assert main([*argv, "--suites", "text", "--lengths", "128"]) == 0
    first = capsys.readouterr()
    assert "L=128: length 1 of 1, batches of 2 rows: text 3: " in first.err
    doc = json.loads((out / "evaluation.json").read_text())
    got = doc["text"]["by_length"]["128"]
    tokens = np.asarray(TOK.encode(HAY[:700]), np.int32)
    nll = _reference_nll(cfg, params, tokens[: 5 * 128].reshape(5, 128))
    assert got["first"]["loss"] == pytest.approx(nll[0].mean(), rel=1e-5)
    assert got["windows"] == {
        "loss": pytest.approx(nll.mean(), rel=1e-5),
        "ppl": pytest.approx(np.exp(nll.mean()), rel=1e-5),
        "count": 5,
    }
    assert re.search(r"^text L=128: first 128 tokens loss [\d.]+ ppl [\d.]+ \| 5 windows loss ", first.out, re.M)
    # Passkey added to the same folder: text at 128 is skipped, passkey runs at both lengths, text at 256.
    assert main([*argv, "--suites", "text,passkey", "--lengths", "128,256"]) == 0
    second = capsys.readouterr()
    assert f"skipping text at L=128: in {out / 'evaluation.json'} already (the same weights and settings)" in second.err
    assert "L=128: length 1 of 2, batches of 2 rows: passkey 1: " in second.err
    assert "L=256: length 2 of 2, batches of 2 rows: text 1, passkey 1: " in second.err
    doc2 = json.loads((out / "evaluation.json").read_text())
    assert doc2["text"]["by_length"]["128"] == got and doc2["text"]["by_length"]["256"]["windows"]["count"] == 2
    pk = doc2["passkey"]
    assert pk["lengths"] == [128, 256] and pk["depths"] == [0.0, 1.0] and len(pk["accuracy_by_length"]) == 2
    assert (out / "passkey.png").stat().st_size > 1000 and doc2["meta"]["pending"] == []
    assert re.search(r"^passkey accuracy \(1 per cell\), depths 0, 1:$", second.out, re.M)
    # The same command again: nothing runs.
    assert main([*argv, "--suites", "text,passkey", "--lengths", "128,256"]) == 0
    assert capsys.readouterr().err.splitlines() == [
        f"skipping passkey, text at L=128, 256: in {out / 'evaluation.json'} already (the same weights and settings)"
    ]
    # Other settings, a text shorter than L, or no text: one error line each, exit status 2, the file untouched.
    other = [*argv[:-4], "--samples", "2", "--batch-size", "2"]
    assert main([*other, "--suites", "passkey", "--lengths", "128"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds the evaluation.json of another evaluation (samples 1 there, 2 here)" in err[0]
    assert main([*argv, "--suites", "text", "--lengths", "128,1024"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --text {text} holds 700 tokens (the model's tokenizer), fewer than L=1,024; "
        "drop L=1,024 from --lengths or give a longer text"
    )
    no_text = ["--ckpt", str(tmp_path / "ckpt"), "--suites", "text", "--lengths", "128", "--no-progress"]
    assert main(no_text) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --suites text needs --text FILE [FILE ...]: the text whose loss it measures"
    )
    # A folder, a binary file and a missing one as --text: the file named, and the fix.
    (tmp_path / "bin.txt").write_bytes(b"text\xff\xfe\x00 more")
    for bad, said in (
        (tmp_path, f"error: --text {tmp_path} is a folder; name its text files (e.g. --text {tmp_path}/*.txt)"),
        (tmp_path / "bin.txt", f"error: --text {tmp_path / 'bin.txt'} is not UTF-8 text (byte 4 does not decode)"),
        (tmp_path / "nope.txt", f"error: --text {tmp_path / 'nope.txt'} not found; name a UTF-8 text file"),
    ):
        assert main([*argv[:3], str(bad), *argv[4:], "--suites", "text", "--lengths", "128"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(said), err
    assert json.loads((out / "evaluation.json").read_text()) == doc2
