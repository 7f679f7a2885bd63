"""Prefill + cached decode against the training forward pass (NSALM.apply on the whole sequence).

Every reference here is the model's full forward pass; the decode path is never
its own reference.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nsa_jax.config import Config
from nsa_jax.inference import decode_step, generate, init_cache, prefill, sample_logits
from nsa_jax.layers import rope
from nsa_jax.model import NSALM

from helpers import assert_close, scaled_atol, tiny_model_cfg

T = 70
PROMPT_LENS = np.array([1, 8, 13, 30])  # P=1; P = l (a block completes in the prompt); P % d, P % lp != 0; P > w
PREFILL_WIDTH = 32  # what `generate` pads these prompts to, so the compiled prefill is shared
MAX_LEN = int(PROMPT_LENS.max()) + T - 1
NEW_TOKENS = MAX_LEN - int(PROMPT_LENS.max())
CONFIGS = {
    # l=8, d=4, lp=8, w=12 with T=70: 16 compressed tokens, 9 selection blocks, well past the window.
    # One config per compressor: mean pooling (the configs' default) and the paper's MLP.
    "G1K2n5avg": dict(G=1, K=2, n=5, cmp_phi="avg"),
    "G3K1n4": dict(G=3, K=1, n=4),
    # The scorer that keeps a block's peak (kernels/scorers.py), its sub-block bounds in the cache
    # (sub-blocks of 4: prompts end inside one).
    "G3K1n4minmax": dict(G=3, K=1, n=4, scorer="minmax", scorer_sub=4),
    "G1K2n5mix": dict(G=1, K=2, n=5, cmp_phi="avg", scorer="mix"),
    # Two stages: cmp's best 6 of 9 blocks, re-ranked by their keys' exact mass from the cache.
    "G3K1n4rescore": dict(G=3, K=1, n=4, scorer="rescore", scorer_candidates=6),
}
_CAPTURE = ("attn_norm", "cmp_k", "cmp_v")
_refs: dict = {}


def _cfg(name):
    cfg = tiny_model_cfg(T_hint=T, l=8, d=4, lp=8, w=12, **CONFIGS[name])
    # A vocabulary that holds the byte tokenizer's ids, so the CLI test can share this model.
    return dataclasses.replace(cfg, vocab_size=264)


def _random_params(cfg, seed):
    """Params of the model's shapes filled from numpy (jitting the model's init is slow on CPU)."""
    shapes = jax.eval_shape(lambda: NSALM(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, cfg.nsa.l), jnp.int32)))
    rng = np.random.default_rng(seed)

    def leaf(path, s):
        x = rng.standard_normal(s.shape).astype(np.float32)
        # Norm scales near 1, everything else at the config's (large) init std.
        return jnp.asarray(1.0 + 0.1 * x if jax.tree_util.keystr(path).endswith("['scale']") else cfg.init_std * x)

    return jax.tree_util.tree_map_with_path(leaf, shapes["params"])


@functools.partial(jax.jit, static_argnums=0)
def _forward(cfg, params, tokens):
    """The training forward pass: logits, each layer's attention input and compressed tokens,
    and the raw (pre-RoPE) window and compression keys recomputed from that input and the params."""
    logits, st = NSALM(cfg).apply(
        {"params": params},
        tokens,
        capture_intermediates=lambda m, meth: meth == "__call__" and m.name in _CAPTURE,
        mutable=["intermediates"],
    )
    layers = st["intermediates"]["layers"]
    cap = {k: layers["attn"][k]["__call__"][0] for k in ("cmp_k", "cmp_v")}
    h_LxBxTxD = layers["attn_norm"]["__call__"][0]
    for name in ("k_win", "k_cmp"):
        kernel_LxDxN = params["layers"]["attn"][name]["kernel"]
        cap[name] = jnp.einsum("lbtd,ldn->lbtn", h_LxBxTxD, kernel_LxDxN, precision="highest")
    return logits, cap


def _reference(name):
    """cfg, params, tokens [B, T] and the full forward's logits and captured projections."""
    if name not in _refs:
        cfg = _cfg(name)
        tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(0), (len(PROMPT_LENS), T), 0, cfg.vocab_size))
        params = _random_params(cfg, 1)
        logits, cap = _forward(cfg, params, tokens)
        _refs[name] = (cfg, params, tokens, np.asarray(logits), jax.tree.map(np.asarray, cap))
    return _refs[name]


