"""Data-parallel strategies: where each part of the train state lives, and how gradients are reduced.

Owns, per `parallel.strategy`, the state's shardings on the (data, seq) mesh (`state_shardings`,
`grad_shardings`), the `ShardingPlan` that holds them for one run (`make_plan`) and the function
from a batch to the mean gradient (`make_grad_fn`, the dispatch). The loss is step/loss.py's;
the update and the step are step.py's. Every strategy computes the same update: the mean
gradient over the global batch, summed locally over the micro-batches, reduced once per step
in parallel.grad_reduce_dtype by `reduce_grads` (the one reduction all call), then optax.

  strategy  params   grads, moments  gradient function
  dp        whole    whole           make_mapped_grad_fn: shard_map, psum (default)
  zero1     whole    slices          make_mapped_grad_fn: psum_scatter; jit gathers the new params
  fsdp      slices   slices          make_mapped_grad_fn: each scanned layer gathered as it runs
  gspmd     whole    whole           make_partitioned_grad_fn: jit + shardings, XLA's all-reduce
  pmap      whole    whole           make_pmap_step: jax.pmap, the whole step per device

dp, zero1 and fsdp run one path at every context degree C (step/rows.py); gspmd and pmap at
C = 1. "Slices": the largest axis the device count divides (`data_spec`; never the stacked [L]
axis), over `data`, or over `data` and `seq` together when C > 1.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nsa_jax.config import Config
from nsa_jax.data.targets import batch_tokens
from nsa_jax.kernels import KernelPlan, cudnn_fits, plan_kernels
from nsa_jax.mesh import DATA, SEQ
from nsa_jax.nsa.context import SeqLayout, seq_layout
from nsa_jax.step.loss import Loss
from nsa_jax.step.rows import Rows, denominators, lay_out_rows, rows_spec, split_rows
from nsa_jax.step.state import TrainState, init_state
from nsa_jax.words import count

STRATEGIES = ("dp", "pmap", "gspmd", "zero1", "fsdp")

# (params, batch_BxT1) -> (mean loss, stats) of one micro-batch (tokens or data/targets.LabeledRows)
LossFn = Callable[[Any, Any], tuple[jax.Array, dict]]


def check_strategy(cfg: Config) -> str:
    s = cfg.parallel.strategy
    if s not in STRATEGIES:
        raise ValueError(f"parallel.strategy is {s!r}; set it to one of {', '.join(STRATEGIES)}")
    return s


# ---------------------------------------------------------------------------
# placement


def data_spec(shape: tuple[int, ...], n_shards: int, axes: str | tuple[str, ...] = DATA) -> P:
    """`axes` (default `data`) on the largest axis of `shape` that n_shards divides (the first of
    equals); P() if none."""
    if n_shards <= 1:
        return P()
    dims = [i for i, size in enumerate(shape) if size % n_shards == 0]
    if not dims:
        return P()
    best = max(dims, key=lambda i: (shape[i], -i))
    return P(*[axes if i == best else None for i in range(len(shape))])


def shard_axes(mesh: Mesh) -> tuple[str | tuple[str, ...], int]:
    """(mesh axes, device count) a sharded leaf is split over: `data`, and with context
    parallelism `data` and `seq` together (every device of the mesh holds one slice)."""
    context = dict(mesh.shape).get(SEQ, 1)
    if context > 1:
        return (DATA, SEQ), mesh.shape[DATA] * context
    return DATA, mesh.shape[DATA]


def in_layer_stack(path) -> bool:
    """Whether a leaf (of the params, or of an optimizer state that mirrors them) belongs to the scanned
    layers, stacked on a leading [L] axis (model.scan_layers)."""
    return any(getattr(key, "key", None) == "layers" for key in path)


def sharded_over_mesh(tree: Any, mesh: Mesh) -> Any:
    """A NamedSharding per leaf of `tree` (arrays or ShapeDtypeStructs) by the `data_spec` rule over
    `shard_axes`. The scanned layers' leading [L] axis is never the one split: the layer scan reads
    one layer's slice of every device's leaf (fsdp gathers each layer's parameters as it runs)."""
    axes, n = shard_axes(mesh)

    def place(path, x):
        shape = tuple(x.shape)
        if in_layer_stack(path) and len(shape) > 1:
            return NamedSharding(mesh, P(None, *data_spec(shape[1:], n, axes)))
        return NamedSharding(mesh, data_spec(shape, n, axes))

    return jax.tree_util.tree_map_with_path(place, tree)


def replicated_tree(tree: Any, mesh: Mesh) -> Any:
    rep = NamedSharding(mesh, P())
    return jax.tree.map(lambda _: rep, tree)


def state_shapes(cfg: Config) -> TrainState:
    """ShapeDtypeStructs of a fresh TrainState (traced, nothing allocated)."""
    return jax.eval_shape(functools.partial(init_state, cfg))


def state_shardings(cfg: Config, mesh: Mesh, shapes: TrainState | None = None) -> TrainState:
    """A TrainState of NamedShardings: where each leaf of the state lives under the strategy."""
    strategy = check_strategy(cfg)
    shapes = state_shapes(cfg) if shapes is None else shapes
    rep = NamedSharding(mesh, P())
    shard_params = strategy == "fsdp"
    shard_opt = strategy in ("zero1", "fsdp")
    return TrainState(
        step=rep,
        params=(sharded_over_mesh if shard_params else replicated_tree)(shapes.params, mesh),
        opt_state=(sharded_over_mesh if shard_opt else replicated_tree)(shapes.opt_state, mesh),
        rng=rep,
    )


def grad_shardings(cfg: Config, mesh: Mesh, params_shapes: Any) -> Any:
    """Where the reduced mean gradient (and the update computed from it) lives: sharded for zero1/fsdp."""
    if check_strategy(cfg) in ("zero1", "fsdp"):
        return sharded_over_mesh(params_shapes, mesh)
    return replicated_tree(params_shapes, mesh)


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


@dataclasses.dataclass(frozen=True, eq=False)
class ShardingPlan:
    """Where everything of one run lives under parallel.strategy on `mesh`; see make_plan."""

    cfg: Config
    mesh: Mesh
    strategy: str  # one of STRATEGIES
    n_devices: int  # devices on the `data` axis
    state_shapes: TrainState  # ShapeDtypeStructs of a fresh state
    state: TrainState  # a NamedSharding per state leaf
    grads: Any  # a NamedSharding per parameter leaf: the reduced mean gradient and its update
    batch: NamedSharding  # every leaf of batch_AxBxT1, sharded on B
    replicated: NamedSharding  # scalars and metrics
    kernel_fallback: frozenset = frozenset()  # NSA branches the kernel guard moved to XLA
    layout: SeqLayout | None = None  # the sequence layout over `seq` (context parallelism), None without

    @property
    def context(self) -> int:
        """Devices one sequence is split over (the `seq` axis)."""
        return 1 if self.layout is None else self.layout.context

    def kernels(self, model) -> KernelPlan:
        """What each NSA branch of `model` (cfg.model, or a schedule phase's) runs in this plan's step.

        The backend is the mesh's (a compile for another card plans for that card).
        """
        backend = self.mesh.devices.flat[0].platform
        seq = self.cfg.train.seq_len if self.layout is None else self.layout.seq_len
        return plan_kernels(model.nsa, seq, backend, self.kernel_fallback, self.layout, cudnn_ok=cudnn_fits(model))

    def abstract_state(self) -> TrainState:
        """ShapeDtypeStructs of a fresh state that carry their shardings (AOT lowering, restore target)."""
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), self.state_shapes, self.state
        )


