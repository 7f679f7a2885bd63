"""Data-parallel strategies (nsa_jax/step/strategies.py): same math, different placement.

Every `parallel.strategy` runs a few optimizer steps (accumulate 2) on 2 devices and
is compared with an independent single-device reference written here: a plain
`jax.value_and_grad` of the whole batch's loss and optax's own clip + AdamW with a
cosine schedule. zero1 and fsdp must really shard what they claim to, and a
checkpoint of a sharded state must restore onto another strategy and device count.

One strategy per case keeps compilation (most of the time here) down: dp and gspmd
reduce in bf16 (looser tolerance, and the rounding must be visible), the others in
fp32 (dp in fp32 against one device is tests/test_train.py's job).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from nsa_jax.config import load_config
from nsa_jax.mesh import DATA, make_mesh, put_batch
from nsa_jax.model import NSALM, cross_entropy
from nsa_jax.rundir import checkpoint as C
from nsa_jax.step import step as S
from nsa_jax.step import strategies

from helpers import host_train_state, rel_err, tiny_model_cfg

T, B, A, STEPS = 32, 4, 2, 3
CASES = [("dp", "bfloat16"), ("pmap", "float32"), ("gspmd", "bfloat16"), ("zero1", "float32"), ("fsdp", "float32")]
# dp and zero1 with each layer's gradients reduced in the backward (parallel.overlap_reduce): dp's
# all-reduce in both reduction dtypes, zero1's reduce-scatter in fp32.
CASES += [("dp+overlap", "float32"), ("dp+overlap", "bfloat16"), ("zero1+overlap", "float32")]
TRAIN = [
    f"train.seq_len={T}",
    f"train.global_batch={B}",
    f"train.accumulate={A}",
    f"train.steps={STEPS}",
    "train.warmup=0",
    "train.lr=1e-2",
    "train.min_lr=1e-3",
    "train.weight_decay=0.1",
    "train.grad_clip=0.5",
]


def cfg_for(strategy: str, reduce_dtype: str = "float32"):
    """The case's config; `dp+overlap` (`zero1+overlap`) is dp (zero1) with parallel.overlap_reduce."""
    strategy, _, overlap = strategy.partition("+")
    sets = [f"parallel.strategy={strategy}", f"parallel.grad_reduce_dtype={reduce_dtype}"]
    cfg = load_config(None, TRAIN + sets + (["parallel.overlap_reduce=true"] if overlap else []))
    return dataclasses.replace(cfg, model=tiny_model_cfg(T_hint=T, branches=("win",)))


def mesh_of(n: int):
    return make_mesh(cfg_for("dp"), jax.devices()[:n])


@pytest.fixture(scope="module")
def host_state():
    """Initial state in numpy from a seeded generator (no init compilation)."""
    cfg = cfg_for("dp")
    shapes = strategies.state_shapes(cfg)
    return host_train_state(cfg, shapes, seed=3, scale=0.2)


@pytest.fixture(scope="module")
def batches():
    rng = np.random.default_rng(0)
    V = cfg_for("dp").model.vocab_size
    return [rng.integers(0, V, size=(A, B, T + 1)).astype(np.int32) for _ in range(STEPS)]


@pytest.fixture(scope="module")
def reference(host_state, batches):
    """Single device: value_and_grad of the mean loss over all A x B rows + optax clip/AdamW."""
    cfg = cfg_for("dp")
    t = cfg.train
    model = NSALM(cfg.model)

    def loss(params, tokens_NxT1):
        return cross_entropy(model.apply({"params": params}, tokens_NxT1[:, :-1]), tokens_NxT1[:, 1:])

    decay = jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key == "kernel", host_state.params)
    schedule = optax.cosine_decay_schedule(t.lr, t.steps - 1, alpha=t.min_lr / t.lr)  # warmup 0
    tx = optax.chain(
        optax.clip_by_global_norm(t.grad_clip),
        optax.adamw(schedule, t.b1, t.b2, t.eps, weight_decay=t.weight_decay, mask=decay),
    )

    @jax.jit
    def step(params, opt_state, tokens_NxT1):
        value, grads = jax.value_and_grad(loss)(params, tokens_NxT1)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value, optax.tree.norm(grads)

    params, opt_state = host_state.params, tx.init(host_state.params)
    losses, norms = [], []
    with jax.default_device(jax.devices()[0]):
        for tokens_AxBxT1 in batches:
            params, opt_state, value, norm = step(params, opt_state, tokens_AxBxT1.reshape(A * B, T + 1))
            losses.append(float(value))
            norms.append(float(norm))
    return {"params": jax.device_get(params), "losses": losses, "grad_norms": norms}


