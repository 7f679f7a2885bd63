"""Learning options (model.nsa.gate_bias_init; train.dense_selection_steps, train.scorer_distill,
train.scorer_distill_steps): off they leave the layer as the reference computes it; on, they
do what docs/NSA.md "Learning options" says, checked against independent float references.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import nsa_layer_ref

from experiments.compare import pair_positions
from nsa_jax.config import ConfigError, load_config
from nsa_jax.data.kv_recall import make_kv_batch, pair_len
from nsa_jax.mesh import make_mesh, put_batch
from nsa_jax.nsa.distill import score_distill_kl
from nsa_jax.nsa.layer import NSAAttention
from nsa_jax.step import schedule
from nsa_jax.step import step as S
from nsa_jax.step.loss import loss_and_stats
from nsa_jax.step.positions import ROPE_PIECES, random_rope_positions

from helpers import rel_err, tiny_model_cfg

# A model and batch small enough for whole train steps in a test.
STEP_OVERRIDES = [
    "model.vocab_size=32",
    "model.d_model=24",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.head_dim=8",
    "model.v_head_dim=8",
    "model.d_ff=32",
    "model.nsa.l=8",
    "model.nsa.d=4",
    "model.nsa.lp=8",
    "model.nsa.n=3",
    "model.nsa.w=8",
    "model.nsa.query_chunk=16",
    "train.seq_len=32",
    "train.global_batch=2",
    "parallel.grad_reduce_dtype=float32",
]


def _with(cfg, **nsa):
    return dataclasses.replace(cfg, nsa=dataclasses.replace(cfg.nsa, **nsa))


def _setup(cfg, T, B=2, seed=0):
    x = jax.random.normal(jax.random.PRNGKey(seed), (B, T, cfg.d_model), jnp.float32)
    params = NSAAttention(cfg).init(jax.random.PRNGKey(seed + 1), x)["params"]
    return x, params


def _apply(cfg, params, x):
    out, state = NSAAttention(cfg).apply({"params": params}, x, mutable=["intermediates"])
    inter = state["intermediates"]
    return out, inter.get("block_idx", [None])[0], inter["gates"][0]


def test_config_validation():
    with pytest.raises(ConfigError, match="gate_bias_init"):
        load_config("cpu_tiny", ["model.nsa.gate_bias_init=1,2"])
    with pytest.raises(ConfigError, match="train.dense_selection_steps"):
        load_config("cpu_tiny", ["train.dense_selection_steps=-1"])
    with pytest.raises(ConfigError, match="train.dense_selection_steps needs a strategy"):
        load_config("cpu_tiny", ["train.dense_selection_steps=5", "parallel.strategy=pmap"])
    with pytest.raises(ConfigError, match="train.scorer_distill_steps"):
        load_config("cpu_tiny", ["train.scorer_distill_steps=-2"])
    cfg = load_config("cpu_tiny", ["model.nsa.gate_bias_init=-2,-2,2"])
    assert cfg.model.nsa.gate_bias_init == (-2.0, -2.0, 2.0)


@pytest.mark.slow
def test_forward_matches_reference():
    # The defaults (no learning option in the model) give the spec's layer.
    cfg = tiny_model_cfg(G=2, K=2)
    x, params = _setup(cfg, 53)
    out, idx, _ = _apply(cfg, params, x)
    ref, ref_idx = nsa_layer_ref(params, x, cfg)
    np.testing.assert_array_equal(np.asarray(idx), ref_idx)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.slow
def test_gate_bias_init_sets_initial_gate_means():
    biases = (-2.0, -1.0, 2.0)
    # The project's init_std (the tiny test config's 0.3 would swamp the biases with noise).
    cfg = dataclasses.replace(tiny_model_cfg(G=2, K=2), init_std=0.02)
    cfg = _with(cfg, gate_bias_init=biases)
    x, params = _setup(cfg, 32)
    _, _, gates_BxTxHx3 = _apply(cfg, params, x)
    means = np.asarray(gates_BxTxHx3).mean(axis=(0, 1, 2))
    want = 1 / (1 + np.exp(-np.asarray(biases)))  # sigmoid: 0.119, 0.269, 0.881
    np.testing.assert_allclose(means, want, atol=0.01)
    # Default: zero biases, gates near 0.5.
    cfg0 = tiny_model_cfg(G=2, K=2)
    _, params0 = _setup(cfg0, 32)
    np.testing.assert_array_equal(np.asarray(params0["gate_fc2"]["bias"]), 0.0)


@pytest.mark.slow
def test_dense_warmup_and_distill_steps_train_each_phase_model():
    """Steps 0-1: every block selected (an n override) with the distillation; step 2: top-n with
    it; steps 3-4: top-n without it. Each step's loss is the plain loss of that config on the
    params before it; one compilation, and the phases' losses differ on these rows."""
    # T = 48: 6 blocks; n = 3 forced ones leave blocks out, and late queries have free candidates.
    overrides = [*STEP_OVERRIDES, "train.seq_len=48", "model.init_std=0.3", "train.scorer_distill=0.5"]
    cfg = load_config(None, [*overrides, "train.dense_selection_steps=2", "train.scorer_distill_steps=3"])
    models = {
        "dense": load_config(None, [*overrides, "model.nsa.n=6"]),
        "sparse": load_config(None, overrides),
        "plain": load_config(None, [*STEP_OVERRIDES, "train.seq_len=48", "model.init_std=0.3"]),
    }
    assert schedule.dense_selection_model(cfg).nsa.n == 6
    phases = schedule.phases(cfg)
    assert [(p.start, p.model.nsa.n, p.distill) for p in phases] == [(0, 6, 0.5), (2, 3, 0.5), (3, 3, 0.0)]
    mesh = make_mesh(cfg)
    plan = S.make_plan(cfg, mesh)
    state, step = S.create_state(plan), S.make_train_step(plan)
    rng = np.random.default_rng(0)
    plain_loss = {k: jax.jit(functools.partial(loss_and_stats, cfg=c)) for k, c in models.items()}
    for i, phase in enumerate(["dense", "dense", "sparse", "plain", "plain"]):
        tokens = rng.integers(0, 32, size=(1, 2, 49), dtype=np.int32)
        params = jax.device_get(state.params)
        want = {k: f(params, jnp.asarray(tokens[0])) for k, f in plain_loss.items()}
        assert abs(float(want["dense"][0]) - float(want["sparse"][0])) > 1e-5  # n changes the loss
        state, metrics = step(state, put_batch(tokens, mesh))
        loss, stats = want[phase]
        assert float(metrics["loss"]) == pytest.approx(float(loss), rel=1e-5), i
        # The KL tells the phases with and without the distillation apart (a small part of the loss).
        kl = stats.get("distill_kl", 0.0)
        assert float(metrics["distill_kl"]) == pytest.approx(float(kl), rel=1e-3, abs=0.0), i
        assert (float(kl) > 0) == (phase != "plain")
        assert float(metrics["ce"]) == pytest.approx(float(stats.get("ce", loss)), rel=1e-5), i
    assert step._cache_size() == 1


