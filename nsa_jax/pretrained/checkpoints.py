"""Pretrained checkpoints on disk, read one tensor at a time: a HF folder or a GGUF file.

`open_checkpoint(path)` gives a `Checkpoint` whatever the format: `.hf_config` (the model's
config in HF's keys), `.tensor(name)` (one tensor by its HF name, fp32, torch's [out, in]
layout), `.names`, and the tokenizer it carries (`.tokenizer_json`, `.special_ids`).
Tensors are memory-mapped and converted one at a time, so a caller that copies each into
its place never holds a second full copy of the model.

HF folder: config.json, model.safetensors or shards listed by model.safetensors.index.json
(F32, F16, BF16), tokenizer.json (+ tokenizer_config.json for BOS/EOS). GGUF: gguf_file.py
reads the header and maps the tensors; quantized ones (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, ...) are
dequantized on read by the `gguf` package, and q/k rows go back from llama.cpp's interleaved
RoPE pairs to HF's halves.
"""

from __future__ import annotations

import json
import pathlib
import struct

import gguf
import ml_dtypes
import numpy as np

from nsa_jax.pretrained import PretrainedError
from nsa_jax.pretrained.gguf_file import FLOATS, GGUFFile
from nsa_jax.pretrained.tokenizer import gguf_tokenizer_json

SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
# GGUF tensor types this importer dequantizes (gguf.quants does the arithmetic).
GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
DEQUANT_ROWS = 4096
# HF name -> GGUF name, per layer ({i}) and global.
GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "model.layers.{i}.self_attn.q_proj.bias": "blk.{i}.attn_q.bias",
    "model.layers.{i}.self_attn.k_proj.bias": "blk.{i}.attn_k.bias",
    "model.layers.{i}.self_attn.v_proj.bias": "blk.{i}.attn_v.bias",
    "model.layers.{i}.self_attn.q_norm.weight": "blk.{i}.attn_q_norm.weight",
    "model.layers.{i}.self_attn.k_norm.weight": "blk.{i}.attn_k_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
}
# GGUF metadata key (after "<arch>.") -> HF config key.
GGUF_CONFIG = {
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "context_length": "max_position_embeddings",
    "vocab_size": "vocab_size",
    "attention.sliding_window": "sliding_window",
}


class Checkpoint:
    """One checkpoint's config, tensors by HF name and tokenizer (subclasses per format)."""

    path: pathlib.Path
    hf_config: dict
    names: set[str]
    tokenizer_json: str | None = None  # the tokenizers library's JSON text
    special_ids: dict  # {"bos": id | None, "eos": id | None, "add_bos": bool}

    def tensor(self, name: str) -> np.ndarray:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    @property
    def fp32_bytes(self) -> int:
        """What the model's tensors take as fp32."""
        return sum(4 * int(np.prod(self.shape(n))) for n in self.names)


def open_checkpoint(path: str | pathlib.Path) -> Checkpoint:
    """A HF folder (config.json + safetensors) or a .gguf file; PretrainedError when it is neither."""
    p = pathlib.Path(path)
    if not p.exists():
        raise PretrainedError(f"{p} does not exist; pass a HF model folder (config.json + *.safetensors) or a .gguf")
    if p.is_file():
        if _magic(p) == b"GGUF":
            return GGUFCheckpoint(p)
        raise PretrainedError(f"{p} is not a GGUF file (no GGUF magic); pass a .gguf file or a HF model folder")
    if not (p / "config.json").is_file():
        raise PretrainedError(f"{p} has no config.json; a HF model folder holds config.json and *.safetensors")
    return SafetensorsCheckpoint(p)


def _magic(p: pathlib.Path) -> bytes:
    with open(p, "rb") as f:
        return f.read(4)