_RUNS: dict = {}


@pytest.fixture(scope="module")
def run(host_state, batches):
    """run(strategy, dtype) -> (cfg, mesh, final state on the devices, metrics); each case compiled once."""

    def get(strategy: str, reduce_dtype: str):
        key = (strategy, reduce_dtype)
        if key not in _RUNS:
            cfg, mesh = cfg_for(strategy, reduce_dtype), mesh_of(2)
            plan = S.make_plan(cfg, mesh)
            step = S.make_train_step(plan)
            state = jax.device_put(host_state, plan.state)
            metrics = []
            for tokens in batches:
                state, m = step(state, put_batch(tokens, mesh))
                metrics.append(jax.device_get(m))
            _RUNS[key] = (cfg, mesh, state, metrics)
        return _RUNS[key]

    return get


def worst_rel_err(a, b) -> float:
    return max(rel_err(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# ---------------------------------------------------------------------------
# same math


@pytest.mark.slow
@pytest.mark.parametrize("strategy,reduce_dtype", CASES, ids=[f"{s}-{d}" for s, d in CASES])
def test_two_devices_match_single_device_reference(run, reference, strategy, reduce_dtype):
    assert len(jax.devices()) >= 2, "conftest sets --xla_force_host_platform_device_count=2"
    _, _, state, metrics = run(strategy, reduce_dtype)
    losses = [float(m["loss"]) for m in metrics]
    norms = [float(m["grad_norm"]) for m in metrics]
    params = jax.device_get(state.params)
    err = worst_rel_err(params, reference["params"])
    if reduce_dtype == "float32":
        np.testing.assert_allclose(losses, reference["losses"], rtol=1e-5)
        np.testing.assert_allclose(norms, reference["grad_norms"], rtol=1e-4)
        assert err < 1e-5, err
    else:
        # The first loss comes before any update: exact up to fp32 summation order.
        np.testing.assert_allclose(losses[0], reference["losses"][0], rtol=1e-5)
        np.testing.assert_allclose(losses, reference["losses"], rtol=1e-3)
        np.testing.assert_allclose(norms, reference["grad_norms"], rtol=1e-2)
        # Close, and visibly not an fp32 reduction: the gradient really was rounded to bf16.
        assert 1e-6 < err < 1e-2, err
    assert int(state.step) == STEPS


@pytest.mark.slow
# One case per way a strategy reads its rows: dp's shard_map (zero1 and fsdp share it), gspmd's vmap,
# pmap's per-device step.
@pytest.mark.parametrize("strategy", ["dp", "pmap", "gspmd"])
def test_rows_with_their_own_weights_train_alike_under_every_strategy(host_state, strategy):
    """A batch of LabeledRows (data/targets.py: weights and answers made on the input path) gives every
    strategy on 2 devices the first step's loss and gradient norm of an independent one-device
    reference: per (micro-batch, device) pair sum(nll * w) / max(sum(w), 1) over the device's rows,
    averaged over the pairs (each device's mean, then the mean over devices: as torch's DDP)."""
    from nsa_jax.data.targets import LabeledRows

    rng = np.random.default_rng(5)
    V = cfg_for("dp").model.vocab_size
    tokens = rng.integers(0, V, size=(A, B, T + 1)).astype(np.int32)
    weights = np.where(rng.random((A, B, T)) < 0.3, rng.uniform(0.5, 3.0, (A, B, T)), 0.0).astype(np.float32)
    batch = LabeledRows(tokens, weights, weights > 0)
    model = NSALM(cfg_for("dp").model)

    def ref_loss(params):
        def micro(tokens_BxT1, w_BxT):
            logits = model.apply({"params": params}, tokens_BxT1[:, :-1])
            nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), tokens_BxT1[:, 1:, None], -1)[..., 0]
            return jnp.sum(nll * w_BxT) / jnp.maximum(jnp.sum(w_BxT), 1.0)

        b = B // 2  # each device's rows of a micro-batch
        pairs = [(a, rows) for a in range(A) for rows in (slice(0, b), slice(b, B))]
        return jnp.mean(jnp.stack([micro(tokens[a, rows], weights[a, rows]) for a, rows in pairs]))

    with jax.default_device(jax.devices()[0]):
        want, grads = jax.jit(jax.value_and_grad(ref_loss))(host_state.params)
        want_norm = float(optax.tree.norm(grads))
    cfg, mesh = cfg_for(strategy), mesh_of(2)
    plan = S.make_plan(cfg, mesh)
    _, m = S.make_train_step(plan)(jax.device_put(host_state, plan.state), put_batch(batch, mesh))
    np.testing.assert_allclose(float(m["loss"]), float(want), rtol=1e-5)
    np.testing.assert_allclose(float(m["grad_norm"]), want_norm, rtol=1e-4)
    plain = S.make_train_step(plan)(jax.device_put(host_state, plan.state), put_batch(tokens, mesh))[1]
    assert abs(float(plain["loss"]) - float(want)) > 1e-3  # the weights changed the loss