@pytest.mark.slow
def test_score_distill_in_the_layer_trains_only_the_scorer_keys():
    # The layer's KL moves the k_cmp projection and the key compressor, and nothing below
    # the layer (its input) nor any other weight: the distillation cannot pull on the
    # residual stream the LM loss trains.
    # The caller asks for it with a mutable `losses` collection; without one there is none.
    cfg = tiny_model_cfg(G=2, K=2)
    x, params = _setup(cfg, 48)
    _, state = NSAAttention(cfg).apply({"params": params}, x, mutable=["aux", "intermediates"])
    assert "losses" not in state

    def kl(params, x):
        _, state = NSAAttention(cfg).apply({"params": params}, x, mutable=["losses"])
        return state["losses"]["scorer_kl"][0]

    value = float(jax.jit(kl)(params, x))
    g_params, g_x = jax.jit(jax.grad(kl, argnums=(0, 1)))(params, x)
    assert value > 0
    assert float(jnp.max(jnp.abs(g_x))) == 0.0
    norms = {name: float(optax_norm(g)) for name, g in g_params.items()}
    assert norms.pop("k_cmp") > 0 and norms.pop("cmp_k") > 0, norms
    assert all(v == 0.0 for v in norms.values()), norms


def optax_norm(tree) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(leaf)) for leaf in jax.tree.leaves(tree)))