def whole_leaves(plan: ShardingPlan) -> str:
    """'' unless the strategy slices the state (zero1, fsdp) and some parameter has no axis the device
    count divides: then one line saying how many stay whole on every device, and which (the first few)."""
    sliced = plan.state.params if plan.strategy == "fsdp" else plan.grads if plan.strategy == "zero1" else None
    _, n = shard_axes(plan.mesh)
    if sliced is None or n <= 1:
        return ""
    whole = [
        ("/".join(str(getattr(k, "key", k)) for k in path), shape.shape)
        for (path, sharding), shape in zip(
            jax.tree_util.tree_leaves_with_path(sliced), jax.tree.leaves(plan.state_shapes.params)
        )
        if all(a is None for a in sharding.spec) and int(np.prod(shape.shape)) > 1
    ]
    if not whole:
        return ""
    total = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(plan.state_shapes.params))
    share = sum(int(np.prod(shape)) for _, shape in whole) / total
    named = ", ".join(f"{name} {list(shape)}" for name, shape in whole[:3]) + (", ..." if len(whole) > 3 else "")
    one = len(whole) == 1
    if plan.strategy == "fsdp":
        what = "stays" if one else "stay"
    else:
        what = "keeps its Adam moments" if one else "keep their Adam moments"
    return (
        f"{plan.strategy}: {count(len(whole), 'parameter array')} ({100 * share:.2g}% of the parameters) {what} whole "
        f"on every device, no axis dividing by {n}: {named}"
    )


