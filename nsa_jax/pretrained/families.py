"""A pretrained model's config (HF's keys) -> the project's ModelConfig of the same model.

The Llama family and the members that differ from it (docs/PRETRAINED.md): Llama 2 and 3.x
(RoPE scaling "llama3"), SmolLM2 (a Llama), Mistral (a sliding window), Qwen2/2.5 (q/k/v
biases), Qwen3 (per-head q/k RMSNorm, a head_dim of its own); and Gemma 2 and 3 (`gemma`:
(1 + w) norms, post norms, GeGLU, a scaled embedding, query_pre_attn_scalar, soft-caps, the
local/global layer pattern and, in Gemma 3, the local layers' own RoPE base). Any GQA group
and head_dim, tied or untied embeddings. The model comes out dense (model.attention=dense), in fp32.
"""

from __future__ import annotations

from nsa_jax.config import ModelConfig, RopeScaling
from nsa_jax.pretrained import PretrainedError

# model_type -> what it adds to Llama's layer.
FAMILIES = {
    "llama": "Llama 2/3.x, SmolLM2",
    "mistral": "Mistral",
    "qwen2": "Qwen2/2.5",
    "qwen3": "Qwen3",
    "gemma2": "Gemma 2",
    "gemma3_text": "Gemma 3 (text)",
}
GEMMA = ("gemma2", "gemma3_text")


def supported() -> str:
    return ", ".join(f"{k} ({v})" for k, v in FAMILIES.items())


def _rope(hf: dict, params: dict | None = None) -> tuple[float, RopeScaling]:
    """(theta, scaling): from rope_theta/rope_scaling, or the rope_parameters newer configs write
    (`params`: one layer type's, Gemma 3's full_attention)."""
    params = params if params is not None else hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    theta = float(hf.get("rope_theta") or params.get("rope_theta") or 10000.0)
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return theta, RopeScaling()
    if kind == "linear":
        return theta, RopeScaling(kind="linear", factor=float(scaling["factor"]))
    if kind != "llama3":
        raise PretrainedError(
            f"config.json: rope scaling {kind!r} is not supported (supported: default, linear, llama3)"
        )
    return theta, RopeScaling(
        kind="llama3",
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_len=int(scaling["original_max_position_embeddings"]),
    )


def model_config(hf: dict) -> ModelConfig:
    """The dense ModelConfig of the checkpoint whose config.json is `hf`; PretrainedError when the
    architecture or a feature of it is not supported."""
    kind = hf.get("model_type")
    if kind not in FAMILIES:
        arch = ", ".join(hf.get("architectures") or []) or "?"
        raise PretrainedError(f"architecture {kind!r} ({arch}) is not supported; supported: {supported()}")
    if kind in GEMMA:
        return gemma_config(hf)
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise PretrainedError(f"config.json: hidden_act {act!r} is not supported (the MLP is SwiGLU: silu)")
    if hf.get("mlp_bias"):
        raise PretrainedError("config.json: mlp_bias=true is not supported (the MLP has no biases)")
    try:
        theta, scaling = _rope(hf)
        window = hf.get("sliding_window") if kind == "mistral" else None
        if kind == "qwen2" and hf.get("use_sliding_window"):
            raise PretrainedError("config.json: Qwen2's use_sliding_window=true is not supported")
        return ModelConfig(
            **_shape(hf, tied=False),
            rope_theta=theta,
            rope_scaling=scaling,
            qkv_bias=kind == "qwen2" or bool(hf.get("attention_bias", False)),
            qk_norm=kind == "qwen3",
            dense_window=int(window or 0),
        )
    except KeyError as e:
        raise PretrainedError(f"config.json has no {e.args[0]!r}, which a {FAMILIES[kind]} config needs") from None


def _shape(hf: dict, tied: bool) -> dict:
    """The ModelConfig keys every family reads alike (`tied`: the family's default for tie_word_embeddings);
    KeyError for a key the config lacks."""
    H, D = int(hf["num_attention_heads"]), int(hf["hidden_size"])
    Dk = int(hf.get("head_dim") or D // H)
    return dict(
        vocab_size=int(hf["vocab_size"]),
        d_model=D,
        n_layers=int(hf["num_hidden_layers"]),
        n_heads=H,
        n_kv_heads=int(hf.get("num_key_value_heads") or H),
        head_dim=Dk,
        v_head_dim=Dk,
        d_ff=int(hf["intermediate_size"]),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", tied)),
        attention="dense",
        init_std=float(hf.get("initializer_range", 0.02)),
    )


def _gemma_pattern(hf: dict, L: int) -> int:
    """global_every: the period of the config's local/global layers (layer_types, or the older
    sliding_window_pattern); PretrainedError for a pattern that is not 'every p-th layer global'."""
    types = hf.get("layer_types")
    if types is None:
        period = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 2)
        return period
    for period in range(1, L + 1):
        want = ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(L)]
        if list(types) == want:
            return period
    raise PretrainedError(
        f"config.json: layer_types {types} is not supported (supported: every p-th layer full_attention, the others "
        "sliding_attention)"
    )


def gemma_config(hf: dict) -> ModelConfig:
    """Gemma 2 / Gemma 3 (text): the dense ModelConfig with Gemma's features."""
    kind = hf["model_type"]
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise PretrainedError(f"config.json: {FAMILIES[kind]}'s hidden_activation {act!r} is not supported "
                              "(supported: gelu_pytorch_tanh)")  # fmt: skip
    if hf.get("use_bidirectional_attention"):
        raise PretrainedError("config.json: use_bidirectional_attention=true (an embedding model) is not supported")
    if hf.get("attention_bias"):
        raise PretrainedError(f"config.json: attention_bias=true is not supported for {FAMILIES[kind]}")
    try:
        H, D, L = int(hf["num_attention_heads"]), int(hf["hidden_size"]), int(hf["num_hidden_layers"])
        Dk = int(hf.get("head_dim") or D // H)
        period = _gemma_pattern(hf, L)
        window = int(hf.get("sliding_window") or 0)
        params = hf.get("rope_parameters") or {}
        if "full_attention" in params:  # per layer type (newer configs)
            theta, scaling = _rope(hf, params["full_attention"])
            local = params.get("sliding_attention") or {}
            if (local.get("rope_type") or "default") != "default":
                raise PretrainedError("config.json: RoPE scaling on the sliding_attention layers is not supported")
            local_theta = float(local.get("rope_theta") or theta)
        else:
            theta, scaling = _rope(hf)
            local_theta = float(hf.get("rope_local_base_freq") or theta)
        local_layers = period != 1 and window > 0
        if period != 1 and not window:
            raise PretrainedError("config.json: local (sliding_attention) layers need a sliding_window")
        return ModelConfig(
            **_shape(hf, tied=True),
            rope_theta=theta,
            rope_scaling=scaling,
            qk_norm=kind == "gemma3_text",
            dense_window=window if local_layers else 0,
            norm_plus_one=True,
            embed_scale=True,
            mlp_act="gelu_tanh",
            post_norms=True,
            query_scale=float(hf.get("query_pre_attn_scalar") or Dk),
            attn_softcap=float(hf.get("attn_logit_softcapping") or 0.0),
            final_softcap=float(hf.get("final_logit_softcapping") or 0.0),
            global_every=period if local_layers else 0,
            local_rope_theta=local_theta if local_layers and (local_theta != theta or scaling.kind != "none") else 0.0,
        )
    except KeyError as e:
        raise PretrainedError(f"config.json has no {e.args[0]!r}, which a {FAMILIES[kind]} config needs") from None