def _roped(cfg, x_LxBxTxKD):
    L, B, T_, KD = x_LxBxTxKD.shape
    K = cfg.n_kv_heads
    x = jnp.asarray(x_LxBxTxKD).reshape(L * B, T_, K, KD // K)
    return np.asarray(rope(x, jnp.arange(T_), cfg.rope_theta)).reshape(L, B, T_, K, KD // K)


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "name",
    [pytest.param("G1K2n5avg", marks=SLOW), "G3K1n4", "G3K1n4minmax", pytest.param("G1K2n5mix", marks=SLOW)]
    + ["G3K1n4rescore"],
)
def test_decode_matches_forward_at_every_position(name):
    """Prefill P tokens (a different P per row), then decode to T - 1: every position's logits match."""
    cfg, params, tokens, ref, _ = _reference(name)
    B = len(PROMPT_LENS)
    P = PREFILL_WIDTH
    # Rows shorter than P are padded with wrong tokens: their stale cache entries differ
    # from the true ones and must never be read before decode overwrites them.
    padded = np.where(np.arange(P)[None, :] < PROMPT_LENS[:, None], tokens[:, :P], (tokens[:, :P] + 5) % cfg.vocab_size)
    assert np.any(padded != tokens[:, :P])
    logits, cache = prefill(cfg, params, padded, PROMPT_LENS, max_len=MAX_LEN)
    err = np.zeros((B, T))
    err[np.arange(B), PROMPT_LENS - 1] = np.abs(np.asarray(logits) - ref[np.arange(B), PROMPT_LENS - 1]).max(-1)
    compiled = None
    for step in range(T - 1):
        pos = PROMPT_LENS + step
        feed = np.where(pos < T, np.asarray(tokens)[np.arange(B), np.minimum(pos, T - 1)], 0)
        logits, cache = decode_step(cfg, params, cache, jnp.asarray(feed, jnp.int32))
        if compiled is None:
            compiled = decode_step._cache_size()
        lo = np.asarray(logits)
        for b in np.nonzero(pos < T)[0]:
            err[b, pos[b]] = np.abs(lo[b] - ref[b, pos[b]]).max()
    # The position is data: no recompilation while positions advance.
    assert decode_step._cache_size() == compiled
    np.testing.assert_array_equal(np.asarray(cache.pos_B), PROMPT_LENS + T - 1)
    worst = np.unravel_index(np.argmax(err), err.shape)
    assert err.max() < scaled_atol(ref, 1e-4), f"row {worst[0]} position {worst[1]}: max |logit diff| {err.max():.2e}"


def test_cache_boundaries_follow_the_forward():
    """From an empty cache: compressed tokens appear exactly when their block completes, equal to
    the forward's compressor outputs; the window ring holds exactly [max(0, t-w+1), t]; the raw
    compression tail holds the last l positions; logits match at every position (P = 0)."""
    cfg, params, tokens, ref, cap = _reference("G3K1n4")
    a = cfg.nsa
    B = len(PROMPT_LENS)
    kwin = _roped(cfg, cap["k_win"])
    kraw = _roped(cfg, cap["k_cmp"])
    kc_ref, vc_ref = cap["cmp_k"], cap["cmp_v"]  # [L, B, Tc(T), K, D]
    cache = init_cache(cfg, B, MAX_LEN)
    R = cache.kwin_LxBxRxKxDk.shape[2]
    assert R == a.w
    emitted = []
    for t in range(T):
        logits, cache = decode_step(cfg, params, cache, jnp.asarray(tokens[:, t], jnp.int32))
        assert_close(logits, ref[:, t], 1e-4, err_msg=f"t={t}")
        assert np.all(np.asarray(cache.pos_B) == t + 1)

        kc, vc = np.asarray(cache.kcmp_LxBxTcxKxDk), np.asarray(cache.vcmp_LxBxTcxKxDv)
        n_done = 0 if t + 1 < a.l else (t + 1 - a.l) // a.d + 1  # blocks with i*d + l - 1 <= t
        assert_close(kc[:, :, :n_done], kc_ref[:, :, :n_done], 1e-5, err_msg=f"t={t}")
        assert_close(vc[:, :, :n_done], vc_ref[:, :, :n_done], 1e-5, err_msg=f"t={t}")
        assert not np.any(kc[:, :, n_done:]), f"t={t}: a compressed token appeared before its block completed"
        emitted.append(n_done)

        lo = max(0, t - a.w + 1)
        win = np.asarray(cache.kwin_LxBxRxKxDk)
        for p in range(lo, t + 1):
            assert_close(win[:, :, p % R], kwin[:, :, p], 1e-5, err_msg=f"t={t} p={p}")
        if t + 1 < R:  # never-written slots stay empty
            assert not np.any(win[:, :, t + 1 :])

        tail = np.asarray(cache.ktail_LxBxlxKxDk)
        for p in range(max(0, t - a.l + 1), t + 1):
            assert_close(tail[:, :, p % a.l], kraw[:, :, p], 1e-5)
    # Completions at t = 7, 11, 15, ...: one new compressed token every d steps from t = l - 1.
    steps = np.nonzero(np.diff([0] + emitted))[0]
    np.testing.assert_array_equal(steps, np.arange(a.l - 1, T, a.d))


def _decode_max_err(cfg, params, tokens, ref, lengths, P, max_len, T_end):
    """Prefill right-padded prompts (row b: lengths[b] tokens), decode every row to T_end - 1:
    the largest |logit - forward logit| over every position after each prompt."""
    B = len(lengths)
    padded = np.where(np.arange(P)[None, :] < lengths[:, None], tokens[:, :P], (tokens[:, :P] + 3) % cfg.vocab_size)
    logits, cache = prefill(cfg, params, padded, lengths, max_len=max_len)
    err = np.abs(np.asarray(logits) - ref[np.arange(B), lengths - 1]).max()
    for step in range(T_end - int(lengths.min()) - 1):
        pos = lengths + step
        feed = tokens[np.arange(B), np.minimum(pos, T_end - 1)]
        logits, cache = decode_step(cfg, params, cache, jnp.asarray(feed, jnp.int32))
        live = pos < T_end
        err = max(err, np.abs(np.asarray(logits)[live] - ref[np.arange(B)[live], pos[live]]).max())
    return err


@pytest.mark.slow
@pytest.mark.parametrize("branches", [("cmp",), ("slc",), ("win",), ("cmp", "slc"), ("cmp", "win"), ("slc", "win")])
def test_decode_matches_forward_for_every_branch_subset(branches):
    """Each subset of branches (all three: the tests above): decode == the forward's logits,
    rows at different positions, prompts crossing compression/selection block boundaries."""
    T_end = 40
    cfg = tiny_model_cfg(T_hint=T_end, l=8, d=4, lp=8, w=12, G=2, K=2, n=3, branches=branches)
    params = _random_params(cfg, 2)
    tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(3), (3, T_end), 0, cfg.vocab_size))
    ref = np.asarray(_forward(cfg, params, tokens)[0])
    lengths = np.array([1, 9, 22])  # P = 1; one block done and one token past it; past the window
    err = _decode_max_err(cfg, params, tokens, ref, lengths, 24, T_end + 2, T_end)
    assert err < scaled_atol(ref, 1e-4), f"branches {branches}: max |logit diff| {err:.2e}"


