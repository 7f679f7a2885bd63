"""launch.convert and train.init_from: a pretrained checkpoint becomes a model folder the commands read.

The tiny Llama 2 of tests/golden/pretrained/ (with a byte-level tokenizer written here) is
converted dense and NSA. Dense: the folder's parameters give transformers' logits (the
golden). NSA: with every block selected (T <= n * lp) and the selection gate started at
sigmoid(9), the converted model's logits are the dense model's up to the other gates'
1e-4 share. Bad input: one `error:` line, exit 2, nothing written.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers

from launch.convert import main as convert
from nsa_jax.config import load_config
from nsa_jax.inference import generate
from nsa_jax.model import NSALM
from nsa_jax.rundir import model_dir
from nsa_jax.rundir.resume import check_init_from

from helpers import cpu_env, run_module

GOLDEN = pathlib.Path(__file__).parent / "golden" / "pretrained"


def _hf_folder(tmp_path: pathlib.Path, family: str = "llama2") -> pathlib.Path:
    """The golden tiny model with a tokenizer.json of its 256 ids (a word-level vocabulary)."""
    src = tmp_path / family
    shutil.copytree(GOLDEN / family, src)
    vocab = {f"w{i}": i for i in range(255)} | {"</s>": 255}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    (src / "tokenizer.json").write_text(tok.to_str())
    return src


def _logits(folder: pathlib.Path, ids) -> np.ndarray:
    cfg = load_config(str(folder / model_dir.CONFIG_FILE), saved=True)
    params = model_dir.read_params(folder)
    return np.asarray(NSALM(cfg.model).apply({"params": params}, jnp.asarray(ids)))


def test_converted_folders_give_the_dense_logits(tmp_path, capsys):
    src = _hf_folder(tmp_path)
    golden = np.load(src / "golden.npz")
    assert convert([str(src), str(tmp_path / "dense"), "--attention", "dense"]) == 0
    assert convert([str(src), str(tmp_path / "nsa"), "--set", "model.nsa.w=16"]) == 0
    dense = _logits(tmp_path / "dense", golden["input_ids"])
    np.testing.assert_allclose(dense, golden["logits"], rtol=1e-5, atol=2e-5)
    nsa = _logits(tmp_path / "nsa", golden["input_ids"])
    assert np.abs(nsa - dense).max() < 5e-3 * np.abs(dense).max()
    saved = load_config(str(tmp_path / "nsa" / model_dir.CONFIG_FILE), saved=True)
    assert saved.model.attention == "nsa" and saved.model.nsa.w == 16
    assert saved.model.nsa.scorer == "rescore"  # launch.convert's scorer (docs/PRETRAINED.md)
    assert json.loads((tmp_path / "nsa" / "special_tokens.json").read_text())["eos"] == 2
    assert saved.data.tokenizer == "tokenizer.json"  # relative: the folder's own file, wherever it is moved
    assert model_dir.read_config(tmp_path / "nsa").data.tokenizer == str(
        (tmp_path / "nsa" / "tokenizer.json").absolute()
    )
    assert "wrote" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize(
    "family,pattern,kept",
    [
        ("gemma3", "6 layers (1 global, 5 local over 10 keys", (6, 10, 10000.0)),
        ("gemma2", "2 layers (1 global, 1 local over 12 keys", (2, 12, 0.0)),
    ],
)
def test_a_gemma_converts_to_nsa_with_its_local_layers_kept(tmp_path, capsys, family, pattern, kept):
    # The local layers stay window attention over their sliding window (not NSA's w = 16), the global ones
    # turn NSA (Gemma 2's with its capped scores, on XLA); prefill + cached decode of the NSA model gives
    # the greedy tokens of full forwards.
    src = _hf_folder(tmp_path, family)
    golden = np.load(src / "golden.npz")
    assert convert([str(src), str(tmp_path / "dense"), "--attention", "dense"]) == 0
    capsys.readouterr()
    assert convert([str(src), str(tmp_path / "nsa"), "--set", "model.nsa.w=16"]) == 0
    assert f"{pattern}: their window branch alone)" in capsys.readouterr().out
    dense = _logits(tmp_path / "dense", golden["input_ids"])
    np.testing.assert_allclose(dense, golden["logits"], rtol=1e-5, atol=2e-5)
    nsa = _logits(tmp_path / "nsa", golden["input_ids"])
    assert np.abs(nsa - dense).max() < 2e-3 * np.abs(dense).max()
    cfg = load_config(str(tmp_path / "nsa" / model_dir.CONFIG_FILE), saved=True).model
    assert cfg.attention == "nsa" and (cfg.global_every, cfg.dense_window, cfg.local_rope_theta) == kept
    assert cfg.nsa.scorer == ("cmp" if cfg.attn_softcap else "rescore")  # capped scores keep cmp
    params = model_dir.read_params(tmp_path / "nsa")
    prompt = [int(t) for t in golden["prompt_ids"]]
    out = generate(cfg, params, [prompt], 24, temperature=0.0)[0]
    # Full forwards past NSA's window (16) and the first compressed block (32 tokens): one compiled
    # length, the tokens not yet chosen zeros (the model is causal: the logits at t read tokens <= t).
    ids = np.zeros((1, len(prompt) + 24), np.int32)
    ids[0, : len(prompt)] = prompt
    forward = jax.jit(lambda x: NSALM(cfg).apply({"params": params}, x))
    for t in range(len(prompt), ids.shape[1]):
        ids[0, t] = int(np.argmax(forward(jnp.asarray(ids))[0, t - 1]))
    assert out == ids[0, len(prompt) :].tolist()


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys):
    src = _hf_folder(tmp_path)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    bare = tmp_path / "bare"
    shutil.copytree(GOLDEN / "llama2", bare)  # no tokenizer
    cases = [
        ([str(tmp_path / "missing"), str(tmp_path / "o1")], "does not exist"),
        ([str(tmp_path), str(tmp_path / "o2")], "no config.json"),
        ([str(src), str(taken)], "not an empty folder"),
        ([str(bare), str(tmp_path / "o3")], "carries no tokenizer"),
        ([str(src), str(tmp_path / "o4"), "--set", "model.nsa.l=33"], "model.nsa.d"),
    ]
    for argv, words in cases:
        assert convert(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err
    assert (taken / "keep.txt").read_text() == "mine" and sorted(p.name for p in taken.iterdir()) == ["keep.txt"]
    assert not any(tmp_path.glob("o*")) and not any(tmp_path.glob(".o*"))


@pytest.mark.parametrize(
    "damage,words",
    [
        ("config_not_json", "config.json is not valid JSON: line 2, column 1: Expecting property name"),
        ("truncated", "model.safetensors is not a complete safetensors file: tensor"),
        ("header_cut", "model.safetensors is not a complete safetensors file: its header claims"),
        ("header_garbage", "model.safetensors is not a complete safetensors file: its header is not JSON"),
        ("tiny", "model.safetensors is not a complete safetensors file (5 bytes)"),
        ("missing_shard", "misses 1 of the 2 shards its index names (model-00002-of-00002.safetensors)"),
    ],
)
def test_a_damaged_folder_is_one_line_naming_the_file(tmp_path, capsys, damage, words):
    """Files the import reads are checked against their own headers before use (no traceback)."""
    src = _hf_folder(tmp_path)
    st = src / "model.safetensors"
    raw = st.read_bytes()
    if damage == "config_not_json":
        (src / "config.json").write_text('{"model_type": "llama",\n')
    elif damage == "truncated":
        st.write_bytes(raw[: len(raw) // 2])
    elif damage == "header_cut":
        st.write_bytes(raw[:100])
    elif damage == "header_garbage":
        n = int.from_bytes(raw[:8], "little")
        st.write_bytes(raw[:8] + b"\xff" * n + raw[8 + n :])
    elif damage == "tiny":
        st.write_bytes(b"abcde")
    else:
        names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
        st.rename(src / names[0])
        index = {"weight_map": {"model.embed_tokens.weight": names[0], "lm_head.weight": names[1]}}
        (src / "model.safetensors.index.json").write_text(json.dumps(index))
    out = tmp_path / "out"
    assert convert([str(src), str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not out.exists() and not any(tmp_path.glob(".out*"))


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_a_stop_during_the_write_leaves_nothing_behind(tmp_path, capsys, monkeypatch, how):
    """Ctrl-C or SIGTERM while the model folder is being written: the temporary folder goes, one line, 130 / 143."""
    import os
    import signal

    import launch.convert as C

    real = C.write_model

    def stopped(ckpt, cfg, attention, seed, folder):
        real(ckpt, cfg, attention, seed, folder)  # a whole folder under the temporary name, then the stop
        assert folder.is_dir() and folder.name.startswith(".out.converting-")
        if how == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        raise KeyboardInterrupt

    monkeypatch.setattr(C, "write_model", stopped)
    before = signal.getsignal(signal.SIGTERM)
    assert convert([str(_hf_folder(tmp_path)), str(tmp_path / "out")]) == (143 if how == "sigterm" else 130)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"convert: stopped by {'SIGTERM' if how == 'sigterm' else 'Ctrl-C'}; nothing was written "
                   f"({tmp_path / 'out'} does not exist)"]  # fmt: skip
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is the caller's again


def test_an_out_that_cannot_be_written_is_refused_before_any_work(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    src = str(_hf_folder(tmp_path))
    assert convert([src, str(tmp_path / "file" / "sub" / "out")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: OUT {tmp_path / 'file' / 'sub' / 'out'}: {tmp_path / 'file'} is a file, not a folder; "
        "name a folder to write into"
    )
    # A read-only parent is refused the same way, before reading SRC ("... cannot be written (Read-only file
    # system)"): seen by hand on a read-only tmpfs mount; root writes through file permissions.


def test_a_run_starts_from_the_folder_and_refuses_another_tokenizer(tmp_path):
    src = _hf_folder(tmp_path)
    assert convert([str(src), str(tmp_path / "nsa")]) == 0
    folder_cfg = str(tmp_path / "nsa" / model_dir.CONFIG_FILE)
    # The folder's config.yaml names a run folder of its own (relative, beside the folder's name), never
    # the folder itself; a run told to write into the folder it starts from is refused.
    assert load_config(folder_cfg, saved=True).train.out_dir == "artifacts/nsa-run"
    into = [f"train.init_from={tmp_path / 'nsa'}", f"train.out_dir={tmp_path / 'nsa'}"]
    with pytest.raises(Exception, match="the model folder train.init_from reads: .* pass --out-dir RUN"):
        check_init_from(load_config(folder_cfg, into, saved=True))
    init = [f"train.init_from={tmp_path / 'nsa'}", f"train.out_dir={tmp_path / 'run'}"]
    init.append(f"data.tokenizer={tmp_path / 'nsa' / 'tokenizer.json'}")
    cfg = load_config(folder_cfg, init, saved=True)
    check_init_from(cfg)
    from nsa_jax.mesh import make_mesh
    from nsa_jax.step import step

    state = step.create_state(
        step.make_plan(cfg, make_mesh(cfg, jax.devices()[:1])), params=model_dir.initial_params(cfg)
    )
    want = model_dir.read_params(tmp_path / "nsa")
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), b)
    with pytest.raises(Exception, match="reads text with the tokenizer .* but data.tokenizer is byte"):
        check_init_from(load_config(None, [f"train.init_from={tmp_path / 'nsa'}"]))
    with pytest.raises(Exception, match="is not a model folder"):
        check_init_from(load_config(None, [f"train.init_from={tmp_path}"]))
    narrower = [f"train.init_from={tmp_path / 'nsa'}", "model.d_ff=64"]
    with pytest.raises(Exception, match="w1.*has shape"):
        model_dir.initial_params(load_config(str(tmp_path / "nsa" / model_dir.CONFIG_FILE), narrower, saved=True))
    # Through launch.train: the same mismatch is one line, exit 2, and the out dir is never made.
    run = tmp_path / "narrow_run"
    sets = [
        f"train.init_from={tmp_path / 'nsa'}",
        "model.d_ff=64",
        f"data.tokenizer={tmp_path / 'nsa' / 'tokenizer.json'}",
    ]
    argv = ["--config", folder_cfg, "--out-dir", str(run), "--steps", "1", "--dataset", "synthetic"]
    argv += [a for x in sets for a in ("--set", x)]
    proc = run_module("launch.train", *argv, env=cpu_env())
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()
    assert err[-1].startswith(f"error: config: train.init_from {tmp_path / 'nsa'}: ") and "has shape" in err[-1]
    assert "Traceback" not in proc.stderr and not run.exists()


@pytest.mark.slow
def test_launch_train_continues_a_converted_model(tmp_path):
    src = _hf_folder(tmp_path)
    assert convert([str(src), str(tmp_path / "nsa")]) == 0
    run = tmp_path / "run"
    args = ["--init-from", str(tmp_path / "nsa"), "--dataset", "synthetic", "--steps", "2", "--out-dir", str(run)]
    # The folder's config keeps a 2,000-step warm-up: a 2-step continuation says where its LR ends.
    sets = ["train.seq_len=64", "train.global_batch=2", "train.log_every=1", "train.eval_every=100"]
    proc = run_module("launch.train", *args, *[a for s in sets for a in ("--set", s)], env=cpu_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"init: parameters from {tmp_path / 'nsa'}" in proc.stdout
    lr = load_config(str(tmp_path / "nsa" / model_dir.CONFIG_FILE), saved=True).train.lr
    assert (
        f"note: train.warmup 2,000 is longer than train.steps 2: the run ends inside its warm-up, "
        f"the learning rate rising to {lr * 2 / 2000:.3g} at most" in proc.stderr
    )
    rows = (run / "training.csv").read_text().splitlines()
    assert len(rows) == 3


def test_a_model_larger_than_the_host_is_refused_with_both_figures(tmp_path, capsys, monkeypatch):
    import launch.convert

    src = _hf_folder(tmp_path)
    monkeypatch.setattr(launch.convert, "available_host_bytes", lambda: 1000)
    assert convert([str(src), str(tmp_path / "out")]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert "converting needs about" in err and "GiB of fp32 parameters" in err and "0.0 GiB is available" in err
    assert not (tmp_path / "out").exists()