def make_plan(cfg: Config, mesh: Mesh) -> ShardingPlan:
    """The plan of `cfg` on `mesh`, checked: a known strategy and a batch that divides over the devices.

    Traces the state's init once (eval_shape, nothing allocated); a run builds it once
    and passes it on, so strategy, shapes and shardings are derived in one place. Its
    `kernel_fallback` is set by the run's boot once the kernel guard has run (train/boot.py).
    """
    strategy = check_strategy(cfg)
    n_devices = mesh.shape[DATA]
    context = dict(mesh.shape).get(SEQ, 1)
    if context != cfg.parallel.context:
        raise ValueError(f"parallel.context is {cfg.parallel.context} but the mesh's `seq` axis has {context} devices")
    per_device_batch(cfg, n_devices)
    shapes = state_shapes(cfg)
    return ShardingPlan(
        cfg=cfg,
        mesh=mesh,
        strategy=strategy,
        n_devices=n_devices,
        state_shapes=shapes,
        state=state_shardings(cfg, mesh, shapes),
        grads=grad_shardings(cfg, mesh, shapes.params),
        batch=NamedSharding(mesh, P(None, DATA)),
        replicated=NamedSharding(mesh, P()),
        layout=seq_layout(cfg),
    )


# ---------------------------------------------------------------------------
# gradients


def accumulate(micro: Callable, xs):
    """The sum over xs' leading axis (the micro-batches) of micro(x), a pytree, in fp32: the one
    accumulation loop of every strategy (one lax.scan, so the program does not grow with train.accumulate)."""
    shapes = jax.eval_shape(micro, jax.tree.map(lambda x: x[0], xs))
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes)

    def body(carry, x):
        return jax.tree.map(jnp.add, carry, micro(x)), None

    return lax.scan(body, zeros, xs)[0]


def local_sums(value_and_grad: Callable, params, batch_AxbxT1):
    """Sums over the A micro-batches of (grads fp32, loss, stats) on this device's rows; no collective."""

    def micro(batch_bxT1):
        (loss, stats), grads = value_and_grad(params, batch_bxT1)
        return grads, loss, stats

    return accumulate(micro, batch_AxbxT1)


def reduce_grads(grads, n: int, dtype, over_devices: Callable, places=None):
    """Every strategy's gradient reduction: each leaf's sum over this device's micro-batches, divided
    by `n` (the micro-batches of the whole step), cast to parallel.grad_reduce_dtype (bf16 halves
    the bytes on the wire), reduced by `over_devices(leaf, place)`, back in fp32. `places`: a tree
    of each leaf's destination (a spec or sharding) passed to `over_devices`; None for every leaf."""
    places = jax.tree.map(lambda _: None, grads) if places is None else places
    return jax.tree.map(lambda g, at: over_devices((g / n).astype(dtype), at).astype(jnp.float32), grads, places)