@pytest.mark.slow
def test_decode_reads_compressed_buckets_across_their_boundary():
    """A cache with more compressed slots than the smallest read bucket: rows decode while the
    visible compressed tokens grow past it (the step switches buckets), and rows far behind the
    others share the larger read; logits equal the forward's throughout."""
    from nsa_jax.nsa.decode import CMP_BUCKET, cmp_buckets

    T_end = 8 - 1 + 4 * CMP_BUCKET + 6  # l - 1 + d * bucket: token number bucket + 1 completes at T_end - 6
    cfg = tiny_model_cfg(T_hint=T_end, l=8, d=4, lp=8, w=12, G=2, K=1, n=3)
    max_len = T_end + 24
    from nsa_jax.inference import cache_sizes

    assert len(cmp_buckets(cache_sizes(cfg, max_len).Tc)) > 1
    params = _random_params(cfg, 4)
    tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(5), (2, T_end), 0, cfg.vocab_size))
    ref = np.asarray(_forward(cfg, params, tokens)[0])
    lengths = np.array([T_end - 14, T_end - 12])
    err = _decode_max_err(cfg, params, tokens, ref, lengths, T_end - 12, max_len, T_end)
    assert err < scaled_atol(ref, 1e-4), f"max |logit diff| {err:.2e}"


