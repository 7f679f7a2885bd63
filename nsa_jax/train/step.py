"""The pure, jitted train and eval steps, data-parallel over a 1-D `data` mesh.

Layout: params and optimizer state replicated (P()); a batch tokens_AxBxT1 of A
micro-batches, each of B = train.global_batch sequences of T + 1 tokens, sharded
over `data` on its B axis, so each device holds A x (B / devices) rows.

One optimizer step, per device, inside `jax.shard_map`:
  scan over the A micro-batches: loss, grads and aux statistics of each, summed locally
  -> one psum over `data` of the summed gradient, cast to parallel.grad_reduce_dtype
     for the collective and back to fp32 after (the bf16 "compression" of the runbooks)
  -> outside the shard_map: global grad norm, clip + Adam + masked decay, LR of state.step.

`check_vma=False` on purpose: with the default check, jax transposes the implicit
broadcast of a replicated parameter into a psum, so gradients taken inside the
shard_map would already be summed over devices and the explicit reduce would count
them twice. Here every gradient stays local until the one explicit psum.

Nothing here does I/O; the loop (loop.py) owns files, clocks and printing.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nsa_jax.config import Config
from nsa_jax.model import NSALM, cross_entropy
from nsa_jax.train.optimizer import apply_lr, learning_rate, make_optimizer
from nsa_jax.train.state import TrainState, init_state

AXIS = "data"
AUX_KEYS = ("gate_mean", "gate_entropy", "sel_far_frac")


# ---------------------------------------------------------------------------
# mesh and placement


def make_mesh(cfg: Config, devices: list | None = None) -> Mesh:
    """A 1-D `data` mesh over `devices` (default: parallel.num_devices of jax.devices())."""
    if devices is None:
        devices = jax.devices()
        n = cfg.parallel.num_devices
        if n:
            if jax.process_count() > 1:
                raise ValueError("parallel.num_devices must be 0 (all devices) in a multi-process run")
            if n > len(devices):
                raise ValueError(f"parallel.num_devices is {n} but only {len(devices)} devices are visible")
            devices = devices[:n]
    return Mesh(np.asarray(devices), (AXIS,))


def per_device_batch(cfg: Config, n_devices: int) -> int:
    """train.global_batch / devices; ValueError naming the fix when it does not divide."""
    B = cfg.train.global_batch
    if B % n_devices:
        raise ValueError(
            f"train.global_batch ({B}) must be divisible by the number of devices on the data axis "
            f"({n_devices}); set train.global_batch (NSA_BATCH_SIZE) to a multiple of {n_devices} "
            "or use fewer devices (parallel.num_devices)"
        )
    return B // n_devices


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """tokens_AxBxT1 sharded on B."""
    return NamedSharding(mesh, P(None, AXIS))


def put_batch(tokens_AxbxT1: np.ndarray, mesh: Mesh) -> jax.Array:
    """This process's rows [A, B / processes, T + 1] -> the global sharded array [A, B, T + 1]."""
    A, b, T1 = tokens_AxbxT1.shape
    global_shape = (A, b * jax.process_count(), T1)
    return jax.make_array_from_process_local_data(batch_sharding(mesh), tokens_AxbxT1, global_shape)


def create_state(cfg: Config, mesh: Mesh) -> TrainState:
    """A fresh TrainState, initialised directly into replicated device buffers."""
    return jax.jit(functools.partial(init_state, cfg), out_shardings=replicated(mesh))()


# ---------------------------------------------------------------------------
# loss and statistics


def layer_stats(aux: dict, cfg: Config) -> dict[str, jax.Array]:
    """The `aux` collection -> {'gate_mean': [L, 3], 'gate_entropy': [L], 'sel_far_frac': [L]}.

    Empty when the model sows nothing (no selection branch).
    """
    if cfg.model.scan_layers:
        stats = aux.get("layers", {}).get("attn", {}).get("stats")
        return dict(stats[0]) if stats else {}
    per_layer = [aux.get(f"layer_{i}", {}).get("attn", {}).get("stats") for i in range(cfg.model.n_layers)]
    if not all(per_layer):
        return {}
    return {k: jnp.stack([s[0][k] for s in per_layer]) for k in AUX_KEYS}


def loss_and_stats(params, tokens_BxT1: jax.Array, *, cfg: Config) -> tuple[jax.Array, dict]:
    """Mean next-token loss of one micro-batch, and its aux statistics when enabled."""
    model = NSALM(cfg.model)
    inputs_BxT, targets_BxT = tokens_BxT1[:, :-1], tokens_BxT1[:, 1:]
    if cfg.logging.aux_stats:
        logits_BxTxV, variables = model.apply({"params": params}, inputs_BxT, mutable=["aux"])
        stats = layer_stats(variables.get("aux", {}), cfg)
    else:
        logits_BxTxV, stats = model.apply({"params": params}, inputs_BxT), {}
    return cross_entropy(logits_BxTxV, targets_BxT), stats


