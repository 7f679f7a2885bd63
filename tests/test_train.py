"""Train step, optimizer and loop pieces: data parallel == one device, accumulation ==
big batch, LR schedule in optimizer steps, decay mask, fp32 master weights.

References are independent: a plain `jax.grad` of the model loss on the whole batch
with optax's own AdamW and schedules, and numpy formulas for the LR.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from nsa_jax.config import load_config
from nsa_jax.mesh import batch_sharding, make_mesh, put_batch, replicated
from nsa_jax.model import NSALM, cross_entropy
from nsa_jax.progress_text import fmt_duration
from nsa_jax.step import optimizer as O
from nsa_jax.step import step as S
from nsa_jax.step.state import init_state
from nsa_jax.train.progress import progress_line

from helpers import TINY_NSA, host_train_state, rel_err

V, T, B, STEPS = 64, 32, 4, 5
TINY = [
    f"model.vocab_size={V}",
    *TINY_NSA,
    f"train.seq_len={T}",
    f"train.global_batch={B}",
    "train.accumulate=1",
    f"train.steps={STEPS}",
    "train.warmup=2",
    "train.lr=1e-2",
    "train.min_lr=1e-3",
    "train.weight_decay=0.1",
    "train.grad_clip=1.0",
    "parallel.grad_reduce_dtype=float32",
]


def tiny_cfg(*extra: str):
    return load_config(None, TINY + list(extra))


_STEPS: dict = {}


def compiled_step(n_dev: int, *extra: str):
    """Train step of tiny_cfg(*extra) on the first n_dev devices, built once per module."""
    key = (n_dev, extra)
    if key not in _STEPS:
        cfg = tiny_cfg(*extra)
        mesh = make_mesh(cfg, jax.devices()[:n_dev])
        _STEPS[key] = (cfg, mesh, S.make_train_step(S.make_plan(cfg, mesh)))
    return _STEPS[key]


@pytest.fixture(scope="module")
def host_state():
    """One initial state in numpy, placed afresh on each mesh (the step donates it).

    Filled from a seeded numpy generator instead of running the model's init, which
    would cost one more compilation; the comparisons hold for any parameter values.
    """
    cfg = tiny_cfg()
    shapes = jax.eval_shape(lambda: init_state(cfg))
    return host_train_state(cfg, shapes, seed=1, scale=0.1)


@pytest.fixture(scope="module")
def batches():
    rng = np.random.default_rng(0)
    return [rng.integers(0, V, size=(B, T + 1)).astype(np.int32) for _ in range(STEPS)]


def run_steps(n_dev, host_state, tokens_list, *extra, accumulate=1):
    """Runs len(tokens_list) steps; each item is [B, T+1], split into `accumulate` micro-batches."""
    cfg, mesh, step = compiled_step(n_dev, *extra)
    state = jax.device_put(host_state, replicated(mesh))
    metrics = []
    for tokens in tokens_list:
        tokens_AxbxT1 = tokens.reshape(accumulate, tokens.shape[0] // accumulate, T + 1)
        state, m = step(state, put_batch(tokens_AxbxT1, mesh))
        metrics.append(jax.device_get(m))
    return jax.device_get(state), metrics


def assert_params_close(a, b, tol):
    worst = max(rel_err(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    assert worst < tol, worst


# ---------------------------------------------------------------------------
# data parallel and accumulation


@pytest.mark.slow
def test_two_devices_equal_one_device_fp32(host_state, batches):
    assert len(jax.devices()) >= 2, "conftest sets --xla_force_host_platform_device_count=2"
    s1, m1 = run_steps(1, host_state, batches)
    s2, m2 = run_steps(2, host_state, batches)
    l1, l2 = [float(m["loss"]) for m in m1], [float(m["loss"]) for m in m2]
    np.testing.assert_allclose(l2, l1, rtol=1e-5)
    np.testing.assert_allclose([m["grad_norm"] for m in m2], [m["grad_norm"] for m in m1], rtol=1e-5)
    assert_params_close(s2.params, s1.params, 1e-5)
    assert int(s2.step) == STEPS


@pytest.mark.slow
def test_bf16_reduce_is_close_to_fp32(host_state, batches):
    s1, m1 = run_steps(1, host_state, batches)
    sb, mb = run_steps(2, host_state, batches, "parallel.grad_reduce_dtype=bfloat16")
    np.testing.assert_allclose([m["loss"] for m in mb], [m["loss"] for m in m1], rtol=1e-2)
    assert_params_close(sb.params, s1.params, 1e-2)


@pytest.mark.slow
def test_reference_adamw_on_whole_batch(host_state, batches):
    """The step == plain grad of the full-batch loss + optax.adamw with optax's schedules."""
    cfg = tiny_cfg()
    t = cfg.train
    s1, m1 = run_steps(1, host_state, batches[:2])
    model = NSALM(cfg.model)

    def loss(p, tokens):
        return cross_entropy(model.apply({"params": p}, tokens[:, :-1]), tokens[:, 1:])

    grad = jax.jit(jax.grad(loss))
    schedule = optax.join_schedules(
        [
            optax.linear_schedule(t.lr / t.warmup, t.lr, t.warmup - 1),
            optax.cosine_decay_schedule(t.lr, t.steps - t.warmup, alpha=t.min_lr / t.lr),
        ],
        [t.warmup - 1],
    )
    decay = jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key == "kernel", host_state.params)
    tx = optax.chain(
        optax.clip_by_global_norm(t.grad_clip),
        optax.adamw(schedule, t.b1, t.b2, t.eps, weight_decay=t.weight_decay, mask=decay),
    )
    params = host_state.params
    opt_state = tx.init(params)
    for tokens in batches[:2]:
        g = grad(params, jnp.asarray(tokens))
        updates, opt_state = tx.update(g, opt_state, params)
        params = optax.apply_updates(params, updates)
    assert_params_close(s1.params, jax.device_get(params), 1e-5)