# ---------------------------------------------------------------------------
# generation and the command line

# Byte lengths 1, 8, 13, 30 (PROMPT_LENS): the generation test reuses the programs compiled above.
_PROMPTS = ["a", "8 bytes.", "thirteen char", "a prompt longer than window w."]


def test_greedy_generation_agrees_with_the_forward_and_the_cli(tmp_path, capsys):
    """Greedy `generate` (rows of different lengths, per-row positions) picks the forward's argmax
    at every generated position; the CLI prints the same completions from a params.msgpack dir."""
    from launch.generate import main, write_inference_dir

    cfg, params, _, _, _ = _reference("G3K1n4")
    prompts = [list(p.encode()) for p in _PROMPTS]
    assert [len(p) for p in prompts] == list(PROMPT_LENS)
    V = cfg.vocab_size
    # What the CLI allows with the byte tokenizer: bytes and EOS (256), not PAD (257) or ids >= 258.
    allowed = (np.arange(V) < 258) & (np.arange(V) != 257)
    eos = 256
    outs = generate(cfg, params, prompts, NEW_TOKENS, temperature=0.0, allowed_V=allowed, eos_id=eos)

    # Teacher-forced check with the training forward on each generated sequence (first T positions).
    batch = np.zeros((len(prompts), T), np.int32)
    for b, (p, o) in enumerate(zip(prompts, outs)):
        seq = (p + o)[:T]
        batch[b, : len(seq)] = seq
    ref = np.asarray(_forward(cfg, params, batch)[0])
    pred = np.argmax(np.where(allowed, ref, -np.inf), axis=-1)
    for b, (p, o) in enumerate(zip(prompts, outs)):
        seq = p + o
        for q in range(len(p) - 1, min(T, len(seq))):
            if q + 1 < len(seq):
                assert pred[b, q] == seq[q + 1], f"row {b} position {q}"
            elif len(o) < NEW_TOKENS:  # the row stopped: the forward's next id is EOS
                assert pred[b, q] == eos, f"row {b} position {q}"
    assert sum(map(len, outs)) > 0

    ckpt = tmp_path / "ckpt"
    write_inference_dir(ckpt, Config(model=cfg), params)  # byte tokenizer: the default data config
    prompt_file = tmp_path / "prompts.txt"
    prompt_file.write_text("\n".join(_PROMPTS[:2]) + "\n\n" + "\n".join(_PROMPTS[2:]) + "\n")  # blank line skipped
    argv = ["--ckpt", str(ckpt), "--prompt-file", str(prompt_file), "--max-new-tokens", str(NEW_TOKENS)]
    assert main([*argv, "--temperature", "0"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [r["prompt"] for r in rows] == _PROMPTS
    assert [r["completion"] for r in rows] == [bytes(o).decode("utf-8", errors="replace") for o in outs]


def test_streamer_holds_back_partial_utf8():
    from launch.generate import _Streamer
    from nsa_jax.data.tokenizers import ByteTokenizer

    class Out(list):
        def write(self, s):
            self.append(s)

        def flush(self):
            pass

    out = Out()
    st = _Streamer(ByteTokenizer(), out)
    ids = list("hé€!".encode())
    for i, t in enumerate(ids):
        st(i, np.array([t]), np.array([True]))
    st(len(ids), np.array([256]), np.array([False]))  # EOS: row inactive, nothing printed
    st.finish()
    assert "".join(out) == "hé€!\n"
    assert all("\ufffd" not in piece for piece in out)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--prompt", "hi"], "--ckpt"),
        (["--ckpt", "/nonexistent/ckpt", "--prompt", "hi"], "does not exist"),
        (["--random-init", "--config", "cpu_tiny", "--prompt", ""], "empty"),
        (["--random-init", "--config", "cpu_tiny", "--prompt", "hi", "--temperature", "-0.5"], "--temperature"),
        (["--random-init", "--config", "cpu_tiny", "--prompt", "hi", "--top-p", "0"], "--top-p"),
        (["--random-init", "--config", "cpu_tiny", "--prompt", "hi", "--top-p", "1.5"], "--top-p"),
        (["--random-init", "--config", "cpu_tiny", "--prompt", "hi", "--max-new-tokens", "x"], "invalid int"),
        (["--random-init", "--config", "no_such_config", "--prompt", "hi"], "no config named"),
    ],
)
def test_cli_bad_input_is_one_error_line_and_exit_2(argv, needle, capsys):
    from launch.generate import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and needle in err, err