@pytest.mark.parametrize("fmt", ["split", "fused"])
def test_experiments_pair_positions_match_the_generator(fmt):
    # The harness recovers, from the tokens alone, where each queried pair lies (for the
    # selection recall); the generator knows it.
    batch = make_kv_batch(np.random.default_rng(3), 4, 128, 256, 32, 8, 8, placement="random", fmt=fmt)
    qpos, tpos = pair_positions(batch.tokens_BxT1, 256, fmt)
    np.testing.assert_array_equal(qpos, batch.query_key_pos_BxQ)
    np.testing.assert_array_equal(tpos, batch.pair_key_pos_BxQ + pair_len(fmt) - 1)


def _distill_reference(q, kc, k, l, d, lp):
    """float64 per-token KL(target || scorer) over the free blocks 1 .. t//lp - 2 (docs/NSA.md)."""
    q, kc, k = (np.asarray(x, np.float64) for x in (q, kc, k))
    B, T, H, Dk = q.shape
    Tc, K = kc.shape[1], kc.shape[2]
    G, Nb, scale = H // K, math.ceil(T / lp), Dk**-0.5
    kls = []
    for b in range(B):
        for t in range(T):
            free = list(range(1, t // lp - 1))
            if len(free) < 2:
                continue
            for kv in range(K):
                target, scorer = np.zeros(Nb), np.zeros(Nb)
                for h in range(kv * G, (kv + 1) * G):
                    s = q[b, t, h] @ k[b, : t + 1, kv].T * scale
                    p = np.exp(s - s.max())
                    p /= p.sum()
                    for pos in range(t + 1):
                        target[pos // lp] += p[pos] / G
                    vis = [i for i in range(Tc) if i * d + l - 1 <= t]
                    sc = np.array([q[b, t, h] @ kc[b, i, kv] * scale for i in vis])
                    pc = np.exp(sc - sc.max())
                    pc /= pc.sum()
                    for i, pi in zip(vis, pc):
                        for j in range(Nb):
                            if i * d < (j + 1) * lp and i * d + l > j * lp:
                                scorer[j] += pi
                tf, sf = target[free] / target[free].sum(), scorer[free] / scorer[free].sum()
                kls.append(np.sum(tf * np.log(tf / sf)))
    return float(np.mean(kls))


def test_score_distill_kl_matches_reference_and_trains_only_the_compressed_keys():
    B, T, H, K, Dk, l, d, lp = 2, 45, 4, 2, 8, 8, 4, 8
    keys = jax.random.split(jax.random.PRNGKey(4), 3)
    q = jax.random.normal(keys[0], (B, T, H, Dk)) * 1.5
    kc = jax.random.normal(keys[1], (B, (T - l) // d + 1, K, Dk)) * 1.5
    k = jax.random.normal(keys[2], (B, T, K, Dk)) * 1.5

    @jax.jit
    def kl(q, kc, k):
        return score_distill_kl(q, kc, k, l=l, d=d, lp=lp, query_chunk=16)

    ref = _distill_reference(q, kc, k, l, d, lp)
    assert ref > 0.01  # random keys disagree: the check below is not 0 == 0
    assert abs(float(kl(q, kc, k)) - ref) < 1e-4 * max(ref, 1.0)
    g_q, g_kc, g_k = jax.jit(jax.grad(kl, argnums=(0, 1, 2)))(q, kc, k)
    assert np.all(np.asarray(g_q) == 0) and np.all(np.asarray(g_k) == 0)
    # The compressed keys' gradient: a central difference of the float64 reference.
    direction = jax.random.normal(jax.random.PRNGKey(5), kc.shape)
    eps = 1e-3
    fd = (
        _distill_reference(q, kc + eps * direction, k, l, d, lp)
        - _distill_reference(q, kc - eps * direction, k, l, d, lp)
    ) / (2 * eps)
    assert abs(float(jnp.sum(g_kc * direction)) - fd) < 2e-3 * max(abs(fd), 1.0)


@pytest.mark.slow
def test_score_distill_adds_to_the_loss_and_is_off_by_default():
    base = [
        "model.n_layers=2",
        "model.d_model=32",
        "model.n_heads=2",
        "model.n_kv_heads=1",
        "model.d_ff=32",
        "train.seq_len=64",
        "model.nsa.l=8",
        "model.nsa.d=4",
        "model.nsa.lp=8",
        "model.nsa.n=3",
        "model.nsa.w=8",
        "model.vocab_size=64",
        "data.dataset=synthetic",
    ]
    cfg_off = load_config("cpu_tiny", base)
    cfg_on = load_config("cpu_tiny", [*base, "train.scorer_distill=0.5"])
    assert cfg_off.train.scorer_distill == 0.0
    from nsa_jax.model import init_params

    params = init_params(cfg_off.model, jax.random.PRNGKey(0), 64)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 65), 0, 64)
    loss_off, stats_off = jax.jit(functools.partial(loss_and_stats, cfg=cfg_off))(params, tokens)
    loss_on, stats_on = jax.jit(functools.partial(loss_and_stats, cfg=cfg_on))(params, tokens)
    assert "distill_kl" not in stats_off
    np.testing.assert_allclose(float(stats_on["ce"]), float(loss_off), rtol=1e-6)
    assert float(stats_on["distill_kl"]) > 0
    np.testing.assert_allclose(float(loss_on), float(loss_off) + 0.5 * float(stats_on["distill_kl"]), rtol=1e-6)
    with pytest.raises(ConfigError, match="train.scorer_distill"):
        load_config("cpu_tiny", [*base, "train.scorer_distill=-1"])


_ONE_DEVICE: dict = {}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_phases_on_two_devices_match_one_device(strategy):
    # The step switches phase on two devices as on one (the one-device phases are checked
    # against plain per-config losses above): dp's shard_map and the partitioned
    # strategies' vmap (fsdp: sharded params too) are the two code paths.
    overrides = [
        *STEP_OVERRIDES,
        "train.seq_len=48",
        "model.init_std=0.3",
        "train.scorer_distill=0.5",
        "train.dense_selection_steps=2",
        "train.scorer_distill_steps=3",
    ]
    rng = np.random.default_rng(1)
    batches = [rng.integers(0, 32, size=(1, 2, 49), dtype=np.int32) for _ in range(4)]

    def losses(strategy, devices):
        cfg = load_config(None, [*overrides, f"parallel.strategy={strategy}"])
        mesh = make_mesh(cfg, jax.devices()[:devices])
        plan = S.make_plan(cfg, mesh)
        state, step = S.create_state(plan), S.make_train_step(plan)
        out = []
        for b in batches:
            state, m = step(state, put_batch(b, mesh))
            out.append((float(m["loss"]), float(m["distill_kl"])))
        return np.asarray(out)

    assert len(jax.devices()) >= 2, "conftest sets --xla_force_host_platform_device_count=2"
    if "one" not in _ONE_DEVICE:
        _ONE_DEVICE["one"] = losses("dp", 1)
    one, two = _ONE_DEVICE["one"], losses(strategy, 2)
    assert one[3, 1] == 0.0 and np.all(one[:3, 1] > 0)
    np.testing.assert_allclose(two, one, rtol=1e-5, atol=1e-9)


# ---------------------------------------------------------------------------
# train.rope_positions: randomized RoPE positions


@pytest.mark.slow
def test_rope_positions_move_rope_only_as_the_reference_does():
    # RoPE at the given positions, blocks, window and causality at the token indices.
    cfg = tiny_model_cfg(G=2, K=2)
    x, params = _setup(cfg, 53)
    pos_T = np.sort(np.random.default_rng(0).choice(400, 53, replace=False)).astype(np.int32)
    out, state = NSAAttention(cfg).apply(
        {"params": params}, x, rope_positions_T=jnp.asarray(pos_T), mutable=["intermediates"]
    )
    ref, ref_idx = nsa_layer_ref(params, x, cfg, rope_pos=pos_T)
    np.testing.assert_array_equal(np.asarray(state["intermediates"]["block_idx"][0]), ref_idx)
    assert rel_err(out, ref) < 1e-5
    plain, _ = nsa_layer_ref(params, x, cfg)
    assert rel_err(out, plain) > 1e-2  # the positions did move RoPE


def test_random_rope_positions_are_a_sorted_draw_keyed_by_the_tokens():
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 64), 0, 32)
    pos = np.asarray(random_rope_positions(tokens, 1000))
    assert pos.shape == (64,) and pos.dtype == np.int32
    assert np.all(np.diff(pos) > 0) and pos[0] >= 0 and pos[-1] < 1000
    assert pos[-1] - pos[0] > 500  # spread over [0, 1000), not 0..63
    # A few contiguous pieces: all but at most ROPE_PIECES - 1 neighbours at distance 1.
    assert 1 <= np.sum(np.diff(pos) > 1) <= ROPE_PIECES - 1
    np.testing.assert_array_equal(np.asarray(jax.jit(random_rope_positions, static_argnums=1)(tokens, 1000)), pos)
    other = np.asarray(random_rope_positions(tokens.at[1, 7].add(1), 1000))
    assert not np.array_equal(other, pos)
    assert random_rope_positions(tokens, 64) is None and random_rope_positions(tokens, 0) is None
    with pytest.raises(ConfigError, match="train.rope_positions"):
        load_config("cpu_tiny", ["train.rope_positions=-1"])


@pytest.mark.slow
def test_rope_positions_reach_every_layer_of_the_loss():
    # RoPE sees only differences of positions: the whole model's loss at 0..T-1 shifted by a
    # constant is the loss at 0..T-1, through every (scanned) layer; a random draw changes it.
    # init_std 0.3: attention peaked enough at init that positions change the loss.
    overrides = [o for o in STEP_OVERRIDES if not o.startswith("train.")]
    cfg = load_config("cpu_tiny", [*overrides, "train.seq_len=32", "model.init_std=0.3"])
    from nsa_jax.model import NSALM, cross_entropy, init_params

    params = init_params(cfg.model, jax.random.PRNGKey(0), 32)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 33), 0, 32)
    loss_off, _ = loss_and_stats(params, tokens, cfg=cfg)
    shifted = NSALM(cfg.model).apply({"params": params}, tokens[:, :-1], rope_positions_T=jnp.arange(32) + 1000)
    np.testing.assert_allclose(float(cross_entropy(shifted, tokens[:, 1:])), float(loss_off), rtol=1e-5)
    cfg_on = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, rope_positions=512))
    loss_on, _ = loss_and_stats(params, tokens, cfg=cfg_on)
    assert abs(float(loss_on) - float(loss_off)) > 1e-3
    with pytest.raises(ValueError, match="rope_positions_T is for training"):
        NSALM(cfg.model, mode="prefill").apply({"params": params}, tokens[:, :-1], rope_positions_T=jnp.arange(32))
