"""The project's model -> a HF folder or a GGUF file: the importer's layout, written back.

`hf_family(m)` names the HF family (model_type) that expresses a dense ModelConfig, or raises
PretrainedError naming the part none does. `hf_config(cfg, specials, source)` is its
config.json: the keys families.model_config reads, written so that model_config(hf_config(.))
gives the same model, over the source checkpoint's own config.json where the model folder kept
it (max_position_embeddings, ids, keys this project does not read). `hf_tensors(params, m)`
yields (HF name, shape, a function that makes the tensor), in torch's [out, in] layout and fp32,
one tensor at a time: weights.py's table read backwards, so import and export cannot drift.

`write_safetensors(folder, tensors, dtype)` writes model.safetensors, or shards of at most
SHARD_BYTES with model.safetensors.index.json, one tensor in memory at a time.
`write_gguf(path, ...)` writes llama.cpp's layout: its tensor names (checkpoints.GGUF_NAMES),
q/k rows in its interleaved RoPE order for llama/mistral, its metadata keys, 1-D tensors in
F32 as llama.cpp keeps them, and a byte-level BPE vocabulary as tokenizer.ggml.* (what
tokenizer.gguf_tokenizer_json reads back).
"""

from __future__ import annotations

import json
import pathlib
import struct
from typing import Callable, Iterator

import gguf
import ml_dtypes
import numpy as np

from nsa_jax.config import Config, ModelConfig
from nsa_jax.nsa.attention import local_layer
from nsa_jax.pretrained import PretrainedError
from nsa_jax.pretrained.checkpoints import GGUF_CONFIG, GGUF_NAMES
from nsa_jax.pretrained.families import FAMILIES, GEMMA
from nsa_jax.pretrained.weights import LAYER, NSA_PREFIX, NSA_SHARED, layer_tensors

# model_type -> the transformers class that loads it with no custom code.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
SAFETENSORS_NAMES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
NUMPY_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
# GGUF tensor types of an export, and llama.cpp's general.file_type for each (its LlamaFileType).
GGUF_TYPES = {"F32": 0, "F16": 1, "Q8_0": 7, "BF16": 32}
SHARD_BYTES = 5 * 2**30  # transformers' save_pretrained default (max_shard_size="5GB")
# The source checkpoint's config.json, kept in the model folder by launch.convert.
SOURCE_CONFIG_FILE = "hf_config.json"
# Keys of a source config.json an export writes itself (or drops: they describe the source file).
_DERIVED = {"rope_parameters", "rope_scaling", "rope_theta", "torch_dtype", "dtype", "transformers_version"}

Tensor = tuple[str, tuple[int, ...], Callable[[], np.ndarray]]
# ModelConfig's Gemma fields (families.gemma_config); the first four make a model a Gemma.
GEMMA_FEATURES = (
    "norm_plus_one", "embed_scale", "mlp_act", "post_norms", "query_scale", "attn_softcap", "final_softcap",
    "global_every", "local_rope_theta",
)  # fmt: skip
GEMMA_CORE = {"norm_plus_one": True, "embed_scale": True, "mlp_act": "gelu_tanh", "post_norms": True}
# Keys of a source Gemma config.json the export writes itself in transformers 5's form.
_GEMMA_DERIVED = {"layer_types", "rope_local_base_freq", "sliding_window_pattern", "_sliding_window_pattern"}


def hf_family(m: ModelConfig) -> str:
    """The model_type of the HF family that expresses `m` exactly; PretrainedError naming what none does."""
    if m.attention != "dense":
        raise PretrainedError(
            "the model is NSA; a dense format holds a dense model: pass --drop-nsa for the approximate "
            "dense model, or --format nsa for the NSA weights under HF names"
        )
    if any(getattr(m, f) != getattr(ModelConfig, f) for f in GEMMA_FEATURES):
        return _gemma_family(m)
    if m.v_head_dim != m.head_dim:
        raise PretrainedError(
            f"model.v_head_dim {m.v_head_dim} != model.head_dim {m.head_dim}: no HF Llama-family model has "
            "values of another width than its keys"
        )
    if m.qk_norm and m.qkv_bias:
        raise PretrainedError("model.qk_norm with model.qkv_bias: Qwen3 (q/k norms) has no q/k/v biases of its own")
    if m.dense_window and (m.qk_norm or m.qkv_bias):
        raise PretrainedError("model.dense_window with q/k norms or q/k/v biases: only Mistral has a sliding window")
    if m.rope_scaling.kind not in ("none", "llama3"):
        raise PretrainedError(f"model.rope_scaling.kind {m.rope_scaling.kind!r}: no HF family reads it")
    kind = "qwen3" if m.qk_norm else "qwen2" if m.qkv_bias else "mistral" if m.dense_window else "llama"
    if m.rope_scaling.kind == "llama3" and kind != "llama":
        raise PretrainedError(f"llama3 RoPE scaling with a {kind} model: transformers reads it for Llama only")
    return kind