@pytest.mark.slow
def test_accumulation_equals_one_big_batch(host_state, batches):
    big, _ = run_steps(2, host_state, batches[:1])
    acc, _ = run_steps(2, host_state, batches[:1], f"train.global_batch={B // 2}", "train.accumulate=2", accumulate=2)
    assert_params_close(acc.params, big.params, 1e-5)


@pytest.mark.slow
def test_lr_reaches_floor_at_last_optimizer_step_with_accumulation(host_state, batches):
    extra = (f"train.global_batch={B // 2}", "train.accumulate=2")
    state, metrics = run_steps(2, host_state, batches, *extra, accumulate=2)
    t = tiny_cfg(*extra).train
    lrs = [float(m["lr"]) for m in metrics]

    def expected(i):  # i = optimizer updates already applied
        if i < t.warmup - 1:
            return t.lr * (i + 1) / t.warmup
        frac = (i - (t.warmup - 1)) / (t.steps - t.warmup)
        return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * frac))

    np.testing.assert_allclose(lrs, [expected(i) for i in range(t.steps)], rtol=1e-6)
    assert lrs[-1] == pytest.approx(t.min_lr, rel=1e-6) and lrs[-2] > t.min_lr * 1.5
    assert int(state.step) == t.steps  # one step per optimizer update, not per micro-batch
    is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)  # noqa: E731
    adam = [s for s in jax.tree.leaves(state.opt_state, is_leaf=is_adam) if is_adam(s)]
    assert len(adam) == 1 and int(adam[0].count) == t.steps


@pytest.mark.slow
def test_state_is_donated(host_state, batches):
    cfg, mesh, step = compiled_step(2)
    state = jax.device_put(host_state, replicated(mesh))
    new_state, _ = step(state, put_batch(batches[0][None], mesh))
    jax.block_until_ready(new_state)
    assert all(x.is_deleted() for x in jax.tree.leaves(state.params))


@pytest.mark.slow
def test_non_finite_step_is_skipped(host_state, batches):
    bad = np.full_like(batches[0], V)  # out-of-range ids: the embedding lookup yields NaN
    state, (m,) = run_steps(2, host_state, [bad])
    assert int(m["skipped"]) == 1 and not np.isfinite(m["loss"])
    assert int(state.step) == 1
    for new, old in zip(
        jax.tree.leaves((state.params, state.opt_state)), jax.tree.leaves((host_state.params, host_state.opt_state))
    ):
        np.testing.assert_array_equal(new, old)
    _, (ok,) = run_steps(2, host_state, batches[:1])
    assert int(ok["skipped"]) == 0


# ---------------------------------------------------------------------------
# shapes and dtypes without compiling