# ---------------------------------------------------------------------------
# placement


@pytest.mark.parametrize(
    "shape,n,spec",
    [
        ((6, 4), 2, P("data", None)),
        ((4, 8), 2, P(None, "data")),
        ((2, 2), 2, P("data", None)),
        ((3, 5), 2, P()),
        ((), 2, P()),
        ((8, 8), 1, P()),
        ((3, 6, 9), 3, P(None, None, "data")),
    ],
)
def test_data_spec_shards_the_largest_divisible_axis(shape, n, spec):
    assert strategies.data_spec(shape, n) == spec


def _sharded_fraction(tree) -> float:
    """Bytes on the first device / bytes of the whole arrays."""
    leaves = jax.tree.leaves(tree)
    device0 = jax.devices()[0]
    local = sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == device0)
    return local / sum(x.nbytes for x in leaves)


def expected_spec(path, shape) -> P:
    """`data` on the largest axis that 2 divides (the first of equals), never the leading [L] axis of
    the scanned layers' stacked leaves (the layer scan reads one layer of each device's slice)."""
    stacked = any(getattr(k, "key", None) == "layers" for k in path)
    dims = [i for i, n in enumerate(shape) if n % 2 == 0 and n > 0 and not (stacked and i == 0)]
    if not dims:
        return P()
    best = max(dims, key=lambda i: (shape[i], -i))
    return P(*[DATA if i == best else None for i in range(len(shape))])


@pytest.mark.parametrize(
    "strategy,params_sharded,opt_sharded", [("zero1", False, True), ("fsdp", True, True), ("dp", False, False)]
)
@pytest.mark.slow
def test_state_is_placed_as_the_strategy_says(run, strategy, params_sharded, opt_sharded):
    dtype = dict(CASES)[strategy]
    _, mesh, state, _ = run(strategy, dtype)
    for tree, sharded in ((state.params, params_sharded), (state.opt_state, opt_sharded)):
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            spec = expected_spec(path, leaf.shape) if sharded else P()
            assert leaf.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, spec), leaf.ndim), leaf.shape
            want = list(leaf.shape)
            if spec != P():
                want[list(spec).index(DATA)] //= 2
            assert all(s.data.shape == tuple(want) for s in leaf.addressable_shards)
        # Nearly every byte lives in leaves with an even axis: half of it per device.
        frac = _sharded_fraction(tree)
        assert (frac < 0.52) if sharded else frac == 1.0, frac
    assert state.step.sharding.is_fully_replicated