class SafetensorsCheckpoint(Checkpoint):
    """A HF folder: one model.safetensors, or shards named by model.safetensors.index.json."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self.hf_config = read_json(path / "config.json")
        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise PretrainedError(f"{index} has no weight_map; a sharded folder's index names each tensor's file")
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (path / f).is_file()]
            if missing:
                raise PretrainedError(
                    f"{path} misses {len(missing)} of the {len(files)} shards its index names "
                    f"({', '.join(missing[:3])}); download the whole folder again"
                )
        else:
            files = sorted(q.name for q in path.glob("*.safetensors"))
        if not files:
            raise PretrainedError(f"{path} has no *.safetensors files; save the model with safe_serialization=True")
        self._where: dict[str, tuple[pathlib.Path, dict, int]] = {}
        for name in files:
            header, start = _safetensors_header(path / name)
            for key, info in header.items():
                if key != "__metadata__":
                    self._where[key] = (path / name, info, start)
        self.names = set(self._where)
        tok = path / "tokenizer.json"
        self.tokenizer_json = tok.read_text() if tok.is_file() else None
        self.special_ids = _hf_special_ids(path, self.hf_config, self.tokenizer_json)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name][1]["shape"])

    def tensor(self, name: str) -> np.ndarray:
        file, info, start = self._where[name]
        if info["dtype"] not in SAFETENSORS_DTYPES:
            raise PretrainedError(
                f"{file.name}: tensor {name} is {info['dtype']}; supported: {', '.join(SAFETENSORS_DTYPES)}"
            )
        begin, end = info["data_offsets"]
        dtype = np.dtype(SAFETENSORS_DTYPES[info["dtype"]])
        raw = np.memmap(file, dtype=np.uint8, mode="r", offset=start + begin, shape=(end - begin,))
        return raw.view(dtype).reshape(info["shape"]).astype(np.float32)


def read_json(path: pathlib.Path) -> dict:
    """A JSON object from `path`; PretrainedError naming the file, line and column when it is not one."""
    try:
        value = json.loads(path.read_text())
    except UnicodeDecodeError:
        raise PretrainedError(f"{path} is not text (not UTF-8); it should be a JSON file") from None
    except json.JSONDecodeError as e:
        raise PretrainedError(f"{path} is not valid JSON: line {e.lineno}, column {e.colno}: {e.msg}") from None
    if not isinstance(value, dict):
        raise PretrainedError(f"{path} holds a JSON {type(value).__name__}, not an object")
    return value


def _safetensors_header(file: pathlib.Path) -> tuple[dict, int]:
    """(the header, the data's start) of a safetensors file, checked against the file's size: a truncated
    file or a corrupt header is one PretrainedError naming the file."""
    size = file.stat().st_size
    broken = f"{file} is not a complete safetensors file"
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise PretrainedError(f"{broken} ({size} bytes); download it again")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise PretrainedError(f"{broken}: its header claims {n:,} bytes, the file has {size:,}; download it again")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise PretrainedError(f"{broken}: its header is not JSON; download it again") from None
    if not isinstance(header, dict):
        raise PretrainedError(f"{broken}: its header is not a JSON object")
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            begin, end = info["data_offsets"]
            ok = 0 <= begin <= end and 8 + n + end <= size
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise PretrainedError(
                f"{broken}: tensor {key}'s data lies outside the file ({size:,} bytes); download it again"
            )
    return header, 8 + n


def _hf_special_ids(path: pathlib.Path, hf: dict, tokenizer_json: str | None) -> dict:
    """BOS/EOS as the model defines them: tokenizer_config.json's tokens, else config.json's ids."""
    ids = {"bos": hf.get("bos_token_id"), "eos": hf.get("eos_token_id"), "add_bos": False}
    tc_file = path / "tokenizer_config.json"
    if tc_file.is_file() and tokenizer_json:
        tc = read_json(tc_file)
        vocab = {t["content"]: t["id"] for t in json.loads(tokenizer_json).get("added_tokens", [])}
        for key in ("bos", "eos"):
            token = tc.get(f"{key}_token")
            token = token.get("content") if isinstance(token, dict) else token
            if token in vocab:
                ids[key] = vocab[token]
        ids["add_bos"] = bool(tc.get("add_bos_token", False))
    if isinstance(ids["eos"], list):  # several end tokens (Llama 3 instruct): the first ends generation
        ids["eos"] = ids["eos"][0]
    return ids


class GGUFCheckpoint(Checkpoint):
    """A GGUF file of the llama, mistral, qwen2 or qwen3 architecture (gguf_file.py reads it)."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self._file = GGUFFile(path)
        meta = self._file.metadata
        arch = meta.get("general.architecture", "?")
        self.arch = arch
        self.hf_config = {"model_type": arch, "architectures": [f"gguf:{arch}"]}
        for key, hf_key in GGUF_CONFIG.items():
            if f"{arch}.{key}" in meta:
                self.hf_config[hf_key] = meta[f"{arch}.{key}"]
        tensors = self._file.tensors
        self._hf_to_gguf = {}
        for hf_name, g_name in GGUF_NAMES.items():
            layers = range(int(self.hf_config.get("num_hidden_layers", 0))) if "{i}" in hf_name else [None]
            for i in layers:
                if g_name.format(i=i) in tensors:
                    self._hf_to_gguf[hf_name.format(i=i)] = g_name.format(i=i)
        self.names = set(self._hf_to_gguf)
        self.hf_config["tie_word_embeddings"] = "output.weight" not in tensors
        if "vocab_size" not in self.hf_config and "token_embd.weight" in tensors:
            self.hf_config["vocab_size"] = int(tensors["token_embd.weight"][0][0])
        self.tokenizer_json, self.special_ids = gguf_tokenizer_json(meta)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._file.tensors[self._hf_to_gguf[name]][0]

    def tensor(self, name: str) -> np.ndarray:
        g_name = self._hf_to_gguf[name]
        shape, kind = self._file.tensors[g_name]
        if kind not in GGUF_TYPES:
            raise PretrainedError(f"{self.path.name}: tensor {g_name} is GGUF type {kind}; supported: {GGUF_TYPES}")
        raw = self._file.raw(g_name)
        x = np.empty(shape, np.float32)
        if kind in FLOATS:
            x[...] = raw
        else:  # [rows, bytes a row]: a few thousand rows at a time, as dequantizing keeps several temporaries
            qtype = gguf.GGMLQuantizationType[kind]
            rows = x.reshape(raw.shape[0], -1)
            for start in range(0, rows.shape[0], DEQUANT_ROWS):
                part = np.asarray(raw[start : start + DEQUANT_ROWS])
                rows[start : start + len(part)] = gguf.quants.dequantize(part, qtype).reshape(len(part), -1)
        # llama.cpp stores q and k rows with each RoPE pair interleaved; HF (and this project) rotates halves.
        if self.arch in ("llama", "mistral") and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = self.hf_config["num_attention_heads"] if "q_proj" in name else self.hf_config["num_key_value_heads"]
            x = x.reshape(heads, x.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(x.shape)
        return x