def test_bf16_compute_keeps_fp32_master_weights_and_moments():
    cfg = tiny_cfg("model.dtype=bfloat16", "parallel.grad_reduce_dtype=bfloat16")
    mesh = make_mesh(cfg, jax.devices()[:2])
    state = jax.eval_shape(lambda: init_state(cfg))
    batch = jax.ShapeDtypeStruct((1, B, T + 1), jnp.int32, sharding=batch_sharding(mesh))
    new_state, metrics = jax.eval_shape(S.make_train_step(S.make_plan(cfg, mesh)), state, batch)
    assert {x.dtype for x in jax.tree.leaves(new_state.params)} == {jnp.dtype(jnp.float32)}
    floats = [x for x in jax.tree.leaves(new_state.opt_state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floats and {x.dtype for x in floats} == {jnp.dtype(jnp.float32)}
    assert metrics["gate_mean"].shape == (cfg.model.n_layers, 3)
    assert metrics["gate_entropy"].shape == metrics["sel_far_frac"].shape == (cfg.model.n_layers,)
    assert metrics["cmp_k_ratio"].shape == metrics["cmp_v_ratio"].shape == (cfg.model.n_layers,)


def test_aux_stats_can_be_switched_off():
    cfg = tiny_cfg("logging.aux_stats=false")
    mesh = make_mesh(cfg, jax.devices()[:1])
    state = jax.eval_shape(lambda: init_state(cfg))
    batch = jax.ShapeDtypeStruct((1, B, T + 1), jnp.int32, sharding=batch_sharding(mesh))
    _, metrics = jax.eval_shape(S.make_train_step(S.make_plan(cfg, mesh)), state, batch)
    assert set(metrics) == {"loss", "grad_norm", "lr", "skipped"}


def test_batch_must_divide_over_devices():
    cfg = tiny_cfg("train.global_batch=3")
    mesh = make_mesh(cfg, jax.devices()[:2])
    with pytest.raises(ValueError, match=r"train.global_batch \(3\) must be divisible .* devices .* \(2\)"):
        S.make_train_step(S.make_plan(cfg, mesh))


# ---------------------------------------------------------------------------
# optimizer pieces


@pytest.mark.parametrize("steps,warmup", [(10, 3), (7, 0), (5, 1), (100, 10)])
def test_schedule_warmup_peak_and_floor(steps, warmup):
    t = dataclasses.replace(tiny_cfg().train, steps=steps, warmup=warmup, lr=3e-3, min_lr=2e-4)
    lrs = np.array([float(O.learning_rate(i, t)) for i in range(steps)])
    assert lrs[-1] == pytest.approx(t.min_lr, rel=1e-6)
    assert lrs.max() == pytest.approx(t.lr, rel=1e-6)
    peak = int(np.argmax(lrs))
    assert peak == max(warmup, 1) - 1
    assert np.all(np.diff(lrs[: peak + 1]) > 0) and np.all(np.diff(lrs[peak:]) < 0)
    assert lrs[0] > 0  # the first update already moves the weights


@pytest.mark.parametrize("steps,warmup,decay", [(20, 5, 8), (20, 0, 19), (12, 1, 1), (12, 2, 10), (300, 30, 200)])
def test_stable_decay_schedule_matches_optax(steps, warmup, decay):
    """train.decay_steps: warm-up, lr held, a cosine to min_lr over the last `decay` updates (optax's schedules)."""
    t = dataclasses.replace(tiny_cfg().train, steps=steps, warmup=warmup, lr=3e-3, min_lr=2e-4, decay_steps=decay)
    pieces = [optax.linear_schedule(t.lr / warmup, t.lr, warmup - 1)] if warmup > 1 else []
    pieces += [optax.constant_schedule(t.lr), optax.cosine_decay_schedule(t.lr, decay, alpha=t.min_lr / t.lr)]
    bounds = ([warmup - 1] if warmup > 1 else []) + [steps - 1 - decay]  # the last update at the peak
    reference = optax.join_schedules(pieces, bounds)
    lrs = np.array([float(O.learning_rate(i, t)) for i in range(steps)])
    np.testing.assert_allclose(lrs, [float(reference(i)) for i in range(steps)], rtol=1e-5)
    assert lrs[-1] == pytest.approx(t.min_lr, rel=1e-6) and np.sum(lrs < t.lr * (1 - 1e-6)) >= decay


def test_stable_decay_holds_the_peak_when_a_run_is_continued_longer():
    """A stage continued to a larger train.steps finds lr where the shorter run was before its decay."""
    short = dataclasses.replace(tiny_cfg().train, steps=100, warmup=10, lr=1e-3, min_lr=0.0, decay_steps=20)
    longer = dataclasses.replace(short, steps=250)
    cosine = dataclasses.replace(longer, decay_steps=0)
    for step in (10, 50, 79, 150, 229):
        assert float(O.learning_rate(step, longer)) == pytest.approx(1e-3, rel=1e-6)
    assert float(O.learning_rate(79, short)) == pytest.approx(1e-3, rel=1e-6)
    assert float(O.learning_rate(99, short)) == 0.0 and float(O.learning_rate(249, longer)) == 0.0
    assert float(O.learning_rate(100, cosine)) < 0.75e-3  # the plain cosine is part-way down there


def test_weight_decay_skips_norms_biases_embeddings():
    params = {
        "embed": {"embedding": jnp.ones((4, 2))},
        "norm": {"scale": jnp.ones((2,))},
        "dense": {"kernel": jnp.ones((2, 3)), "bias": jnp.ones((3,))},
        "cmp": {"pos": jnp.ones((1, 2))},
    }
    t = dataclasses.replace(tiny_cfg().train, weight_decay=0.5, grad_clip=0.0)
    tx = O.make_optimizer(t)
    zero = jax.tree.map(jnp.zeros_like, params)
    direction, _ = tx.update(zero, tx.init(params), params)
    new = O.apply_lr(params, direction, 0.1)
    # Zero gradients: Adam's step is 0, so only decayed leaves move, by lr * wd * p.
    np.testing.assert_allclose(new["dense"]["kernel"], 1 - 0.1 * 0.5)
    for path in (("embed", "embedding"), ("norm", "scale"), ("dense", "bias"), ("cmp", "pos")):
        np.testing.assert_array_equal(new[path[0]][path[1]], 1.0)


def test_trainable_freezes_every_other_parameter_and_clips_by_the_trained_ones_alone():
    params = {"layers": {"attn": {"gate_fc2": {"kernel": jnp.ones((2, 3))}, "q": {"kernel": jnp.ones((2, 3))}}}}
    grads = {
        "layers": {"attn": {"gate_fc2": {"kernel": jnp.full((2, 3), 0.1)}, "q": {"kernel": jnp.full((2, 3), 100.0)}}}
    }
    t = dataclasses.replace(tiny_cfg().train, weight_decay=0.5, grad_clip=1.0, trainable=("gate_fc2",))
    tx = O.make_optimizer(t)
    direction, _ = tx.update(grads, tx.init(params), params)
    new = O.apply_lr(params, direction, 0.1)
    np.testing.assert_array_equal(new["layers"]["attn"]["q"]["kernel"], 1.0)  # frozen: not even decayed
    # Adam's first step is the gradient's sign (norm 0.245 < 1: no clip from the frozen 100s), plus decay.
    np.testing.assert_allclose(new["layers"]["attn"]["gate_fc2"]["kernel"], 1 - 0.1 * (1 + 0.5), rtol=1e-5)


def test_trainable_names_no_parameter_is_refused_with_the_models_names():
    from nsa_jax.config import ConfigError
    from nsa_jax.step.state import check_trainable

    cfg = tiny_cfg()
    check_trainable(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, trainable=("gate_fc1", "k_cmp"))))
    bad = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, trainable=("gate_fc1", "cmp_k")))
    with pytest.raises(ConfigError, match=r"no parameter path holds 'cmp_k'; this model's names: .*k_cmp"):
        check_trainable(bad)