def make_grad_fn(plan: ShardingPlan, loss: Loss) -> Callable:
    """(params, batch_AxBxT1) -> (mean grads fp32 placed as plan.grads, mean loss, mean stats) of
    parallel.strategy: dp, zero1 and fsdp at any context degree (`make_mapped_grad_fn`), gspmd
    (`make_partitioned_grad_fn`). Traced inside the step's jit; pmap has no separate gradient
    function (make_pmap_step runs its whole step per device)."""
    if plan.strategy == "pmap":
        raise ValueError("parallel.strategy=pmap runs the whole step per device; use make_train_step")
    if plan.strategy == "gspmd":
        return make_partitioned_grad_fn(plan, loss.of_batch)
    return make_mapped_grad_fn(plan, loss)


def whole_leaf(x: jax.Array, spec: P) -> jax.Array:
    """Inside shard_map: a leaf's slices (placed by `spec`) gathered whole over the mesh axes that hold them."""
    dims = [i for i, axes in enumerate(spec) if axes is not None]
    return lax.all_gather(x, spec[dims[0]], axis=dims[0], tiled=True) if dims else x


def _gather_layer(variables: dict, *, specs) -> dict:
    """One layer's variables with its parameter slices gathered whole (flax map_variables' trans_in_fn)."""
    return {collection: jax.tree.map(whole_leaf, tree, specs) for collection, tree in variables.items()}


@dataclasses.dataclass(frozen=True)
class ParamGather:
    """The parameters as a shard_map over the mesh receives them, and how they become whole inside it.

    specs: each leaf's PartitionSpec as the strategy keeps it (slices under fsdp, whole otherwise);
    layer: fsdp with scanned layers: one layer's variables -> whole, for model.NSALM's layer_gather
      (each layer gathered as it runs, and again in its backward under remat), so no device holds
      every layer whole; None: no per-layer gather.
    `early` gathers the rest (all of it without `layer`) once, before the model runs.
    """

    specs: Any
    layer: Callable | None

    def early(self, params):
        if isinstance(self.specs, P):  # one spec for every leaf: whole already
            return params
        if self.layer is None:
            return jax.tree.map(whole_leaf, params, self.specs)
        return {k: v if k == "layers" else jax.tree.map(whole_leaf, v, self.specs[k]) for k, v in params.items()}


def param_gather(strategy: str, param_shardings=None) -> ParamGather:
    """The ParamGather of parameters placed by `param_shardings` (ShardingPlan.state.params) under `strategy`;
    None: whole on every device (P() for the whole tree)."""
    if param_shardings is None:
        return ParamGather(P(), None)
    specs = jax.tree.map(lambda sh: sh.spec, param_shardings)
    if strategy != "fsdp" or "layers" not in specs:
        return ParamGather(specs, None)
    layer_specs = jax.tree.map(lambda spec: P(*spec[1:]), specs["layers"])
    return ParamGather(specs, functools.partial(_gather_layer, specs=layer_specs))


# A leaf whose gradient the gather's transpose already reduced over every device (fsdp, per layer).
REDUCED = P("reduced")


# A leaf whose per-layer backward reduce-scattered its gradient into this device's place of a zero
# array of the leaf's whole shape (zero1 with parallel.overlap_reduce): its slice is taken from there.
@dataclasses.dataclass(frozen=True)
class ScatteredInPlace:
    spec: P  # the leaf's placement (stacked: [L] first, never the split axis)


def _backward_reduction(spec: P | None, dtype) -> Callable:
    """An identity whose transpose reduces its gradient over every device in `dtype` and back: a
    psum (spec None or unsplit), or (spec split on one axis) a reduce-scatter whose slice is written
    into its place of a zero cotangent, which must keep the parameter's shape."""
    dims = [] if spec is None else [i for i, axes in enumerate(spec) if axes is not None]

    @jax.custom_vjp
    def reduced(x):
        return x

    def fwd(x):
        return x, None

    def bwd(_, ct):
        if not dims:
            return (lax.psum(ct.astype(dtype), (DATA, SEQ)).astype(ct.dtype),)
        d, axes = dims[0], spec[dims[0]]
        part = lax.psum_scatter(ct.astype(dtype), axes, scatter_dimension=d, tiled=True).astype(ct.dtype)
        return (lax.dynamic_update_slice_in_dim(jnp.zeros_like(ct), part, lax.axis_index(axes) * part.shape[d], d),)

    reduced.defvjp(fwd, bwd)
    return reduced


