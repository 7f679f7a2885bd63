"""A checkpoint's tensors as the model's parameters: dense as it was, or NSA started from it.

`dense_params(ckpt, cfg)` lays the HF-named tensors out as NSALM's scanned parameters
(fp32 numpy, [L, ...] per layer stack; torch's [out, in] Linear weights transposed to
Dense's [in, out]), filling each stack in place one layer's tensor at a time. Every tensor
is checked against the shape the config implies: a missing one or a wrong shape is a
PretrainedError naming it.

`nsa_params(dense, cfg, rng)` is the NSA model started from a dense one (docs/PRETRAINED.md
"From dense to NSA"): queries, output, MLP, norms and embeddings copied; each branch's keys
and values (k_cmp/k_slc/k_win, v_*) the dense k and v; the gates' last layer has a zero
kernel, so every gate starts at sigmoid(model.nsa.gate_bias_init) whatever the token; the
compressors and the gate's first layer keep their initialisation (docs/PRETRAINED.md has
the step-0 losses behind launch.convert's gate start).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from nsa_jax.config import BRANCHES, ModelConfig
from nsa_jax.model import init_params
from nsa_jax.pretrained import PretrainedError
from nsa_jax.pretrained.checkpoints import Checkpoint

LAYER = "model.layers.{i}."
# (project path inside a layer, HF name after "model.layers.{i}.", transpose)
LAYER_TENSORS = (
    (("attn_norm", "scale"), "input_layernorm.weight", False),
    (("mlp_norm", "scale"), "post_attention_layernorm.weight", False),
    (("attn", "q", "kernel"), "self_attn.q_proj.weight", True),
    (("attn", "k", "kernel"), "self_attn.k_proj.weight", True),
    (("attn", "v", "kernel"), "self_attn.v_proj.weight", True),
    (("attn", "o", "kernel"), "self_attn.o_proj.weight", True),
    (("mlp", "w1", "kernel"), "mlp.gate_proj.weight", True),
    (("mlp", "w3", "kernel"), "mlp.up_proj.weight", True),
    (("mlp", "w2", "kernel"), "mlp.down_proj.weight", True),
)
BIASES = tuple((("attn", n, "bias"), f"self_attn.{n}_proj.bias", False) for n in "qkv")
QK_NORMS = tuple((("attn", f"{n}_norm", "scale"), f"self_attn.{n}_norm.weight", False) for n in "qk")
# Gemma's norms (model.post_norms): its post_attention_layernorm is the attention's output norm,
# and the MLP's input norm is pre_feedforward_layernorm.
POST_NORMS = (
    (("attn_post_norm", "scale"), "post_attention_layernorm.weight", False),
    (("mlp_norm", "scale"), "pre_feedforward_layernorm.weight", False),
    (("mlp_post_norm", "scale"), "post_feedforward_layernorm.weight", False),
)


def layer_tensors(cfg: ModelConfig) -> tuple:
    """(project path, HF name, transpose) of every per-layer tensor the config's model has."""
    table = LAYER_TENSORS
    if cfg.post_norms:
        table = tuple(t for t in table if t[0][0] != "mlp_norm") + POST_NORMS
    return table + (BIASES if cfg.qkv_bias else ()) + (QK_NORMS if cfg.qk_norm else ())