# ---------------------------------------------------------------------------
# progress line


def test_progress_line_format():
    line = progress_line(40, 300, 3.12344, 1e-3, 12345.4, 83)
    assert line == "step 40/300 | loss 3.1234 | lr 1.00e-03 | 12,345 tok/s | ETA 1m23s"
    assert [fmt_duration(s) for s in (5, 83, 7500, float("nan"))] == ["5s", "1m23s", "2h05m", "?"]


def test_a_step_that_cannot_fit_is_refused_naming_the_figure_and_the_knobs():
    from nsa_jax.ops.memory import WontFitError, check_fits, device_memory_limit

    cfg = load_config("cpu_tiny", [])
    limit, source = device_memory_limit(jax.devices()[0])
    assert limit > 0 and source  # CPU: the host's RAM over its local devices
    mem = {"argument": 2**20, "output": 2**20, "alias": 2**20, "temp": 3_300_000_000_000, "generated_code": 0}
    mem["total"] = mem["argument"] + mem["output"] + mem["temp"] - mem["alias"]
    with pytest.raises(WontFitError, match=r"needs 3\.3 TB .*global_batch \(8\).*accumulate.*seq_len \(256\).*remat"):
        check_fits(cfg, mem, jax.devices()[0])
    check_fits(cfg, {**mem, "temp": 2**20, "total": 2**21}, jax.devices()[0])  # fits: no error
    check_fits(cfg, None, jax.devices()[0])  # no memory analysis: nothing to judge


def test_branch_scale_warning_names_the_largest_ratio_above_the_limit():
    from nsa_jax.rundir.files import CMP_SCALE_WARN, EVENTS
    from nsa_jax.train.metrics import branch_scale_warning

    assert "branch_scale" in EVENTS
    below = {"cmp_k_ratio": np.array([0.5, CMP_SCALE_WARN]), "cmp_v_ratio": np.array([1.0, 2.0])}
    assert branch_scale_warning(below) is None
    assert branch_scale_warning({"gate_mean": np.zeros((2, 3))}) is None  # aux stats without a selection branch
    above = {"cmp_k_ratio": np.array([12.0, 3.0]), "cmp_v_ratio": np.array([1.0, 40.0])}
    assert branch_scale_warning(above) == (40.0, "values", 1)
