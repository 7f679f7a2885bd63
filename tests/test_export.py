"""launch.export: the model back out as a HF folder or a GGUF file (nsa_jax/pretrained/export.py).

The independent references: transformers' own save_pretrained folders of the six tiny golden
families (tests/golden/pretrained/, made by make_pretrained.py), whose tensors, config and logits
(golden.npz) an export must give back, and test_pretrained's GGUF written as llama.cpp's converter
lays it out. Through transformers itself the round trip is checked by command
(tests/golden/check_export.py; docs/PRETRAINED.md "Export" has its figures).
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
from tokenizers import decoders, models, pre_tokenizers

from launch.convert import main as convert
from launch.export import main as export
from nsa_jax.config import load_config
from nsa_jax.data.tokenizers import ByteTokenizer
from nsa_jax.model import NSALM, init_params
from nsa_jax.pretrained.checkpoints import open_checkpoint
from nsa_jax.pretrained.families import model_config
from nsa_jax.pretrained.gguf_file import GGUFFile
from nsa_jax.pretrained.tokenizer import _byte_alphabet
from nsa_jax.pretrained.weights import dense_params
from nsa_jax.rundir import model_dir

from helpers import cpu_env, run_module

GOLDEN = pathlib.Path(__file__).parent / "golden" / "pretrained"
FAMILIES = ("llama2", "llama3", "mistral", "qwen2", "qwen3", "smollm2", "gemma2", "gemma3")
# config.json keys that define the model (what transformers builds it from).
MODEL_KEYS = (
    "model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings", "hidden_act",
    "max_position_embeddings", "bos_token_id", "eos_token_id",
)  # fmt: skip


def _hf_folder(tmp_path: pathlib.Path, family: str) -> pathlib.Path:
    """The golden tiny model with a byte-level BPE tokenizer.json of its 256 ids (no merges)."""
    src = tmp_path / f"src_{family}"
    shutil.copytree(GOLDEN / family, src)
    alphabet = _byte_alphabet()
    tok = tokenizers.Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    (src / "tokenizer.json").write_text(tok.to_str())
    return src


def _dense_folder(tmp_path, family) -> tuple[pathlib.Path, pathlib.Path]:
    src = _hf_folder(tmp_path, family)
    folder = tmp_path / f"dense_{family}"
    assert convert([str(src), str(folder), "--attention", "dense"]) == 0
    return src, folder


def _logits(cfg, params, ids) -> np.ndarray:
    return np.asarray(NSALM(cfg).apply({"params": params}, jnp.asarray(ids)))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_dense_export_is_the_checkpoint_transformers_saved(tmp_path, family, capsys):
    """HF -> convert --attention dense -> export: transformers' own tensors (fp32 exact, every name), its
    model-defining config keys, and read back the golden logits transformers computed."""
    src, folder = _dense_folder(tmp_path, family)
    assert export([str(folder), str(tmp_path / "hf")]) == 0
    assert "transformers" in capsys.readouterr().out  # how to load it
    got, want = open_checkpoint(tmp_path / "hf"), open_checkpoint(src)
    assert got.names == want.names
    for name in sorted(want.names):
        np.testing.assert_array_equal(got.tensor(name), want.tensor(name), err_msg=name)
    hf, source = got.hf_config, want.hf_config
    for key in MODEL_KEYS:
        assert hf.get(key) == source.get(key), key
    assert model_config(hf) == model_config(source)
    assert hf.get("head_dim", hf["hidden_size"] // hf["num_attention_heads"]) == source.get(
        "head_dim", source["hidden_size"] // source["num_attention_heads"]
    )
    golden = np.load(GOLDEN / family / "golden.npz")
    cfg = model_config(hf)
    np.testing.assert_allclose(
        _logits(cfg, dense_params(got, cfg), golden["input_ids"]), golden["logits"], rtol=1e-5, atol=2e-5
    )
    tc = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert tc["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (tmp_path / "hf" / "tokenizer.json").read_text() == (src / "tokenizer.json").read_text()


def test_half_precision_and_shards(tmp_path, monkeypatch):
    """--dtype bfloat16 writes BF16 tensors equal to the fp32 ones rounded; above the shard size an index
    names every tensor's file, and the importer reads the shards back."""
    import nsa_jax.pretrained.export as ex

    src, folder = _dense_folder(tmp_path, "llama2")
    monkeypatch.setattr(ex, "SHARD_BYTES", 40_000)
    assert export([str(folder), str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    index = json.loads((tmp_path / "bf16" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((tmp_path / "bf16" / f).is_file() for f in files)
    got, want = open_checkpoint(tmp_path / "bf16"), open_checkpoint(src)
    header = json.loads((tmp_path / "bf16" / files[0]).read_bytes()[8:].split(b"}}", 1)[0] + b"}}")
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    for name in want.names:
        x = want.tensor(name)
        np.testing.assert_array_equal(got.tensor(name), x.astype(jnp.bfloat16).astype(np.float32), err_msg=name)


@pytest.mark.parametrize("family", ["llama2", "qwen2"])
def test_a_gguf_export_is_llama_cpp_s_layout(tmp_path, family):
    """F32: every tensor as llama.cpp's converter writes it (test_pretrained's construction: q/k rows
    interleaved for llama, GGUF names, 1-D tensors F32); the file imports back to transformers' logits;
    the vocabulary reads back as the same tokenizer; Q8_0 is within its rounding of the F32 logits."""
    from test_pretrained import _permute_for_llama_cpp

    src, folder = _dense_folder(tmp_path, family)
    out = tmp_path / "m.gguf"
    assert export([str(folder), str(out), "--format", "gguf"]) == 0
    want, hf = open_checkpoint(src), json.loads((src / "config.json").read_text())
    g = GGUFFile(out)
    assert g.metadata["general.architecture"] == hf["model_type"]
    assert g.metadata[f"{hf['model_type']}.block_count"] == hf["num_hidden_layers"]
    for i in range(hf["num_hidden_layers"]):
        q = want.tensor(f"model.layers.{i}.self_attn.q_proj.weight")
        k = want.tensor(f"model.layers.{i}.self_attn.k_proj.weight")
        if family == "llama2":  # llama.cpp rotates interleaved pairs for Llama; Qwen rotates halves as HF does
            q, k = (
                _permute_for_llama_cpp(q, hf["num_attention_heads"]),
                _permute_for_llama_cpp(k, hf["num_key_value_heads"]),
            )
        np.testing.assert_array_equal(g.raw(f"blk.{i}.attn_q.weight"), q)
        np.testing.assert_array_equal(g.raw(f"blk.{i}.attn_k.weight"), k)
        np.testing.assert_array_equal(
            g.raw(f"blk.{i}.ffn_down.weight"), want.tensor(f"model.layers.{i}.mlp.down_proj.weight")
        )
        assert g.tensors[f"blk.{i}.attn_norm.weight"][1] == "F32"
    np.testing.assert_array_equal(g.raw("token_embd.weight"), want.tensor("model.embed_tokens.weight"))
    back = open_checkpoint(out)
    cfg = model_config(back.hf_config)
    golden = np.load(GOLDEN / family / "golden.npz")
    f32 = _logits(cfg, dense_params(back, cfg), golden["input_ids"])
    np.testing.assert_allclose(f32, golden["logits"], rtol=1e-5, atol=2e-5)
    text = "héllo wörld\n  def f(x): return x"
    src_tok = tokenizers.Tokenizer.from_file(str(src / "tokenizer.json"))
    assert tokenizers.Tokenizer.from_str(back.tokenizer_json).encode(text).ids == src_tok.encode(text).ids
    assert export([str(folder), str(tmp_path / "q8.gguf"), "--format", "gguf", "--dtype", "q8_0"]) == 0
    q8 = open_checkpoint(tmp_path / "q8.gguf")
    assert GGUFFile(tmp_path / "q8.gguf").tensors["blk.0.attn_q.weight"][1] == "Q8_0"
    q8_logits = _logits(cfg, dense_params(q8, cfg), golden["input_ids"])
    assert 1e-5 < np.abs(q8_logits - f32).max() < 0.05 * np.abs(f32).max()


def _nsa_folder(tmp_path) -> pathlib.Path:
    cfg = load_config("cpu_tiny", ["model.attention=nsa", "data.tokenizer=byte"])
    params = jax.jit(lambda k: init_params(cfg.model, k))(jax.random.PRNGKey(1))
    folder = tmp_path / "nsa"
    model_dir.write_model_dir(folder, cfg, params)
    return folder


def test_an_nsa_model_exports_under_hf_names_and_converts_back(tmp_path, capsys):
    """NSA -> hf: config.json's model_type is not transformers' (it refuses rather than misreads) with the
    NSA settings in its `nsa` block; launch.convert reads the folder back to the same parameters."""
    folder = _nsa_folder(tmp_path)
    assert export([str(folder), str(tmp_path / "hf")]) == 0
    assert "stock transformers does not load it" in capsys.readouterr().out
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg = load_config(str(folder / model_dir.CONFIG_FILE), saved=True)
    assert hf["model_type"] == "nsa_jax" and hf["base_model_type"] == "llama"
    assert hf["nsa"]["n"] == cfg.model.nsa.n and hf["nsa"]["branches"] == list(cfg.model.nsa.branches)
    names = open_checkpoint(tmp_path / "hf").names
    assert "model.layers.0.self_attn.q_proj.weight" in names and "model.layers.0.self_attn.k_proj.weight" not in names
    assert "model.layers.0.self_attn.nsa.k_slc.kernel" in names
    assert convert([str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    back = load_config(str(tmp_path / "back" / model_dir.CONFIG_FILE), saved=True)
    assert back.model.attention == "nsa" and back.model.nsa == cfg.model.nsa
    for key in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "tie_embeddings"):
        assert getattr(back.model, key) == getattr(cfg.model, key), key
    a, b = model_dir.read_params(folder), model_dir.read_params(tmp_path / "back")
    flat_a = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(a)}
    flat_b = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(b)}
    assert flat_a.keys() == flat_b.keys()
    for key in flat_a:
        np.testing.assert_array_equal(np.asarray(flat_b[key]), np.asarray(flat_a[key]), err_msg=key)
    # --attention dense of an NSA export is refused, naming --drop-nsa.
    assert convert([str(tmp_path / "hf"), str(tmp_path / "d"), "--attention", "dense"]) == 2
    assert "--drop-nsa" in capsys.readouterr().err and not (tmp_path / "d").exists()


def test_a_gemma_as_nsa_exports_and_converts_back_with_its_layer_pattern(tmp_path, capsys):
    src = _hf_folder(tmp_path, "gemma3")
    assert convert([str(src), str(tmp_path / "nsa"), "--set", "model.nsa.w=16"]) == 0
    assert export([str(tmp_path / "nsa"), str(tmp_path / "hf")]) == 0
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf["base_model_type"] == "gemma3_text" and hf["layer_types"][-1] == "full_attention"
    assert convert([str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    cfg = load_config(str(tmp_path / "nsa" / model_dir.CONFIG_FILE), saved=True).model
    back = load_config(str(tmp_path / "back" / model_dir.CONFIG_FILE), saved=True).model
    assert back == cfg and (back.global_every, back.dense_window) == (6, 10)
    a, b = model_dir.read_params(tmp_path / "nsa"), model_dir.read_params(tmp_path / "back")
    flat_a = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(a)}
    flat_b = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(b)}
    assert flat_a.keys() == flat_b.keys()
    for key in flat_a:
        np.testing.assert_array_equal(np.asarray(flat_b[key]), np.asarray(flat_a[key]), err_msg=key)
    capsys.readouterr()
    assert export([str(tmp_path / "nsa"), str(tmp_path / "g.gguf"), "--format", "gguf", "--drop-nsa"]) == 2
    assert "Gemma 3 (text) is not written to GGUF here" in capsys.readouterr().err
    # --drop-nsa: the local layers keep their window branch's keys, the global one its selection branch's
    # (here zeroed, so the two differ).
    saved = load_config(str(tmp_path / "nsa" / model_dir.CONFIG_FILE), saved=True)
    params = model_dir.read_params(tmp_path / "nsa")
    attn = params["layers"]["attn"]
    attn["k_slc"] = jax.tree.map(np.zeros_like, attn["k_slc"])
    model_dir.write_model_dir(tmp_path / "zeroed", saved, params)
    shutil.copy(tmp_path / "nsa" / "tokenizer.json", tmp_path / "zeroed" / "tokenizer.json")
    assert export([str(tmp_path / "zeroed"), str(tmp_path / "dropped"), "--drop-nsa"]) == 0
    dense, dropped = open_checkpoint(src), open_checkpoint(tmp_path / "dropped")
    for i in range(5):
        name = f"model.layers.{i}.self_attn.k_proj.weight"
        np.testing.assert_array_equal(dropped.tensor(name), dense.tensor(name), err_msg=name)
    assert not np.any(dropped.tensor("model.layers.5.self_attn.k_proj.weight"))
    assert model_config(dropped.hf_config) == model_config(dense.hf_config)


def test_drop_nsa_writes_the_selection_branch_as_the_attention_and_measures_it(tmp_path, capsys):
    folder = _nsa_folder(tmp_path)
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    argv = [str(folder), str(tmp_path / "dense"), "--drop-nsa", "--heldout", str(text), "--heldout-len", "128"]
    assert export(argv) == 0
    out = capsys.readouterr().out
    assert "--drop-nsa on" in out and "(NSA) ->" in out
    report = json.loads((tmp_path / "dense" / "drop_nsa.json").read_text())
    assert report["tokens"] == 128 and np.isfinite(report["nsa_loss"]) and np.isfinite(report["dense_loss"])
    assert abs(report["change"] - (report["dense_loss"] / report["nsa_loss"] - 1)) < 1e-9
    params = model_dir.read_params(folder)
    got = open_checkpoint(tmp_path / "dense")
    assert got.hf_config["model_type"] == "llama"
    for i in (0, 1):
        for hf_name, ours in (("k_proj", "k_slc"), ("v_proj", "v_slc"), ("q_proj", "q"), ("o_proj", "o")):
            want = np.asarray(params["layers"]["attn"][ours]["kernel"][i]).T
            np.testing.assert_array_equal(got.tensor(f"model.layers.{i}.self_attn.{hf_name}.weight"), want)
    assert not any(".nsa." in n or "cmp" in n or "gate_fc" in n for n in got.names)
    # The byte vocabulary exports as a tokenizers JSON that encodes text as the byte tokenizer does.
    tok = tokenizers.Tokenizer.from_file(str(tmp_path / "dense" / "tokenizer.json"))
    sample = "héllo wörld 🙂\n\tx"
    assert tok.encode(sample).ids == ByteTokenizer().encode(sample)
    assert tok.token_to_id("<|endoftext|>") == ByteTokenizer.eos_id


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys):
    _, folder = _dense_folder(tmp_path, "llama2")
    _, mistral = _dense_folder(tmp_path, "mistral")  # a sliding window of 24
    _, llama3 = _dense_folder(tmp_path, "llama3")  # llama3 RoPE scaling
    nsa = _nsa_folder(tmp_path)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    (tmp_path / "exists.gguf").write_text("x")
    wide = tmp_path / "wide"
    cfg = load_config("cpu_tiny", ["model.attention=dense", "model.v_head_dim=64", "data.tokenizer=byte"])
    model_dir.write_model_dir(wide, cfg, jax.jit(lambda k: init_params(cfg.model, k))(jax.random.PRNGKey(0)))
    cases = [
        ([str(tmp_path / "nope"), str(tmp_path / "o")], "does not exist"),
        ([str(tmp_path / "full"), str(tmp_path / "o")], "not a model folder or a run's checkpoint"),
        ([str(folder), str(tmp_path / "full")], "not an empty folder"),
        ([str(folder), str(folder / "inside")], "inside it"),
        ([str(folder), str(tmp_path / "o"), "--dtype", "q8_0"], "GGUF type"),
        ([str(folder), str(tmp_path / "o"), "--format", "gguf"], "NAME.gguf"),
        ([str(folder), str(tmp_path / "exists.gguf"), "--format", "gguf"], "exists"),
        ([str(folder), str(tmp_path / "o"), "--drop-nsa"], "dense model already"),
        ([str(folder), str(tmp_path / "o"), "--heldout", "x"], "--drop-nsa"),
        ([str(nsa), str(tmp_path / "o.gguf"), "--format", "gguf"], "--drop-nsa"),
        ([str(wide), str(tmp_path / "o")], "v_head_dim"),
        ([str(folder), str(tmp_path / "o"), "--format", "onnx"], "invalid choice"),
        ([str(mistral), str(tmp_path / "o.gguf"), "--format", "gguf"], "sliding window"),
        ([str(llama3), str(tmp_path / "o.gguf"), "--format", "gguf"], "RoPE scaling"),
    ]
    for argv, words in cases:
        assert export(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], (argv, err)
        assert not (tmp_path / "o").exists() and not (tmp_path / "o.gguf").exists()
        assert not list(tmp_path.glob(".o*")) and (tmp_path / "exists.gguf").read_text() == "x"
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == ["x"]


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_a_stop_during_the_export_leaves_nothing(tmp_path, capsys, monkeypatch, how):
    import os
    import signal

    import nsa_jax.pretrained.export as ex

    _, folder = _dense_folder(tmp_path, "llama2")
    real = ex.write_safetensors

    def stopped(out, tensors, dtype="float32", **kw):
        files = real(out, tensors, dtype, **kw)  # the tensors written under the temporary name, then the stop
        if how == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        raise KeyboardInterrupt
        return files

    monkeypatch.setattr(ex, "write_safetensors", stopped)
    assert export([str(folder), str(tmp_path / "out")]) == (143 if how == "sigterm" else 130)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nothing was written" in err[0]
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


@pytest.mark.slow
def test_a_moved_model_folder_reads_its_own_tokenizer(tmp_path, capsys):
    """config.yaml names the tokenizer where convert wrote it; moved elsewhere, the folder reads the copy
    beside it (launch.generate, and the export's tokenizer files)."""
    from launch.generate import main as generate

    _, folder = _dense_folder(tmp_path, "llama2")
    moved = tmp_path / "elsewhere" / "model"
    moved.parent.mkdir()
    shutil.move(str(folder), str(moved))
    cfg, _ = model_dir.load_model(moved)
    assert cfg.data.tokenizer == str((moved / "tokenizer.json").absolute())
    argv = ["--ckpt", str(moved), "--prompt", "ab", "--max-new-tokens", "2", "--temperature", "0"]
    assert generate(argv) == 0
    assert export([str(moved), str(tmp_path / "hf")]) == 0
    assert f"tokenizer: {moved / 'tokenizer.json'}" in capsys.readouterr().out
    # A run starts from the moved folder with the folder's config and tokenizer.
    run = tmp_path / "run"
    sets = ["train.seq_len=32", "train.global_batch=2", "train.warmup=1", "train.eval_every=100"]
    argv = ["--init-from", str(moved), "--dataset", "synthetic", "--steps", "1", "--out-dir", str(run)]
    proc = run_module("launch.train", *argv, *[a for s in sets for a in ("--set", s)], env=cpu_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"init: parameters from {moved}" in proc.stdout
