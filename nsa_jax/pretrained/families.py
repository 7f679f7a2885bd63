"""A pretrained model's config (HF's keys) -> the project's ModelConfig of the same model.

The Llama family and the members that differ from it (docs/PRETRAINED.md): Llama 2 and 3.x
(RoPE scaling "llama3"), SmolLM2 (a Llama), Mistral (a sliding window), Qwen2/2.5 (q/k/v
biases), Qwen3 (per-head q/k RMSNorm, a head_dim of its own). Any GQA group and head_dim,
tied or untied embeddings. The model comes out dense (model.attention=dense), in fp32.
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
}


def supported() -> str:
    return ", ".join(f"{k} ({v})" for k, v in FAMILIES.items())


def _rope(hf: dict) -> tuple[float, RopeScaling]:
    """(theta, scaling): from rope_theta/rope_scaling, or the rope_parameters newer configs write."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    theta = float(hf.get("rope_theta") or params.get("rope_theta") or 10000.0)
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return theta, RopeScaling()
    if kind != "llama3":
        raise PretrainedError(f"config.json: rope scaling {kind!r} is not supported (supported: default, llama3)")
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
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise PretrainedError(f"config.json: hidden_act {act!r} is not supported (the MLP is SwiGLU: silu)")
    if hf.get("mlp_bias"):
        raise PretrainedError("config.json: mlp_bias=true is not supported (the MLP has no biases)")
    try:
        H, D = int(hf["num_attention_heads"]), int(hf["hidden_size"])
        K = int(hf.get("num_key_value_heads") or H)
        Dk = int(hf.get("head_dim") or D // H)
        theta, scaling = _rope(hf)
        window = hf.get("sliding_window") if kind == "mistral" else None
        if kind == "qwen2" and hf.get("use_sliding_window"):
            raise PretrainedError("config.json: Qwen2's use_sliding_window=true is not supported")
        return ModelConfig(
            vocab_size=int(hf["vocab_size"]),
            d_model=D,
            n_layers=int(hf["num_hidden_layers"]),
            n_heads=H,
            n_kv_heads=K,
            head_dim=Dk,
            v_head_dim=Dk,
            d_ff=int(hf["intermediate_size"]),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=kind == "qwen2" or bool(hf.get("attention_bias", False)),
            qk_norm=kind == "qwen3",
            attention="dense",
            dense_window=int(window or 0),
            init_std=float(hf.get("initializer_range", 0.02)),
        )
    except KeyError as e:
        raise PretrainedError(f"config.json has no {e.args[0]!r}, which a {FAMILIES[kind]} config needs") from None
