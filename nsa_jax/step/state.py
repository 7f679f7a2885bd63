"""The train state pytree: everything a resumed run needs besides the data position.

`TrainState(step, params, opt_state, rng)` is what the train step consumes and
returns (donated), and what a checkpoint saves together with the data stream's
`get_state()` dict. `step` counts completed optimizer steps; params and optimizer
state are fp32.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from nsa_jax.config import Config
from nsa_jax.model import init_params
from nsa_jax.step.optimizer import frozen_mask, make_optimizer


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps completed
    params: Any  # fp32 master weights
    opt_state: Any  # optax state of make_optimizer (fp32 moments)
    rng: jax.Array  # key for stochastic parts of the step; advanced every step


def init_state(cfg: Config, rng: jax.Array | None = None, params: Any = None) -> TrainState:
    """A fresh state from `train.seed` (or `rng`), or around given `params` (train.init_from);
    call under jit to place it directly."""
    rng = jax.random.PRNGKey(cfg.train.seed) if rng is None else rng
    init_rng, state_rng = jax.random.split(rng)
    if params is None:
        params = init_params(cfg.model, init_rng, min(cfg.train.seq_len, 2 * cfg.model.nsa.lp))
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    opt_state = make_optimizer(cfg.train).init(params)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state, rng=state_rng)


def check_trainable(cfg: Config) -> None:
    """ConfigError, before anything is written, when train.trainable names no parameter of the model
    (the optimizer's mask checks the names against the parameters' shapes; nothing is computed)."""
    if cfg.train.trainable:
        params = jax.eval_shape(lambda: init_state(cfg).params)
        frozen_mask(cfg.train)(params)