def _put(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def _reader(ckpt: Checkpoint):
    def read(name: str, shape: tuple[int, ...], transpose: bool) -> np.ndarray:
        if name not in ckpt.names:
            raise PretrainedError(f"{ckpt.path.name}: tensor {name} is missing")
        got = ckpt.shape(name)
        expect = shape[::-1] if transpose else shape
        if tuple(got) != tuple(expect):
            raise PretrainedError(
                f"{ckpt.path.name}: tensor {name} has shape {list(got)}; the config implies {list(expect)}"
            )
        x = ckpt.tensor(name)
        return x.T if transpose else x

    return read


def dense_params(ckpt: Checkpoint, cfg: ModelConfig, kv: bool = True) -> dict:
    """NSALM(cfg) parameters (cfg.attention == "dense", scanned layers) from `ckpt`'s tensors
    (`kv=False`: all but the attention's k and v, for an NSA export's shared part)."""
    want = jax.tree.map(lambda s: s.shape, _shapes(cfg))
    read = _reader(ckpt)
    params: dict = {}
    table = layer_tensors(cfg)
    if not kv:
        table = tuple(t for t in table if t[0][:2] not in (("attn", "k"), ("attn", "v")))
    for path, hf_name, transpose in table:
        full = ("layers", *path)
        shape = _get(want, full)
        stack = np.empty(shape, np.float32)
        for i in range(cfg.n_layers):
            stack[i] = read(LAYER.format(i=i) + hf_name, shape[1:], transpose)
        _put(params, full, stack)
    _put(params, ("embed", "embedding"), read("model.embed_tokens.weight", _get(want, ("embed", "embedding")), False))
    _put(params, ("final_norm", "scale"), read("model.norm.weight", _get(want, ("final_norm", "scale")), False))
    if not cfg.tie_embeddings:
        _put(params, ("lm_head", "kernel"), read("lm_head.weight", _get(want, ("lm_head", "kernel")), True))
    return params


# An NSA export's own parts (pretrained/export.py nsa_hf_tensors): a layer's attention by its path, as stored.
NSA_PREFIX = "self_attn.nsa."
NSA_SHARED = ("q", "o", "q_norm", "k_norm")


def nsa_checkpoint_params(ckpt: Checkpoint, cfg: ModelConfig) -> dict:
    """NSALM(cfg) parameters (NSA) from an NSA export: the shared part by HF names, the rest of
    each layer's attention from `model.layers.{i}.self_attn.nsa.<path>`."""
    dense_cfg = dataclasses.replace(cfg, attention="dense")  # Gemma's local layers keep their window
    params = dense_params(ckpt, dense_cfg, kv=False)
    want = jax.tree.map(lambda s: s.shape, _shapes(cfg))["layers"]["attn"]
    read = _reader(ckpt)
    attn = params["layers"]["attn"]
    for path, shape in jax.tree_util.tree_leaves_with_path(want, is_leaf=lambda x: isinstance(x, tuple)):
        keys = tuple(p.key for p in path)
        if keys[0] in NSA_SHARED:
            continue
        stack = np.empty(shape, np.float32)
        for i in range(cfg.n_layers):
            stack[i] = read(LAYER.format(i=i) + NSA_PREFIX + ".".join(keys), shape[1:], False)
        _put(attn, keys, stack)
    return params


def _shapes(cfg: ModelConfig):
    from nsa_jax.info import param_shapes  # noqa: PLC0415 - shapes of the model, traced only when needed

    return param_shapes(dataclasses.replace(cfg, scan_layers=True))


def nsa_params(dense: dict, cfg: ModelConfig, rng: jax.Array) -> dict:
    """NSALM(cfg) parameters (cfg.attention == "nsa") started from `dense` (dense_params' layout).

    The dense arrays are shared, not copied (the branches' keys and values are the same array
    three times until the first update); only the new parts are initialised, in one program
    that returns just them, so the host never holds a random copy of the whole model.
    """
    dense_attn = dense["layers"]["attn"]
    copied = {"q", "o", "q_norm", "k_norm", "k", "v"}

    def new_parts(key):
        attn = init_params(dataclasses.replace(cfg, scan_layers=True), key)["layers"]["attn"]
        return {name: value for name, value in attn.items() if name not in copied and name[2:] not in BRANCHES}

    attn = jax.tree.map(lambda x: np.array(x, np.float32), jax.jit(new_parts)(rng))
    attn["gate_fc2"]["kernel"] = np.zeros_like(attn["gate_fc2"]["kernel"])
    attn.update({name: dense_attn[name] for name in ("q", "o", "q_norm", "k_norm") if name in dense_attn})
    for branch in BRANCHES:
        attn[f"k_{branch}"], attn[f"v_{branch}"] = dense_attn["k"], dense_attn["v"]
    layers = {name: value for name, value in dense["layers"].items() if name != "attn"} | {"attn": attn}
    return {name: value for name, value in dense.items() if name != "layers"} | {"layers": layers}
