"""The decoder-only NSA language model.

tokens[B, T] -> embedding -> L x (pre-RMSNorm NSA attention (or dense, model.attention) + pre-RMSNorm gated
MLP) -> final RMSNorm -> LM head -> fp32 logits[B, T, V]; Gemma's features (model.embed_scale,
post_norms, final_softcap, norm_plus_one, global_every) where the config sets them. Layers are scanned
(`nn.scan`), so the compiled program does not grow with depth; each block can
be rematerialised (`remat`).

The same modules decode (NSAAttention's `mode`): `NSALM(cfg, mode="prefill")`
runs the forward over right-padded prompts and fills the `cache` collection
(lengths_B tokens per row); `NSALM(cfg, mode="decode")` feeds one token per row
at the row's position `cache["pos"][b]` and advances it. Both carry the cache
through the layer scan (`variable_carry`), so every layer updates it in place.
nsa_jax/inference builds the cache and drives generation.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from nsa_jax.config import ModelConfig
from nsa_jax.kernels.xla import soft_cap
from nsa_jax.layers import DenseParams, GatedMLP, RMSNorm
from nsa_jax.nsa.attention import MODES, ModelPart
from nsa_jax.nsa.decode import missing_cache
from nsa_jax.nsa.dense import DenseAttention
from nsa_jax.nsa.layer import NSAAttention

_REMAT_POLICIES = {
    "full": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Block(ModelPart):
    """x + attn(norm(x)), then x + mlp(norm(x)); model.post_norms: x + norm(attn(norm(x))), the MLP alike.

    `layer` (the index into the cache's layer axis) and `pos_B` are for prefill/decode, and
    under model.global_every for training too (whether the layer is local).
    """

    @nn.compact
    def __call__(
        self,
        x_BxTxD: jax.Array,
        layer: jax.Array | None = None,
        pos_B: jax.Array | None = None,
        rope_positions_T: jax.Array | None = None,
    ):
        cfg = self.cfg
        dtype = jnp.dtype(cfg.dtype)
        norm = partial(RMSNorm, cfg.norm_eps, dtype, cfg.norm_plus_one)
        post = (lambda name: norm(name=name)) if cfg.post_norms else (lambda name: lambda y: y)
        h = norm(name="attn_norm")(x_BxTxD)
        if cfg.attention == "dense":
            attn = DenseAttention(cfg, self.mode, self.kernels, name="attn")
        else:
            attn = NSAAttention(cfg, self.mode, self.kernels, name="attn")
        x_BxTxD = x_BxTxD + post("attn_post_norm")(attn(h, layer=layer, pos_B=pos_B, rope_positions_T=rope_positions_T))
        h = norm(name="mlp_norm")(x_BxTxD)
        out_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5
        mlp = GatedMLP(cfg.d_ff, dtype=dtype, init_std=cfg.init_std, out_std=out_std, act=cfg.mlp_act, name="mlp")
        x_BxTxD = x_BxTxD + post("mlp_post_norm")(mlp(h))
        return x_BxTxD, None


class NSALM(ModelPart):
    """tokens[B, T] int32 -> logits[B, T, V] fp32.

    `mode` "train": the forward; `rope_positions_T` (train only) moves RoPE off 0..T-1
    (train.rope_positions); `head=False` returns the final-normed hidden states [B, T, D]
    instead of the logits (the loss then makes them in chunks, train.loss_chunk).
    "prefill": the forward over left-aligned, right-padded prompts, row b of length
    lengths_B[b]; writes the cache.
    "decode": tokens [B, 1], row b at position cache["pos"][b]; updates the cache.
    `kernels`: what each NSA branch runs (kernels.plan_kernels; None: each layer's
    default, the config's plan on jax's backend). A plan with a `layout` (context
    parallelism; train, inside shard_map): tokens_BxT are this device's 2S tokens of
    sequences split over the `seq` mesh axis (nsa/context.py); rope_positions_T, if
    given, are theirs too.
    """

    # fsdp (step/strategies.py): one layer's variables with their parameter slices gathered whole,
    # applied as each layer runs; None: the parameters come whole.
    layer_gather: Callable | None = None

    @nn.compact
    def __call__(
        self,
        tokens_BxT: jax.Array,
        lengths_B: jax.Array | None = None,
        rope_positions_T: jax.Array | None = None,
        head: bool = True,
    ) -> jax.Array:
        cfg = self.cfg
        dtype = jnp.dtype(cfg.dtype)
        embed = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=nn.initializers.normal(cfg.init_std), name="embed")
        x = embed(tokens_BxT).astype(dtype)
        if cfg.embed_scale:  # Gemma: sqrt(D) in the activations' dtype, as the checkpoints were trained
            x = x * jnp.asarray(cfg.d_model**0.5, dtype)
        block = Block
        if self.layer_gather is not None:
            # Inside the remat below: the backward gathers a layer again instead of keeping it.
            block = nn.map_variables(block, "params", trans_in_fn=self.layer_gather, init=False)
        if cfg.remat != "none":
            # Only a loop keeps XLA from merging the recomputation with the forward: a scan
            # unrolled to its length (no loop left) needs the barrier like unrolled layers.
            looped = cfg.scan_layers and cfg.scan_unroll < cfg.n_layers
            block = nn.remat(block, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=not looped)
        if self.mode not in MODES:
            raise ValueError(f"NSALM mode must be one of {MODES}, got {self.mode!r}")
        if self.mode != "train":
            if rope_positions_T is not None:
                raise ValueError("rope_positions_T is for training; prefill/decode place tokens by the cache")
            if not cfg.scan_layers:
                raise ValueError("prefill/decode run the scanned layers: set scan_layers (inference_config)")
            if self.mode == "prefill" and lengths_B is None:
                lengths_B = jnp.full((tokens_BxT.shape[0],), tokens_BxT.shape[1], jnp.int32)
            pos = self.variable("cache", "pos", missing_cache("NSALM"), "pos")
            pos_B = lengths_B.astype(jnp.int32) if self.mode == "prefill" else pos.value
            # The cache rides in the scan carry (every layer indexes its own slice), not
            # as scanned xs/ys: a scan's ys would rewrite the whole cache every step.
            stack = layer_stack(block, cfg, variable_carry="cache", in_axes=(0, nn.broadcast))
            layer_L = jnp.arange(cfg.n_layers, dtype=jnp.int32)
            x, _ = stack(cfg, self.mode, self.kernels, name="layers")(x, layer_L, pos_B)
            pos.value = pos_B if self.mode == "prefill" else pos_B + 1
        elif cfg.scan_layers and cfg.global_every:  # each layer's index: is it local?
            stack = layer_stack(block, cfg, in_axes=(0, nn.broadcast, nn.broadcast), unroll=cfg.scan_unroll)
            layer_L = jnp.arange(cfg.n_layers, dtype=jnp.int32)
            x, _ = stack(cfg, "train", self.kernels, name="layers")(x, layer_L, None, rope_positions_T)
        elif cfg.scan_layers:
            stack = layer_stack(block, cfg, in_axes=(nn.broadcast,) * 3, unroll=cfg.scan_unroll)
            x, _ = stack(cfg, "train", self.kernels, name="layers")(x, None, None, rope_positions_T)
        else:
            for i in range(cfg.n_layers):
                layer = i if cfg.global_every else None
                x, _ = block(cfg, "train", self.kernels, name=f"layer_{i}")(x, layer, None, rope_positions_T)
        x = RMSNorm(cfg.norm_eps, dtype, cfg.norm_plus_one, name="final_norm")(x)
        if cfg.tie_embeddings:
            w = embed.embedding
        else:  # an nn.Dense's kernel, applied by head_logits
            w = DenseParams(cfg.vocab_size, kernel_init=nn.initializers.normal(cfg.init_std), name="lm_head")(
                cfg.d_model
            )[0]
        return x if not head else head_logits(cfg, w, x)


def per_layer(variables: dict, collection: str, name: str, cfg: ModelConfig):
    """What each layer's attention sowed as `collection`/`name`, stacked on a leading [L] axis; None if absent.

    `variables` is what `NSALM.apply(..., mutable=[collection])` returned besides the
    logits: one leaf with a layer axis for scanned layers, one leaf per `layer_i` unrolled.
    """
    col = variables.get(collection, {})
    if cfg.scan_layers:
        value = col.get("layers", {}).get("attn", {}).get(name)
        return value[0] if value else None
    values = [col.get(f"layer_{i}", {}).get("attn", {}).get(name) for i in range(cfg.n_layers)]
    return jax.tree.map(lambda *v: jnp.stack(v), *[v[0] for v in values]) if all(values) else None


def layer_stack(block, cfg: ModelConfig, **scan):
    """The layers as one nn.scan over `block` (a layer axis on every per-layer collection); `scan`:
    the mode's in_axes, and the cache as a carry in prefill/decode or the unroll in training."""
    per_layer = {"params": 0, "intermediates": 0, "aux": 0, "losses": 0, "scorer_inputs": 0}
    return nn.scan(block, variable_axes=per_layer, split_rngs={"params": True}, length=cfg.n_layers, **scan)


def cast_dense_kernels(params, dtype):
    """`params` with every Dense `kernel` in `dtype` (the model's compute dtype); other leaves as they are.

    Every nn.Dense here computes in the model dtype and casts its fp32 kernel at each
    use, so the values are the same; cast once before the layer scan, the casts (one
    kernel launch per matrix, layer and micro-batch, forward and backward) leave the
    scan bodies, and the gradient comes back in fp32 through the one cast.
    """
    dtype = jnp.dtype(dtype)

    def cast(path, leaf):
        return leaf.astype(dtype) if getattr(path[-1], "key", None) == "kernel" else leaf

    return jax.tree_util.tree_map_with_path(cast, params)


def init_params(cfg: ModelConfig, rng: jax.Array, seq_len: int = 0):
    """fp32 parameters of the model (shapes do not depend on seq_len)."""
    T = max(seq_len, cfg.nsa.l)
    return NSALM(cfg).init(rng, jnp.zeros((1, T), jnp.int32))["params"]


def head_matrix(cfg: ModelConfig, params) -> jax.Array:
    """The output projection of `params`: the embedding [V, D] (tied) or lm_head's kernel [D, V]."""
    return params["embed"]["embedding"] if cfg.tie_embeddings else params["lm_head"]["kernel"]


def head_logits(cfg: ModelConfig, w: jax.Array, x_BxTxD: jax.Array) -> jax.Array:
    """Logits [B, T, V] fp32 of the final-normed x: x @ embedding^T in fp32 (tied, as nn.Embed.attend),
    else x @ kernel in the model dtype (as nn.Dense); capped by model.final_softcap."""
    if cfg.tie_embeddings:
        logits = jnp.dot(x_BxTxD.astype(jnp.float32), w.astype(jnp.float32).T)
    else:
        dtype = jnp.dtype(cfg.dtype)
        logits = jnp.dot(x_BxTxD.astype(dtype), w.astype(dtype)).astype(jnp.float32)
    return soft_cap(logits, cfg.final_softcap)


def rows_nll(
    cfg: ModelConfig, params, out: jax.Array, targets_BxL: jax.Array, chunk: int = 0, hits: bool = False
) -> tuple[jax.Array, jax.Array | None]:
    """(nll_BxL fp32, argmax == target [B, L] or None): the one NLL of rows, for training, held-out
    evaluation and the long-context scorer.

    `out` is what NSALM.apply gave with `head=not chunk`: the logits [B, L, V] (chunk 0), or the
    final-normed hidden states, whose logits are then made `chunk` positions at a time and, under
    differentiation, recomputed in the backward (jax.checkpoint per chunk): [B, chunk, V] at once
    instead of [B, L, V] and its gradient, the largest buffers of a step at long T and a large
    vocabulary (train.loss_chunk).
    """
    if not chunk:
        return token_nll(out, targets_BxL), (jnp.argmax(out, axis=-1) == targets_BxL) if hits else None
    head = head_matrix(cfg, params)
    B, L = out.shape[:2]
    n = -(-L // chunk)
    pad = ((0, 0), (0, n * chunk - L))
    x, targets = jnp.pad(out, (*pad, (0, 0))), jnp.pad(targets_BxL, pad)

    def chunks(a):  # [B, n*chunk, ...] -> [n, B, chunk, ...]
        return jnp.moveaxis(a.reshape(B, n, chunk, *a.shape[2:]), 1, 0)

    @jax.checkpoint
    def one(xt):
        logits_BxcxV = head_logits(cfg, head, xt[0])
        nll = token_nll(logits_BxcxV, xt[1])
        return (nll, jnp.argmax(logits_BxcxV, axis=-1) == xt[1]) if hits else (nll, None)

    nll, hit = jax.lax.map(one, (chunks(x), chunks(targets)))  # [n, B, chunk]
    unchunk = lambda a: jnp.moveaxis(a, 0, 1).reshape(B, n * chunk)[:, :L]  # noqa: E731
    return unchunk(nll), unchunk(hit) if hits else None


def token_nll(logits_BxTxV: jax.Array, targets_BxT: jax.Array) -> jax.Array:
    """Next-token negative log-likelihood per position [B, T], fp32."""
    logits = logits_BxTxV.astype(jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)
    gold = jnp.take_along_axis(logits, targets_BxT[..., None], axis=-1)[..., 0]
    return logz - gold


def cross_entropy(logits_BxTxV: jax.Array, targets_BxT: jax.Array, weight_BxT: jax.Array | None = None) -> jax.Array:
    """Mean next-token cross-entropy in fp32; with `weight_BxT` (a bool mask or weights) the weighted mean."""
    nll = token_nll(logits_BxTxV, targets_BxT)
    if weight_BxT is None:
        return jnp.mean(nll)
    weight = weight_BxT.astype(jnp.float32)
    return jnp.sum(nll * weight) / jnp.maximum(jnp.sum(weight), 1.0)