def test_cli_empty_prompt_file(tmp_path, capsys):
    from launch.generate import main

    f = tmp_path / "p.txt"
    f.write_text("\n  \n")
    assert main(["--random-init", "--config", "cpu_tiny", "--prompt-file", str(f)]) == 2
    assert "no non-blank line" in capsys.readouterr().err


def test_sampling_filters():
    logits = jax.random.normal(jax.random.PRNGKey(0), (4, 50)) * 3
    greedy = np.argmax(np.asarray(logits), -1)
    keys = jax.random.split(jax.random.PRNGKey(1), 64)
    np.testing.assert_array_equal(sample_logits(logits, keys[0], 0.0), greedy)
    np.testing.assert_array_equal(sample_logits(logits, keys[1], 1.0, 1e-6), greedy)
    # top-k over the allowed ids only: the best id of every row is banned.
    order = np.argsort(-np.asarray(logits), -1)
    allowed = np.ones(50, bool)
    allowed[order[:, 0]] = False
    seen = np.stack([np.asarray(sample_logits(logits, k, 1.0, 1.0, jnp.asarray(allowed), top_k=5)) for k in keys])
    for b in range(4):
        top5 = [int(i) for i in order[b] if allowed[i]][:5]
        assert set(seen[:, b].tolist()) <= set(top5)
    assert len(set(seen[:, 0].tolist())) > 1  # it does sample


def _inference_dir(tmp_path, name, dataset, seq_len):
    """A params.msgpack directory of the G3K1n4 model with the given training data and length."""
    from launch.generate import write_inference_dir

    cfg = _cfg("G3K1n4")
    base = Config()
    full = dataclasses.replace(
        base,
        model=cfg,
        train=dataclasses.replace(base.train, seq_len=seq_len),
        data=dataclasses.replace(base.data, dataset=dataset),
    )
    write_inference_dir(tmp_path / name, full, _random_params(cfg, 1))
    return str(tmp_path / name)