def _gemma_family(m: ModelConfig) -> str:
    """gemma2 or gemma3_text for a model with Gemma's features; PretrainedError naming what neither has."""
    missing = [f"model.{f}={v}" for f, v in GEMMA_CORE.items() if getattr(m, f) != v]
    if missing:
        raise PretrainedError(f"Gemma's features without {', '.join(missing)}: no HF family has this mix")
    if m.qkv_bias or m.v_head_dim != m.head_dim:
        raise PretrainedError("a Gemma with q/k/v biases or values of another width than its keys: no HF Gemma has it")
    if not float(m.query_scale).is_integer():
        raise PretrainedError(f"model.query_scale {m.query_scale}: HF's query_pre_attn_scalar is an integer")
    if m.dense_window and not m.global_every:
        raise PretrainedError("a Gemma whose every layer is local: HF's Gemma has global layers among them")
    kind = "gemma3_text" if m.qk_norm else "gemma2"
    if m.rope_scaling.kind not in ("none", "linear") or (kind == "gemma2" and m.rope_scaling.kind != "none"):
        raise PretrainedError(f"RoPE scaling {m.rope_scaling.kind!r} with a {kind} model: transformers ignores it")
    if m.global_every and m.rope_scaling.kind != "none" and not m.local_rope_theta:
        raise PretrainedError("a Gemma whose local layers scale RoPE: HF's Gemma 3 scales its global layers only")
    if kind == "gemma2" and m.local_rope_theta:
        raise PretrainedError("a Gemma 2 with model.local_rope_theta: HF's Gemma 2 has one RoPE base")
    return kind


def _gemma_config(m: ModelConfig, kind: str) -> dict:
    """The Gemma keys of config.json (transformers 5's layer_types and rope_parameters)."""
    rope = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling.kind == "linear":
        rope = {"rope_type": "linear", "rope_theta": m.rope_theta, "factor": m.rope_scaling.factor}
    local = {"rope_type": "default", "rope_theta": m.local_rope_theta or m.rope_theta}
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": int(m.query_scale or m.head_dim),  # transformers' field is an int
        "sliding_window": m.dense_window or None,
        "layer_types": ["sliding_attention" if local_layer(m, i) else "full_attention" for i in range(m.n_layers)],
        "attn_logit_softcapping": m.attn_softcap or None,
        "final_logit_softcapping": m.final_softcap or None,
        "rope_parameters": rope if kind == "gemma2" else {"full_attention": rope, "sliding_attention": local},
    }


def hf_config(cfg: Config, specials: dict, source: dict | None = None, dtype: str = "float32") -> dict:
    """config.json of `cfg.model` (dense): families.model_config of it is cfg.model's shape."""
    m = cfg.model
    kind = hf_family(m)
    drop = _DERIVED | (_GEMMA_DERIVED if kind in GEMMA else set())
    base = {k: v for k, v in (source or {}).items() if k not in drop}
    scaling = m.rope_scaling
    longest = int(cfg.train.seq_len)
    if scaling.kind == "llama3":
        longest = max(longest, int(scaling.original_max_len * scaling.factor))
    hf = base | {
        "architectures": [ARCHITECTURES[kind]],
        "model_type": kind,
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "intermediate_size": m.d_ff,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads,
        "head_dim": m.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": m.tie_embeddings,
        "attention_bias": m.qkv_bias and kind != "qwen2",
        "mlp_bias": False,
        "initializer_range": m.init_std,
        "max_position_embeddings": int(base.get("max_position_embeddings") or longest),
        "torch_dtype": dtype,
    }
    if scaling.kind == "llama3":
        hf["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_len,
        }
    if kind in GEMMA:
        del hf["hidden_act"], hf["mlp_bias"], hf["rope_theta"], hf["rope_scaling"]
        hf |= _gemma_config(m, kind)
    if kind == "mistral":
        hf["sliding_window"] = m.dense_window
    if kind in ("qwen2", "qwen3"):
        hf["use_sliding_window"] = False
        hf["sliding_window"] = None
    if kind == "qwen2":
        del hf["attention_bias"]  # Qwen2 always has q/k/v biases
    for key in ("bos", "eos", "pad"):
        if specials.get(key) is not None:
            hf[f"{key}_token_id"] = int(specials[key])
    return hf