def _tree_add(a, b):
    return jax.tree.map(jnp.add, a, b)


# ---------------------------------------------------------------------------
# steps


def make_grad_fn(cfg: Config, mesh: Mesh) -> Callable:
    """(params, tokens_AxBxT1) -> (mean grads fp32, mean loss, mean stats), all replicated."""
    n_devices = mesh.shape[AXIS]
    per_device_batch(cfg, n_devices)
    reduce_dtype = jnp.dtype(cfg.parallel.grad_reduce_dtype)
    value_and_grad = jax.value_and_grad(functools.partial(loss_and_stats, cfg=cfg), has_aux=True)

    def local(params, tokens_AxbxT1):
        A = tokens_AxbxT1.shape[0]
        (_, stats_shape), _ = jax.eval_shape(value_and_grad, params, tokens_AxbxT1[0])
        zeros = (
            jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
            jnp.zeros((), jnp.float32),
            jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), stats_shape),
        )

        def micro(carry, tokens_bxT1):
            (loss, stats), grads = value_and_grad(params, tokens_bxT1)
            return _tree_add(carry, (grads, loss, stats)), None

        # Local sums only: no collective inside the accumulation loop.
        (grads, loss, stats), _ = lax.scan(micro, zeros, tokens_AxbxT1)
        n = A * n_devices  # every micro-batch on every device has the same size
        grads = jax.tree.map(
            lambda g: lax.psum((g / n).astype(reduce_dtype), AXIS).astype(jnp.float32), grads
        )
        loss = lax.psum(loss, AXIS) / n
        stats = jax.tree.map(lambda s: lax.psum(s, AXIS) / n, stats)
        return grads, loss, stats

    return jax.shard_map(
        local, mesh=mesh, in_specs=(P(), P(None, AXIS)), out_specs=(P(), P(), P()), check_vma=False
    )


def make_train_step(cfg: Config, mesh: Mesh) -> Callable[[TrainState, jax.Array], tuple[TrainState, dict]]:
    """The jitted step (state, tokens_AxBxT1) -> (state, metrics); the state is donated.

    metrics: loss, grad_norm (before clipping), lr (used by this update), skipped
    (1 when loss or gradient was not finite and the update was dropped), and with
    logging.aux_stats gate_mean [L, 3], gate_entropy [L], sel_far_frac [L].
    """
    if cfg.parallel.strategy != "dp":
        raise ValueError(f"parallel.strategy '{cfg.parallel.strategy}' is not available yet; use dp")
    grad_fn = make_grad_fn(cfg, mesh)
    tx = make_optimizer(cfg.train)

    def train_step(state: TrainState, tokens_AxBxT1: jax.Array) -> tuple[TrainState, dict[str, Any]]:
        grads, loss, stats = grad_fn(state.params, tokens_AxBxT1)
        grad_norm = optax.tree.norm(grads)
        lr = learning_rate(state.step, cfg.train)
        direction, opt_state = tx.update(grads, state.opt_state, state.params)
        params = apply_lr(state.params, direction, lr)
        # A non-finite step leaves weights and moments as they were; the loop decides
        # whether to halt (ops.nan_policy), the step only refuses to poison the state.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
        new_state = TrainState(
            step=state.step + 1,
            params=keep(params, state.params),
            opt_state=keep(opt_state, state.opt_state),
            rng=jax.random.split(state.rng)[0],
        )
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "skipped": (~finite).astype(jnp.int32), **stats}
        return new_state, metrics

    return jax.jit(
        train_step,
        in_shardings=(replicated(mesh), batch_sharding(mesh)),
        out_shardings=(replicated(mesh), replicated(mesh)),
        donate_argnums=0,
    )


def make_eval_step(cfg: Config, mesh: Mesh) -> Callable[[Any, jax.Array], jax.Array]:
    """Jitted (params, tokens_BxT1 sharded on B) -> mean loss (replicated scalar)."""
    n_devices = mesh.shape[AXIS]
    per_device_batch(cfg, n_devices)
    no_aux = _without_aux(cfg)

    def local(params, tokens_bxT1):
        loss, _ = loss_and_stats(params, tokens_bxT1, cfg=no_aux)
        return lax.psum(loss, AXIS) / n_devices

    fn = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P(), check_vma=False)
    return jax.jit(fn, in_shardings=(replicated(mesh), NamedSharding(mesh, P(AXIS))), out_shardings=replicated(mesh))


def _without_aux(cfg: Config) -> Config:
    return dataclasses.replace(cfg, logging=dataclasses.replace(cfg.logging, aux_stats=False))
