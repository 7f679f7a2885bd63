"""The pure, jitted train step over the (data, seq) mesh (nsa_jax/mesh.py; evaluation: evaluation/heldout.py).

A batch batch_AxBxT1 holds A micro-batches, each of B = train.global_batch
sequences of T + 1 tokens (plain tokens, or data/targets.LabeledRows whose loss weights ride
beside them), sharded over `data` on its B axis, so each device holds
A x (B / devices) rows (under context parallelism the devices of `seq` share a row).

One optimizer step:
  per device, over its A micro-batches: loss, grads and aux statistics, summed locally
  -> the strategy's reduction of the summed gradient (strategies.py) in
     parallel.grad_reduce_dtype (the bf16 "compression" of the runbooks), fp32 after
  -> global grad norm, clip + Adam + masked decay, LR of state.step, where the
     reduced gradient lives.

Placement and reduction are `parallel.strategy`'s (strategies.py), held for one run by a
`ShardingPlan` (`make_plan`, built once and taken by every builder here). This module builds
each schedule phase's loss (step/loss.py) and the update, and hands the loss to
strategies.make_grad_fn, which never calls back here. No I/O: the loop owns files, clocks and
printing.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax import lax

from nsa_jax.config import Config
from nsa_jax.step import schedule, strategies
from nsa_jax.step.loss import Loss
from nsa_jax.step.optimizer import apply_lr, learning_rate, make_optimizer
from nsa_jax.step.state import TrainState, init_state
from nsa_jax.step.strategies import ShardingPlan, make_plan  # noqa: F401 - the builders' plan, beside them


def create_state(plan: ShardingPlan, params=None) -> TrainState:
    """A fresh TrainState, initialised directly into the strategy's device buffers (strategies.make_plan's
    `plan`); around `params` (host arrays of the model's layout: train.init_from) when given."""
    if params is None:
        return jax.jit(functools.partial(init_state, plan.cfg), out_shardings=plan.state)()
    return jax.jit(lambda p: init_state(plan.cfg, params=p), out_shardings=plan.state)(params)


# ---------------------------------------------------------------------------
# steps


def make_grad_fn(plan: ShardingPlan, *, phase: schedule.Phase | None = None) -> Callable:
    """(params, batch_AxBxT1) -> (mean grads fp32, mean loss, mean stats) of parallel.strategy
    (strategies.make_grad_fn) for the loss of `phase` (step/loss.py; default: cfg.model)."""
    kernels = plan.kernels(phase.model if phase else plan.cfg.model)
    return strategies.make_grad_fn(plan, Loss(plan.cfg, phase, kernels))


def make_phased_grad_fn(plan: ShardingPlan) -> Callable:
    """(params, batch_AxBxT1, step) -> make_grad_fn's result for the phase `step` is in (schedule.phases).

    Every phase is compiled into the one step and the step counter (part of the state,
    so a resumed run continues in its phase) chooses with lax.switch.
    """
    phases = schedule.phases(plan.cfg)
    fns = [make_grad_fn(plan, phase=p) for p in phases]
    if len(fns) == 1:
        return lambda params, batch_AxBxT1, step: fns[0](params, batch_AxBxT1)
    starts = jnp.asarray([p.start for p in phases[1:]], jnp.int32)

    def grad_fn(params, batch_AxBxT1, step):
        return lax.switch(jnp.sum(step >= starts), fns, params, batch_AxBxT1)

    return grad_fn


def make_update(cfg: Config) -> Callable:
    """(state, grads, loss, stats[, params]) -> (new state, metrics): clip, Adam, decay, LR, skip.

    `params`: the state's params placed like `grads` (zero1: this device's slice, so
    the update is computed on the shard); default state.params.
    """
    tx = make_optimizer(cfg.train)

    def update(state: TrainState, grads, loss, stats, params=None) -> tuple[TrainState, dict[str, Any]]:
        params = state.params if params is None else params
        grad_norm = optax.tree.norm(grads)
        lr = learning_rate(state.step, cfg.train)
        direction, opt_state = tx.update(grads, state.opt_state, params)
        new_params = apply_lr(params, direction, lr)
        # A non-finite step leaves weights and moments as they were; the loop decides
        # whether to halt (ops.nan_policy), the step only refuses to poison the state.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
        new_state = TrainState(
            step=state.step + 1,
            params=keep(new_params, state.params),
            opt_state=keep(opt_state, state.opt_state),
            rng=jax.random.split(state.rng)[0],
        )
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "skipped": (~finite).astype(jnp.int32), **stats}
        return new_state, metrics

    return update


def make_train_step(plan: ShardingPlan) -> Callable[[TrainState, jax.Array], tuple[TrainState, dict]]:
    """The jitted step (state, batch_AxBxT1) -> (state, metrics); the state is donated.

    State in and out is placed by plan.state (parallel.strategy). metrics:
    loss, grad_norm (before clipping), lr (used by this update), skipped (1 when loss
    or gradient was not finite and the update was dropped), and with
    logging.aux_stats gate_mean [L, 3], gate_entropy [L], sel_far_frac [L], cmp_k_ratio [L], cmp_v_ratio [L].
    """
    update = make_update(plan.cfg)

    if plan.strategy == "pmap":
        loss = Loss(plan.cfg, kernels=plan.kernels(plan.cfg.model))
        train_step = strategies.make_pmap_step(plan, loss.of_batch, update)
    else:
        grad_fn = make_phased_grad_fn(plan)

        def train_step(state: TrainState, batch_AxBxT1) -> tuple[TrainState, dict[str, Any]]:
            grads, loss, stats = grad_fn(state.params, batch_AxBxT1, state.step)
            # zero1: the replicated params sliced to the gradient's shard (no communication);
            # a no-op for the other strategies, whose params already live like their grads.
            params = lax.with_sharding_constraint(state.params, plan.grads)
            return update(state, grads, loss, stats, params)

    return jax.jit(
        train_step,
        in_shardings=(plan.state, plan.batch),
        out_shardings=(plan.state, plan.replicated),
        donate_argnums=0,
    )
