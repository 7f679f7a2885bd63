"""AdamW with warmup + cosine (or warmup-stable-decay), counted in optimizer steps.

Owns the learning-rate schedule, the weight-decay mask and the optax chain
(global-norm clipping, then AdamW). Parameters and both Adam moments stay fp32
whatever the compute dtype: the model casts weights to `model.dtype` inside its
matmuls, so the optimizer always updates an fp32 master copy.

The schedule is a function of the optimizer step (the number of updates applied
so far), never of micro-batches: with `train.accumulate = A` one optimizer step
consumes A micro-batches and advances the schedule by one. AdamW here is decoupled
weight decay scaled by the LR (optax/torch convention): p -= lr * (adam + wd * p).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from nsa_jax.config import ConfigError, TrainConfig

# Leaves that are not decayed, by parameter name: norm scales, biases, the token
# embedding and the compressors' intra-block position embeddings. Decaying an
# embedding row pulls rarely-seen tokens towards zero, which hurts a byte vocabulary
# more than it regularises; matmul kernels (the LM head included) are decayed.
NO_DECAY_NAMES = ("scale", "bias", "embedding", "pos")


def learning_rate(step, cfg: TrainConfig):
    """LR used by the update that follows `step` completed optimizer steps.

    Linear warmup to `lr` over the first `warmup` updates (the first update already
    uses lr / warmup, not 0), then a cosine from `lr` down to `min_lr`, reached
    exactly by the last update (step = steps - 1). The cosine spans every update
    after the warm-up, or with `decay_steps = N > 0` only the last N (warmup-stable-
    decay: lr holds until then). With warmup >= steps the run ends inside the warmup.
    """
    step = jnp.asarray(step, jnp.float32)
    peak_at = max(cfg.warmup, 1) - 1  # the update that uses the peak LR
    warm = cfg.lr * (step + 1.0) / max(cfg.warmup, 1)
    # The cosine starts after `start`, the last update at the peak.
    start = max(cfg.steps - 1 - cfg.decay_steps, peak_at) if cfg.decay_steps else peak_at
    span = max(cfg.steps - 1 - start, 1)
    progress = jnp.clip((step - start) / span, 0.0, 1.0)
    cosine = cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
    return jnp.where(step < peak_at, warm, cosine)


def decay_mask(params):
    """True for the leaves AdamW decays (see NO_DECAY_NAMES)."""

    def keep(path, _leaf) -> bool:
        name = getattr(path[-1], "key", str(path[-1]))
        return name not in NO_DECAY_NAMES

    return jax.tree_util.tree_map_with_path(keep, params)


def frozen_mask(cfg: TrainConfig):
    """params -> True for the leaves that do not train: with train.trainable, those whose path names
    none of its entries (a converted model's new parts train first: gate_fc1, gate_fc2, k_cmp, v_cmp).
    A name no path holds is a ConfigError naming the ones it could be, not a silently frozen model."""

    def mask(params):
        paths = [{getattr(p, "key", str(p)) for p in path} for path, _ in jax.tree_util.tree_leaves_with_path(params)]
        known = set().union(*paths)
        unknown = [n for n in cfg.trainable if n not in known]
        if unknown:
            names = ", ".join(sorted(known))
            raise ConfigError(f"train.trainable: no parameter path holds {unknown[0]!r}; this model's names: {names}")
        frozen = iter([not names.intersection(cfg.trainable) for names in paths])
        return jax.tree.map(lambda _: next(frozen), params)

    return mask


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Update direction: clip_by_global_norm(grad_clip) (none when 0) -> Adam -> masked decay; with
    train.trainable, the frozen leaves' gradients and directions are zero (before the clip's norm and
    after the decay).

    The freeze wraps the chain instead of being a link of it, so the optimizer state has the same
    structure whatever train.trainable is: a run whose first stage trains the new parts alone
    resumes from that stage's checkpoint with every parameter training.

    The learning rate is not inside the chain: the train step scales the direction
    by -learning_rate(state.step) (`apply_lr`), so the LR is a function of the
    train state's own step counter, which also advances over skipped updates.
    """
    parts = []
    if cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip))
    parts.append(optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, mu_dtype=jnp.float32))
    if cfg.weight_decay > 0:
        parts.append(optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask))
    chain = optax.chain(*parts)
    if not cfg.trainable:
        return chain
    frozen = frozen_mask(cfg)

    def zero_frozen(tree):
        return jax.tree.map(lambda u, f: jnp.zeros_like(u) if f else u, tree, frozen(tree))

    def update(updates, state, params=None):
        direction, state = chain.update(zero_frozen(updates), state, params)
        return zero_frozen(direction), state

    return optax.GradientTransformation(chain.init, update)


def apply_lr(params, direction, lr):
    """params - lr * direction, in the params' dtype (fp32)."""
    return jax.tree.map(lambda p, u: (p - lr * u).astype(p.dtype), params, direction)