def test_plan_holds_the_strategy_shardings_and_checks_the_batch():
    """make_plan: one object with what the step and the checkpoint restore place by (nothing compiled)."""
    cfg = cfg_for("zero1")
    plan = strategies.make_plan(cfg, mesh_of(2))
    assert (plan.strategy, plan.n_devices) == ("zero1", 2)
    for leaf, sharding in zip(jax.tree.leaves(plan.abstract_state()), jax.tree.leaves(plan.state)):
        assert leaf.sharding == sharding
    # zero1: replicated params, sharded moments and reduced gradients.
    assert all(s.is_fully_replicated for s in jax.tree.leaves(plan.state.params))
    assert not all(s.is_fully_replicated for s in jax.tree.leaves(plan.state.opt_state))
    assert not all(s.is_fully_replicated for s in jax.tree.leaves(plan.grads))
    bad = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, global_batch=3))
    with pytest.raises(ValueError, match=r"^train.global_batch \(3\) must be divisible by the number of devices"):
        strategies.make_plan(bad, mesh_of(2))


def _eqns_by_depth(jaxpr, depth=0):
    """(loop depth, eqn) of every equation of a jaxpr and of every jaxpr nested in it (scan and while
    bodies one loop deeper)."""
    for eqn in jaxpr.eqns:
        yield depth, eqn
        deeper = depth + (eqn.primitive.name in ("scan", "while"))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns_by_depth(inner, deeper)


def _primitives_by_depth(jaxpr) -> dict[int, set[str]]:
    """{loop depth: primitive names} of a jaxpr and the jaxprs nested in it."""
    out: dict[int, set[str]] = {}
    for depth, eqn in _eqns_by_depth(jaxpr):
        out.setdefault(depth, set()).add(eqn.primitive.name)
    return out


def test_fsdp_gathers_each_layer_inside_the_layer_scan():
    """fsdp: the scanned layers' parameters reach the step in slices and are gathered inside the layer
    scan (inside the micro-batch scan: two loops deep), their gradients reduce-scattered there by the
    gather's transpose; dp has no gather."""
    found = {}
    for strategy in ("fsdp", "dp"):
        plan = strategies.make_plan(cfg_for(strategy), mesh_of(2))
        params = plan.abstract_state().params
        tokens = jax.ShapeDtypeStruct((A, B, T + 1), np.int32, sharding=plan.batch)
        found[strategy] = _primitives_by_depth(jax.make_jaxpr(S.make_grad_fn(plan))(params, tokens).jaxpr)
    deep = set().union(*(names for depth, names in found["fsdp"].items() if depth >= 2))
    assert {"all_gather", "reduce_scatter"} <= deep, deep
    assert not any("all_gather" in names for names in found["dp"].values())
    layers = strategies.make_plan(cfg_for("fsdp"), mesh_of(2)).state.params["layers"]
    assert all(sharding.spec[0] is None for sharding in jax.tree.leaves(layers))


def _psums_by_depth(jaxpr) -> list[tuple[int, str]]:
    """[(loop depth, operand dtype)] of every psum in a jaxpr and the jaxprs nested in it."""
    return [
        (d, str(v.aval.dtype)) for d, eqn in _eqns_by_depth(jaxpr) if eqn.primitive.name == "psum" for v in eqn.invars
    ]


@pytest.mark.slow
def test_overlap_reduces_each_layer_inside_the_layer_scan_in_the_reduction_dtype():
    """parallel.overlap_reduce: the scanned layers' gradients are all-reduced inside the layer scan's
    backward (inside the micro-batch scan: two loops deep), in bf16; plain dp reduces after both scans."""
    found = {}
    for strategy in ("dp+overlap", "dp"):
        plan = strategies.make_plan(cfg_for(strategy, "bfloat16"), mesh_of(2))
        params = plan.abstract_state().params
        tokens = jax.ShapeDtypeStruct((A, B, T + 1), np.int32, sharding=plan.batch)
        found[strategy] = _psums_by_depth(jax.make_jaxpr(S.make_grad_fn(plan))(params, tokens).jaxpr)
    deep = [dtype for depth, dtype in found["dp+overlap"] if depth >= 2]
    n_layer_leaves = len(jax.tree.leaves(strategies.state_shapes(cfg_for("dp")).params["layers"]))
    # One per layer parameter the loss reaches (this model runs the window branch alone).
    assert 10 <= len(deep) <= n_layer_leaves and set(deep) == {"bfloat16"}, found["dp+overlap"]
    assert not [d for depth, d in found["dp"] if depth >= 2], found["dp"]
    assert {d for depth, d in found["dp"] if depth == 0 and d == "bfloat16"}  # dp's one reduction, after
    # zero1: each layer's split leaves reduce-scattered in the layer scan's backward, in bf16, none after.
    plan = strategies.make_plan(cfg_for("zero1+overlap", "bfloat16"), mesh_of(2))
    tokens = jax.ShapeDtypeStruct((A, B, T + 1), np.int32, sharding=plan.batch)
    jaxpr = jax.make_jaxpr(S.make_grad_fn(plan))(plan.abstract_state().params, tokens).jaxpr
    scatters = [
        (d, str(v.aval.dtype))
        for d, eqn in _eqns_by_depth(jaxpr)
        if eqn.primitive.name == "reduce_scatter"
        for v in eqn.invars
    ]
    split = [g for g in jax.tree.leaves(plan.grads["layers"]) if any(a is not None for a in g.spec)]
    rest = {k: v for k, v in plan.grads.items() if k != "layers"}
    split_rest = [g for g in jax.tree.leaves(rest) if any(a is not None for a in g.spec)]
    deep = [t for d, t in scatters if d >= 2]
    assert 10 <= len(deep) <= len(split) and set(deep) == {"bfloat16"}, scatters  # the layers the loss reaches
    assert 0 < len([d for d, _ in scatters if d == 0]) <= len(split_rest), scatters  # the rest, after


