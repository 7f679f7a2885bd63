"""Which part of the model an XLA instruction belongs to, from its `op_name` metadata.

The NSA layer runs each of its parts under a named scope (nsa/layer.py), which jax
writes into every op's `op_name` path, forward and backward:

    jit(step)/transpose(jvp(NSAAttention))/nsa_cmp/compress/dot_general

`part_of` reads the layer's scopes first, as whole path components, then the Pallas
kernels' own names (a device kernel a trace names no instruction for), then words of
the rest of the model (optimizer, MLP, norms, embedding and head). Both a
profile of the device's time (benchmarks/profile_step.py) and the bytes a compiled
program moves (tools/hlo_traffic.py) are summed by these parts.
"""

from __future__ import annotations

# The layer's named scopes (nsa/layer.py), first match wins: "nsa_cmp/compress" (the compression
# MLP) before "nsa_cmp" (the compressed attention with block scoring and top-n).
LAYER_PARTS = (
    ("selection", "nsa_slc"),
    ("compression MLP", "nsa_cmp/compress"),
    ("compressed attn + top-n", "nsa_cmp"),
    ("block scorer + top-n", "nsa_score"),
    ("window", "nsa_win"),
    ("qkv proj + RoPE", "nsa_qkv"),
    ("gates", "nsa_gates"),
    ("gated sum", "nsa_combine"),
    ("out proj", "nsa_out"),
    ("statistics", "nsa_stats"),
)
# The Pallas kernels by name (kernels/: nsa_block_select / nsa_block_scores / nsa_select_from_scores
# score the compressed keys and pick the top n; nsa_cmp_lse is the cuDNN path's log-sum-exp pass).
KERNEL_PARTS = (
    ("selection", ("nsa_selection",)),
    ("compressed attn + top-n", ("nsa_cmp", "nsa_block_s", "nsa_select_from_scores")),
    ("block scorer + top-n", ("nsa_minmax",)),
    ("window", ("nsa_window",)),
)
# The rest of the model, by words of the op_name path (first match wins).
OTHER_PARTS = (
    ("optimizer", ("optax", "adam", "clip", "/update", "global_norm")),
    ("mlp", ("mlp", "ffn", "w1", "w2", "w3")),
    ("norms", ("norm",)),
    ("embed/head/loss", ("embed", "lm_head", "head", "log_softmax", "cross_entropy", "logits")),
)
PARTS = tuple(name for name, _ in LAYER_PARTS) + tuple(name for name, _ in OTHER_PARTS) + ("other",)


def part_of(op_name: str) -> str:
    """The part of the model (one of PARTS) that the op at `op_name` belongs to."""
    path = f"/{op_name.lower()}/"
    for part, scope in LAYER_PARTS:
        if f"/{scope}/" in path:
            return part
    for part, prefixes in KERNEL_PARTS:
        if any(f"/{p}" in path or f":{p}" in path for p in prefixes):
            return part
    for part, needles in OTHER_PARTS:
        if any(n in path for n in needles):
            return part
    return "other"