def hf_tensors(params: dict, m: ModelConfig) -> Iterator[Tensor]:
    """(HF name, torch shape, make) for every tensor of the dense model `params` (scanned `layers`
    or per-layer `layer_i`), in save_pretrained's order; `make()` gives the fp32 array."""

    def layer(i: int, path: tuple[str, ...]):
        node = params["layers"] if "layers" in params else params[f"layer_{i}"]
        for key in path:
            node = node[key]
        return node[i] if "layers" in params else node

    def leaf(path: tuple[str, ...]):
        node = params
        for key in path:
            node = node[key]
        return node

    def make(get, transpose: bool):
        def f():
            x = np.asarray(get(), np.float32)
            return np.ascontiguousarray(x.T if transpose else x)

        return f

    def shape(x, transpose: bool) -> tuple[int, ...]:
        s = tuple(int(d) for d in np.shape(x))
        return s[::-1] if transpose else s

    yield (
        "model.embed_tokens.weight",
        shape(leaf(("embed", "embedding")), False),
        make(lambda: leaf(("embed", "embedding")), False),
    )
    table = layer_tensors(m)
    for i in range(m.n_layers):
        for path, hf_name, transpose in table:
            get = lambda i=i, path=path: layer(i, path)
            yield LAYER.format(i=i) + hf_name, shape(get(), transpose), make(get, transpose)
    yield (
        "model.norm.weight",
        shape(leaf(("final_norm", "scale")), False),
        make(lambda: leaf(("final_norm", "scale")), False),
    )
    if not m.tie_embeddings:
        yield (
            "lm_head.weight",
            shape(leaf(("lm_head", "kernel")), True),
            make(lambda: leaf(("lm_head", "kernel")), True),
        )


def write_safetensors(
    folder: pathlib.Path, tensors: list[Tensor], dtype: str = "float32", shard_bytes: int | None = None
) -> list[str]:
    """The tensors in `folder` as model.safetensors, or as model-0000i-of-0000n.safetensors with
    model.safetensors.index.json when they exceed `shard_bytes`; returns the files written."""
    shard_bytes = SHARD_BYTES if shard_bytes is None else shard_bytes
    item = np.dtype(NUMPY_DTYPES[dtype]).itemsize
    shards: list[list[Tensor]] = [[]]
    size = 0
    for t in tensors:
        n = item * int(np.prod(t[1]))
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += n
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for file, shard in zip(names, shards):
        _write_safetensors_file(folder / file, shard, dtype)
    if len(shards) > 1:
        weight_map = {t[0]: file for file, shard in zip(names, shards) for t in shard}
        total = sum(item * int(np.prod(t[1])) for t in tensors)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        names.append("model.safetensors.index.json")
    return names


def _write_safetensors_file(file: pathlib.Path, tensors: list[Tensor], dtype: str) -> None:
    item = np.dtype(NUMPY_DTYPES[dtype]).itemsize
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in tensors:
        n = item * int(np.prod(shape))
        header[name] = {"dtype": SAFETENSORS_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name, shape, make in tensors:
            x = make().astype(NUMPY_DTYPES[dtype])
            if x.shape != tuple(shape):
                raise PretrainedError(f"tensor {name} came out {list(x.shape)}, expected {list(shape)}")
            f.write(x.tobytes())


# ---------------------------------------------------------------------------
# GGUF


def gguf_tokenizer_metadata(tokenizer_json: str, specials: dict) -> dict:
    """tokenizer.ggml.* of a byte-level BPE tokenizers JSON (the inverse of tokenizer.gguf_tokenizer_json):
    {key: value}; PretrainedError for another tokenizer model."""
    tok = json.loads(tokenizer_json)
    model = tok.get("model") or {}
    if model.get("type") != "BPE" or not _byte_level(tok):
        raise PretrainedError(
            f"tokenizer model {model.get('type')!r} is not a byte-level BPE; GGUF export writes that one "
            "(GGUF's 'gpt2'); export --format hf keeps any tokenizer"
        )
    vocab = dict(model["vocab"])
    added = {t["content"]: t for t in tok.get("added_tokens", [])}
    for content, t in added.items():
        vocab.setdefault(content, t["id"])
    n = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [gguf.TokenType.UNUSED] * n
    for content, i in vocab.items():
        tokens[i] = content
        t = added.get(content)
        types[i] = (
            gguf.TokenType.NORMAL
            if t is None
            else gguf.TokenType.CONTROL
            if t.get("special")
            else gguf.TokenType.USER_DEFINED
        )
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [int(t) for t in types],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.add_bos_token": bool(specials.get("add_bos", False)),
    }
    for key, gguf_key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "padding_token_id")):
        if specials.get(key) is not None:
            meta[f"tokenizer.ggml.{gguf_key}"] = int(specials[key])
    return meta