def reduce_in_backward(dtype, layer_specs=None) -> Callable:
    """parallel.overlap_reduce: one layer's variables -> the same, each parameter through an identity
    whose transpose reduces its gradient over every device in `dtype` (bf16 halves the bytes) and
    back in fp32: an all-reduce (dp), or with `layer_specs` (zero1: each layer leaf's placement
    without the [L] axis) a reduce-scatter into the leaf's slice (`ScatteredInPlace`), half the
    bytes. Applied inside the layer scan (model.NSALM's layer_gather), the backward reduces each
    layer's gradients as it leaves the layer, where XLA can overlap the collective with the
    backward of the layers below. The division by the step's micro-batches stays in
    `reduce_grads`, as for fsdp's per-layer reduce-scatter."""
    whole = _backward_reduction(None, dtype)

    def layer(variables: dict) -> dict:
        def params(tree):
            if layer_specs is None:
                return jax.tree.map(whole, tree)
            return jax.tree.map(lambda x, spec: _backward_reduction(spec, dtype)(x), tree, layer_specs)

        return {c: params(tree) if c == "params" else tree for c, tree in variables.items()}

    return layer


def make_mapped_grad_fn(plan: ShardingPlan, loss: Loss) -> Callable:
    """dp, zero1, fsdp: one shard_map over (data, seq), each device's gradient summed over its
    micro-batches, then one explicit reduction over every device in grad_reduce_dtype.

    The result is the mean over the A x D (micro-batch, data shard) pairs of each pair's
    weighted mean loss (denominator max(sum of weights, 1), as model.cross_entropy), its
    gradient, and the statistics finished per pair. The rows are laid out once
    (rows.lay_out_rows: whole at C = 1; padded and in device order, then split over `seq`,
    with context parallelism), each device computing its tokens' share of its pair's loss.
    The reduction: an all-reduce (dp), or a reduce-scatter to each device's slice of the leaf
    (zero1, fsdp: the update then runs on the slice). fsdp's parameters come in as slices
    (ParamGather): the scanned layers' are gathered as each layer runs, and their gradients
    reduce-scattered there by the gather's transpose; the rest once per step, up front.

    `check_vma=False` on purpose: with the default check, jax transposes the implicit
    broadcast of a replicated parameter into a psum, so gradients taken inside the
    shard_map would already be summed over devices and the explicit reduce would count
    them twice. Here every gradient stays local until the one explicit reduction.
    """
    mesh, n_devices, layout = plan.mesh, plan.n_devices, plan.layout
    reduce_dtype = jnp.dtype(plan.cfg.parallel.grad_reduce_dtype)
    out_specs = jax.tree.map(lambda sh: sh.spec, plan.grads)  # P() (dp), or a leaf's slice (zero1, fsdp)
    grad_specs = out_specs  # how each leaf is reduced: as it is placed, or REDUCED already
    gather = param_gather(plan.strategy, plan.state.params)
    per_layer = gather.layer
    overlap = plan.cfg.parallel.overlap_reduce and "layers" in grad_specs
    if overlap and plan.strategy == "zero1":  # each layer's gradients reduce-scattered in the backward
        per_layer = reduce_in_backward(reduce_dtype, jax.tree.map(lambda spec: P(*spec[1:]), grad_specs["layers"]))
        scattered = lambda spec: ScatteredInPlace(spec) if any(a is not None for a in spec) else REDUCED  # noqa: E731
        grad_specs = {**grad_specs, "layers": jax.tree.map(scattered, grad_specs["layers"])}
    elif overlap and plan.strategy == "dp":
        per_layer = reduce_in_backward(reduce_dtype)
    if per_layer is not None:
        loss = dataclasses.replace(loss, layer_gather=per_layer)
    if per_layer is not None and plan.strategy != "zero1":
        # The per-layer gather's transpose (autodiff) reduce-scatters those gradients over every device,
        # or (overlap_reduce) the per-layer identity's transpose all-reduces them.
        grad_specs = {**grad_specs, "layers": jax.tree.map(lambda _: REDUCED, grad_specs["layers"])}

    value_and_grad = jax.value_and_grad(loss.part, has_aux=True)

    def over_devices(g, spec):  # over every device: whole (dp), or into this device's slice
        if spec is REDUCED:
            return g
        if isinstance(spec, ScatteredInPlace):  # reduced in the backward: this device's slice of it
            d = next(i for i, axes in enumerate(spec.spec) if axes is not None)
            axes = spec.spec[d] if isinstance(spec.spec[d], tuple) else (spec.spec[d],)
            size = g.shape[d] // math.prod(mesh.shape[a] for a in axes)
            return lax.dynamic_slice_in_dim(g, lax.axis_index(spec.spec[d]) * size, size, d)
        dims = [i for i, axes in enumerate(spec) if axes is not None]
        if dims:  # the leaf's sharded axis, over the mesh axes shard_axes chose
            return lax.psum_scatter(g, spec[dims[0]], scatter_dimension=dims[0], tiled=True)
        return lax.psum(g, (DATA, SEQ))

    def local(params, rows_Axbx: Rows, denom_Ax1):
        params = gather.early(params)

        def pair_loss(xs):  # (share, sums), grads of one micro-batch's rows on this device
            rows, denom_1 = xs
            rope = None if rows.rope is None else rows.rope[0]
            return value_and_grad(params, rows._replace(rope=rope), denom_1[0])

        def micro(xs):
            (share, sums), grads = pair_loss(xs)
            # The sequence's sums before any ratio: the statistics of the pair, as at C = 1.
            stats = loss.finish(jax.tree.map(lambda x: lax.psum(x, SEQ), sums))
            return grads, lax.psum(share, SEQ), stats

        grads, total, stats = accumulate(micro, (rows_Axbx, denom_Ax1))
        n = denom_Ax1.shape[0] * n_devices
        grads = reduce_grads(grads, n, reduce_dtype, over_devices, grad_specs)
        return grads, lax.psum(total, DATA) / n, jax.tree.map(lambda s: lax.psum(s, DATA) / n, stats)

    def grad_fn(params, batch_AxBxT1):
        A, B = batch_tokens(batch_AxBxT1).shape[:2]
        rows = lay_out_rows(
            split_rows(batch_AxBxT1, n_devices), plan.cfg, layout, rope_positions=plan.cfg.train.rope_positions
        )
        denom = denominators(rows)  # [A, D]
        # [A, D, b, T'] -> [A, B, T'] (RoPE positions stay [A, D, T']: one per pair), split over the mesh.
        rows = rows._replace(**{f: getattr(rows, f).reshape(A, B, -1) for f in ("inputs", "targets", "weights")})
        specs = rows_spec(rows, 1)
        rows = jax.tree.map(lambda x, spec: lax.with_sharding_constraint(x, NamedSharding(mesh, spec)), rows, specs)
        fn = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(gather.specs, specs, P(None, DATA)),
            out_specs=(out_specs, P(), P()),
            check_vma=False,
        )
        return fn(params, rows, denom)

    return grad_fn