@pytest.mark.slow
def test_cli_notes_and_prefill_progress(tmp_path, capsys, monkeypatch):
    """A synthetic-data checkpoint and a prompt beyond the training length: one note each, before the
    prefill; a prefill longer than the quiet interval is reported while it runs and when it ends."""
    import time

    from launch.generate import build_parser, main, notes
    from nsa_jax.inference import decode, progress

    prompt = _PROMPTS[3]  # 30 bytes
    synthetic = _inference_dir(tmp_path, "synthetic", "synthetic", seq_len=16)
    real_prefill = decode.prefill

    def slow_prefill(*a, **k):
        time.sleep(0.5)
        return real_prefill(*a, **k)

    monkeypatch.setattr(decode, "prefill", slow_prefill)
    monkeypatch.setattr(progress, "QUIET_S", 0.1)
    monkeypatch.setattr(progress, "REPEAT_S", 0.1)
    argv = ["--prompt", prompt, "--max-new-tokens", "4", "--temperature", "0"]
    assert main(["--ckpt", synthetic, *argv]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(prompt) and out.endswith("\n") and "note" not in out and "prefill" not in out
    lines = err.splitlines()
    remarks = [line for line in lines if line.startswith("note: ")]
    assert remarks == [
        "note: this checkpoint was trained on synthetic data (data.dataset=synthetic: Markov-chain token rows, "
        "not text): expect noise, not text; a language model trains on text (data.dataset=text, jsonl, "
        "fineweb_edu or tokenized)",
        "note: the prompt is 30 tokens, 1.9x the training length (train.seq_len=16): positions from 16 on were "
        "never trained, so expect the completion to degrade (docs/LONG_CONTEXT.md)",
    ]
    ticks = [line for line in lines if line.startswith("prefill of 30 prompt tokens: ")]
    assert ticks[0] == "prefill of 30 prompt tokens: 0s so far" and len(ticks) >= 3, err
    assert ticks[-1].startswith("prefill of 30 prompt tokens: done in ") and ticks[-1].endswith(" tokens/s)")
    assert lines.index(remarks[-1]) < lines.index(ticks[0])  # the notes come before the work

    # A file of prompts in two batches: each batch's phases are named.
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{prompt}\n{prompt.upper()}\n")  # the same compiled programs as above
    assert main(["--ckpt", synthetic, "--prompt-file", str(prompts), "--batch-size", "1", *argv[2:]]) == 0
    out, err = capsys.readouterr()
    assert [json.loads(line)["prompt"] for line in out.splitlines()] == [prompt, prompt.upper()]
    assert "batch 1/2: prefill of 30 prompt tokens: 0s so far" in err.splitlines()
    assert "batch 2/2: prefill of 30 prompt tokens: 0s so far" in err.splitlines()
    assert "note: the longest prompt is 30 tokens (2 of 2 go beyond), 1.9x the training length" in err

    # Text data within the training length: no note; prompt + new tokens beyond it: one note.
    monkeypatch.setattr(decode, "prefill", real_prefill)
    monkeypatch.setattr(progress, "QUIET_S", 10.0)
    text = _inference_dir(tmp_path, "text", "text", seq_len=32)
    assert main(["--ckpt", text, *argv]) == 0
    assert capsys.readouterr().err.splitlines() == [
        "note: the prompt and --max-new-tokens 4 reach 34 tokens, 1.1x the training length (train.seq_len=32): "
        "positions from 32 on were never trained, so expect the text to degrade from there (docs/LONG_CONTEXT.md)"
    ]
    assert main(["--ckpt", _inference_dir(tmp_path, "long", "text", seq_len=64), *argv]) == 0
    assert capsys.readouterr().err == ""  # nothing to remark, and a quick run prints no progress
    # --random-init trained nothing: no note.
    args = build_parser().parse_args(["--random-init", "--config", "cpu_tiny", "--prompt", "x"])
    assert notes(args, Config(), [[1] * 5000]) == []


def test_progress_reports_long_activities_only():
    import time

    from nsa_jax.inference.progress import Progress
    from nsa_jax.progress_text import fmt_duration

    lines = []
    with Progress(lines.append, quiet_s=0.1, repeat_s=0.1) as p:
        p.doing("short")
        p.done()
        p.doing("long", count=(500, "tokens"))
        time.sleep(0.6)
        p.done()
        p.doing("streamed")
        for _ in range(40):  # output of its own every 10 ms: no line needed
            p.touch()
            time.sleep(0.01)
        n = [0]
        p.doing(lambda: f"decoding: {n[0]} of 9")
        n[0] = 3
        time.sleep(0.3)
    assert not [line for line in lines if line.startswith(("short", "streamed"))], lines
    long = [line for line in lines if line.startswith("long")]
    assert long[0] == "long: 0s so far" and len(long) >= 3, lines
    assert re.fullmatch(r"long: done in \ds \([\d,]+ tokens/s\)", long[-1]), long
    # A callable activity is read at each line: the tokens so far.
    assert lines[-2] == "decoding: 3 of 9: 0s so far" and re.fullmatch(r"decoding: 3 of 9: done in \ds", lines[-1])
    assert [fmt_duration(s) for s in (4.4, 83, 7500)] == ["4s", "1m23s", "2h05m"]


def test_a_long_call_says_what_it_does_every_10_s_as_the_readme_says():
    from nsa_jax.inference import progress

    # After 10 s of silence, then every 10 s while it lasts (README "Other commands", launch.generate --help).
    assert progress.QUIET_S == progress.REPEAT_S == 10.0
    readme = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert "a long prefill says what it is doing every 10 s" in " ".join(readme.split())
    p = progress.Progress(lambda line: None)
    assert (p.quiet_s, p.repeat_s) == (10.0, 10.0)