def _byte_level(tok: dict) -> bool:
    def kinds(node):
        if not isinstance(node, dict):
            return set()
        return {node.get("type")} | {k for sub in node.get("pretokenizers", []) for k in kinds(sub)}

    return "ByteLevel" in kinds(tok.get("pre_tokenizer"))


def _gguf_shape_ok(shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType) -> bool:
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    return shape[-1] % block == 0


def write_gguf(
    path: pathlib.Path,
    hf: dict,
    tensors: list[Tensor],
    kind: str = "F32",
    tokenizer_json: str | None = None,
    specials: dict | None = None,
    name: str = "nsa-jax export",
) -> dict[str, str]:
    """A GGUF file of the dense model `hf` (hf_config's dict) and its `tensors` (hf_tensors');
    `kind` in GGUF_TYPES (2-D tensors; 1-D ones stay F32). Returns {GGUF tensor name: type}."""
    arch = hf["model_type"]
    if arch in GEMMA:
        raise PretrainedError(f"{FAMILIES[arch]} is not written to GGUF here; export --format hf")
    if hf.get("rope_scaling"):
        raise PretrainedError("llama3 RoPE scaling is not written to GGUF (llama.cpp keeps it as a tensor); use hf")
    if arch == "mistral":
        if hf.get("sliding_window"):
            raise PretrainedError(
                f"a sliding window ({hf['sliding_window']} tokens): llama.cpp's Llama layout, which Mistral is "
                "written as, has none; export --format hf"
            )
        arch = "llama"  # llama.cpp's converter writes a Mistral without a window as a Llama
    to_gguf = {}
    for hf_name, g_name in GGUF_NAMES.items():
        for i in range(hf["num_hidden_layers"]) if "{i}" in hf_name else [None]:
            to_gguf[hf_name.format(i=i)] = g_name.format(i=i)
    w = gguf.GGUFWriter(path, arch)
    w.add_name(name)
    w.add_file_type(GGUF_TYPES[kind])
    # The importer's table of GGUF keys (checkpoints.GGUF_CONFIG), written back; a window is refused above.
    for key, hf_key in GGUF_CONFIG.items():
        value = hf.get(hf_key)
        if value is not None and key != "attention.sliding_window":
            _add_kv(w, f"{arch}.{key}", value)
    w.add_value_length(hf["head_dim"])
    w.add_rope_dimension_count(hf["head_dim"])
    if hf.get("rope_scaling"):
        raise PretrainedError(
            "llama3 RoPE scaling is not written to GGUF here (llama.cpp keeps it as a tensor); use --format hf"
        )
    if arch == "mistral" and hf.get("sliding_window"):
        w.add_sliding_window(hf["sliding_window"])
    if tokenizer_json is not None:
        for key, value in gguf_tokenizer_metadata(tokenizer_json, specials or {}).items():
            _add_kv(w, key, value)
    plan = []
    for hf_name, shape, make in tensors:
        q = gguf.GGMLQuantizationType[kind] if len(shape) > 1 else gguf.GGMLQuantizationType.F32
        if not _gguf_shape_ok(shape, q):
            raise PretrainedError(f"tensor {hf_name} {list(shape)}: rows of {shape[-1]} are not whole {kind} blocks")
        nbytes = int(np.prod(gguf.quant_shape_to_byte_shape(shape, q)))
        w.add_tensor_info(to_gguf[hf_name], shape, np.dtype(np.float32), nbytes, raw_dtype=q)
        plan.append((hf_name, make, q))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    heads = {"q_proj": hf["num_attention_heads"], "k_proj": hf["num_key_value_heads"]}
    for hf_name, make, q in plan:
        x = make()
        if arch in ("llama", "mistral"):
            part = hf_name.split(".")[-2]
            if part in heads and hf_name.endswith(".weight"):
                # HF rotates halves; llama.cpp stores each RoPE pair interleaved (the importer undoes this).
                h = heads[part]
                x = x.reshape(h, 2, x.shape[0] // h // 2, -1).swapaxes(1, 2).reshape(x.shape)
        w.write_tensor_data(np.ascontiguousarray(gguf.quants.quantize(np.ascontiguousarray(x), q)))
    w.close()
    return {to_gguf[n]: q.name for n, _, q in plan}


def _add_kv(w: gguf.GGUFWriter, key: str, value) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif value and isinstance(value[0], int):
        w.add_array(key, value)
    else:
        w.add_array(key, list(value))


# ---------------------------------------------------------------------------
# NSA under HF-style names, and the tokenizer files


# No transformers class has it: stock transformers refuses the folder rather than misread it (launch.convert reads it).
NSA_MODEL_TYPE = "nsa_jax"
_SHARED = set(NSA_SHARED)  # attention parts NSA shares with the dense layout (HF names)


def nsa_hf_config(cfg: Config, specials: dict, source: dict | None = None, dtype: str = "float32") -> dict:
    """config.json of an NSA model: the dense family's keys, model_type NSA_MODEL_TYPE with the
    family as `base_model_type`, and the NSA settings (model.nsa) as the `nsa` block."""
    from nsa_jax.config import replace, to_dict  # noqa: PLC0415 - config helpers, only for this export

    dense = replace(cfg, ["model.attention=dense", "model.nsa.gate_bias_init=[]"])
    hf = hf_config(dense, specials, source, dtype)
    return hf | {
        "architectures": ["NSAForCausalLM"],
        "model_type": NSA_MODEL_TYPE,
        "base_model_type": hf["model_type"],
        "nsa": to_dict(cfg.model.nsa),
    }


def nsa_hf_tensors(params: dict, m: ModelConfig) -> Iterator[Tensor]:
    """hf_tensors' names for what NSA shares with the dense model; the rest of each layer's attention
    (branch keys/values, compressors, gates) as `model.layers.{i}.self_attn.nsa.<path>`."""
    attn = params["layers"]["attn"]
    own = {name for name in attn if name not in _SHARED}
    for name, shape, make in hf_tensors(_without_kv(params), m):
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            continue  # each branch keeps its own keys and values, below
        yield name, shape, make
        if name.endswith("self_attn.o_proj.weight"):  # the layer's NSA parts follow its attention
            i = int(name.split(".")[2])
            for path, leaf in _leaves({k: attn[k] for k in sorted(own)}):
                get = lambda leaf=leaf, i=i: np.ascontiguousarray(np.asarray(leaf[i], np.float32))
                yield LAYER.format(i=i) + NSA_PREFIX + ".".join(path), tuple(np.shape(leaf)[1:]), get


def _without_kv(params: dict) -> dict:
    """The dense tensors of an NSA model's params (hf_tensors reads a k and a v: the slc branch's, skipped)."""
    attn = params["layers"]["attn"]
    shared = {n: attn[n] for n in _SHARED if n in attn} | {"k": attn["k_slc"], "v": attn["v_slc"]}
    return dict(params) | {"layers": dict(params["layers"]) | {"attn": shared}}


def _leaves(tree: dict, prefix: tuple[str, ...] = ()):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, (*prefix, key))
        else:
            yield (*prefix, key), value


def write_hf_tokenizer(folder: pathlib.Path, tokenizer_json: str, specials: dict) -> list[str]:
    """tokenizer.json, tokenizer_config.json (BOS/EOS/PAD as the model defines them) and
    special_tokens_map.json: what transformers' AutoTokenizer reads."""
    tok = json.loads(tokenizer_json)
    by_id = {t["id"]: t["content"] for t in tok.get("added_tokens", [])}
    vocab = (tok.get("model") or {}).get("vocab") or {}
    by_id.update(
        {i: t for t, i in vocab.items() if i not in by_id and i in {specials.get(k) for k in ("bos", "eos", "pad")}}
    )
    (folder / "tokenizer.json").write_text(tokenizer_json)
    names = {f"{k}_token": by_id[specials[k]] for k in ("bos", "eos", "pad") if specials.get(k) in by_id}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": bool(specials.get("add_bos", False))}
    config |= names | {"model_max_length": 1_000_000_000}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(names, indent=2) + "\n")
    return ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