def _sum_rows(rows_DxS: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Sum over axis 0 computed in `dtype` (jnp.sum would upcast bf16 to fp32 and reduce in fp32)."""
    return lax.reduce(rows_DxS.astype(dtype), np.zeros((), dtype), lax.add, (0,))


def make_partitioned_grad_fn(plan: ShardingPlan, loss_fn: LossFn) -> Callable:
    """gspmd: (params, batch_AxBxT1) -> (mean grads placed as `plan.grads`, loss, stats), traced
    under the step's jit.

    The batch [A, B, T+1] is viewed as [A, D, B/D, T+1] with D (the device count) sharded on
    `data`, and the accumulated gradient is vmapped over D: each device computes its row of a
    [D, ...] gradient with no collective. The sum over D, cast to grad_reduce_dtype, is then the
    only cross-device op on gradients, and XLA lowers it to an all-reduce. Written as a plain
    value_and_grad of the global-batch loss, XLA would place the all-reduce inside the backward
    pass, in the fp32 dtype of the weight-gradient matmuls, where no cast written afterwards
    can move it.
    """
    mesh, n_devices = plan.mesh, plan.n_devices
    reduce_dtype = jnp.dtype(plan.cfg.parallel.grad_reduce_dtype)
    value_and_grad = jax.value_and_grad(loss_fn, has_aux=True)
    per_group = jax.vmap(functools.partial(local_sums, value_and_grad), in_axes=(None, 1), spmd_axis_name=DATA)
    rows_sharding = NamedSharding(mesh, P(DATA))
    full = NamedSharding(mesh, P())

    def grad_fn(params, batch_AxBxT1):
        A = batch_tokens(batch_AxBxT1).shape[0]
        # Forward and backward run on whole parameters: fsdp all-gathers its shards here,
        # once per step (a no-op for replicated params). Left to propagation instead, XLA
        # resharded activations and weights inside the backward (all-to-alls, repeated
        # all-gathers per micro-batch).
        params = lax.with_sharding_constraint(params, jax.tree.map(lambda _: full, params))
        batch_AxDxbxT1 = lax.with_sharding_constraint(
            split_rows(batch_AxBxT1, n_devices), NamedSharding(mesh, P(None, DATA))
        )
        grads_DxS, loss_D, stats_D = per_group(params, batch_AxDxbxT1)
        n = A * n_devices

        def over_devices(g_DxS, sharding):  # the device axis made explicit: summed where the strategy places it
            g_DxS = lax.with_sharding_constraint(g_DxS, rows_sharding)
            return lax.with_sharding_constraint(_sum_rows(g_DxS, reduce_dtype), sharding)

        grads = reduce_grads(grads_DxS, n, reduce_dtype, over_devices, plan.grads)
        loss = jnp.sum(loss_D) / n
        stats = jax.tree.map(lambda s: jnp.sum(s, axis=0) / n, stats_D)
        return grads, loss, stats

    return grad_fn


def make_pmap_step(plan: ShardingPlan, loss_fn: LossFn, update_fn: Callable) -> Callable:
    """pmap: (state, batch_AxBxT1) -> (state, metrics), the whole step written per device.

    The classic form: each device runs value_and_grad on its rows, `lax.pmean`s the
    gradient (cast to grad_reduce_dtype) over the named axis, and applies the same
    optimizer update as every other device. In jax 0.10 `jax.pmap` is itself a jit of
    a shard_map, so it composes with the caller's jit: the state goes in and out as
    the replicated global arrays the Trainer and the checkpoints use
    (in_axes=None / out_axes=None: no stacking, no copies), and the only boundary
    conversion is a free reshape of the batch to [A, D, B/D, T+1], mapped on D.
    """
    n_devices = plan.n_devices
    reduce_dtype = jnp.dtype(plan.cfg.parallel.grad_reduce_dtype)
    value_and_grad = jax.value_and_grad(loss_fn, has_aux=True)

    def per_device(state: TrainState, batch_AxbxT1):
        grads, loss, stats = local_sums(value_and_grad, state.params, batch_AxbxT1)
        A = batch_tokens(batch_AxbxT1).shape[0]
        grads = reduce_grads(grads, A * n_devices, reduce_dtype, lambda g, _: lax.psum(g, DATA))
        loss = lax.pmean(loss / A, DATA)
        stats = jax.tree.map(lambda s: lax.pmean(s / A, DATA), stats)
        return update_fn(state, grads, loss, stats)

    # axis_size and devices given explicitly: traced inside a jit, pmap cannot infer
    # them from the (global) argument shapes in a multi-process run.
    pmapped = jax.pmap(
        per_device, DATA, in_axes=(None, 1), out_axes=None, devices=list(plan.mesh.devices.flat), axis_size=n_devices
    )

    def step(state: TrainState, batch_AxBxT1):
        return pmapped(state, split_rows(batch_AxBxT1, n_devices))

    return step
