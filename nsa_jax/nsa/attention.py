"""The call every attention of the model's stack answers, and the fields every part carries.

`Attention`: x[B, T, D] -> [B, T, D] in one of MODES (train, prefill, decode); its two cores
are NSAAttention (nsa/layer.py: gates and the three branches) and DenseAttention
(nsa/dense.py: causal or windowed softmax attention). Both start from the same input stage and
end in the same output projection (nsa/inputs.py); their decode state is nsa/decode.py's.
`local_layer`: which layers are local under model.global_every (Gemma's local/global pattern).
"""

from __future__ import annotations

import flax.linen as nn
import jax

from nsa_jax.config import ModelConfig
from nsa_jax.kernels import KernelPlan

MODES = ("train", "prefill", "decode")


def local_layer(cfg: ModelConfig, layer):
    """Whether layer `layer` is local (model.global_every: it sees model.dense_window keys, a global
    one every earlier key): None when every layer is alike, a bool for a static index, a traced
    bool for the scan's."""
    if not cfg.global_every:
        return None
    if layer is None:
        raise ValueError("model.global_every: the attention needs its layer's index")
    local = (layer + 1) % cfg.global_every != 0
    return bool(local) if isinstance(layer, int) else local


def check_mode(mode: str, T: int, layer, pos_B) -> None:
    """ValueError unless `mode` is one of MODES with what it needs (prefill, decode: layer, pos_B; decode: T = 1)."""
    if mode not in MODES:
        raise ValueError(f"attention mode must be one of {MODES}, got {mode!r}")
    if mode != "train" and (layer is None or pos_B is None):
        raise ValueError(f"attention mode={mode!r} needs `layer` and `pos_B`")
    if mode == "decode" and T != 1:
        raise ValueError(f"decode feeds one token per row, got {T}")


class ModelPart(nn.Module):
    """The fields every module of the model's stack carries (NSALM, Block, the attentions): the model
    config, the mode (one of MODES) and what each NSA branch runs (kernels.plan_kernels; None: the
    config's plan at the input's length on jax's backend), with the sequence layout under context
    parallelism (`KernelPlan.layout`)."""

    cfg: ModelConfig
    mode: str = "train"
    kernels: KernelPlan | None = None


class Attention(ModelPart):
    """The call every attention of the stack answers (NSAAttention, nsa/dense.DenseAttention):
    x[B, T, D] -> [B, T, D]. `layer` (index into the cache's layer axis) and `pos_B` are for
    prefill and decode; `rope_positions_T` moves RoPE off the token indices (train only)."""

    def __call__(self, x_BxTxD: jax.Array, *, layer=None, pos_B=None, rope_positions_T=None) -> jax.Array:
        check_mode(self.mode, x_BxTxD.shape[1], layer, pos_B)
        return self.attend(x_BxTxD, layer, pos_B, rope_positions_T)

    def attend(self, x_BxTxD, layer, pos_B, rope_positions_T) -> jax.Array:
        raise NotImplementedError