def test_unknown_strategy_is_one_clear_line():
    cfg = cfg_for("dp")
    bad = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, strategy="zero3"))
    with pytest.raises(ValueError, match=r"^parallel.strategy is 'zero3'; set it to one of dp, pmap, gspmd"):
        S.make_train_step(S.make_plan(bad, mesh_of(2)))


# ---------------------------------------------------------------------------
# checkpoints of a sharded state


@pytest.mark.slow
def test_sharded_checkpoint_restores_onto_other_strategy_and_device_count(run, tmp_path):
    cfg, mesh, state, _ = run("zero1", "float32")
    expect = jax.device_get(state)
    ck = C.Checkpointer(strategies.make_plan(cfg, mesh), tmp_path)
    try:
        assert ck.save(STEPS, state, {"position": 0}, None) is not None
    finally:
        ck.close()

    # zero1 on 2 devices -> fsdp on 2 devices (params become sharded) and -> one device.
    for target_cfg, target_mesh in ((cfg_for("fsdp"), mesh), (cfg, mesh_of(1))):
        ck = C.Checkpointer(strategies.make_plan(target_cfg, target_mesh), tmp_path, warn=lambda _: None)
        try:
            restored = ck.restore_latest()
        finally:
            ck.close()
        # A position saved without its row count is read back with the micro-batch of the
        # config saved beside it (nsa_jax/rundir/checkpoint.py), so a resume can place it globally.
        assert restored.step == STEPS
        assert restored.train_data == {"position": 0, "micro_rows": cfg.train.global_batch}
        placed = S.make_plan(target_cfg, target_mesh).state
        for leaf, sharding in zip(jax.tree.leaves(restored.state), jax.tree.leaves(placed)):
            assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
        for got, want in zip(jax.tree.leaves(jax.device_get(restored.state)), jax.tree.leaves(expect)):
            np.testing.assert_array_equal(got, want)


def test_parameters_no_axis_of_which_divides_are_named_at_boot():
    """fsdp over 2 devices with 3 query heads: the gate's last bias [L, 9] has no axis to split (its [L]
    axis is the layer scan's), stays whole, and the boot note names it; dp has nothing to say."""
    plans = {}
    for strategy in ("fsdp", "dp"):
        cfg = dataclasses.replace(cfg_for(strategy), model=tiny_model_cfg(T_hint=T, G=3, K=1, branches=("win",)))
        plans[strategy] = strategies.make_plan(cfg, mesh_of(2))
    line = strategies.whole_leaves(plans["fsdp"])
    assert line.startswith("fsdp: 1 parameter array ("), line
    assert ") stays whole on every device, no axis dividing by 2: " in line, line
    assert "layers/attn/gate_fc2/bias [2, 9]" in line
    assert all(a is None for a in plans["fsdp"].state.params["layers"]["attn"]["gate_fc2"]["bias"].spec)
    assert strategies.whole_leaves(plans["dp"]) == ""
