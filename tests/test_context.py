"""Context parallelism (parallel.context; nsa_jax/nsa/context.py): one sequence over several devices.

The claim is exactness: a step with every sequence split over C devices computes what the
one-device step computes (nsa_jax's one-device path is itself held to the independent
references of tests/reference.py by test_nsa_layer.py and test_train.py), to fp32 rounding.
The noise floor of that rounding is measured here too: the same one-device model with
another query chunk (a re-association of the same sums) differs from itself by about as
much as the split does, so a tolerance below it would test nothing but luck.

In process, on the two host devices conftest makes: the layout, the collectives, and C = 2
against C = 1 at a ragged T with accumulation and the logged statistics (fast tier); the
noise floor, loss weights and held-out sums, and the Pallas kernels (slow tier). In
subprocesses (slow tier): four host devices (C = 4, data x seq = 2 x 2), a checkpoint of a
C = 2 run resumed at C = 1 and C = 4 and read by generate and evaluate on one device, and a
sequence split over two processes.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from nsa_jax.config import ConfigError, load_config
from nsa_jax.evaluation.heldout import make_eval_fn
from nsa_jax.kernels import plan_kernels
from nsa_jax.mesh import SEQ, make_mesh
from nsa_jax.nsa import context as CX
from nsa_jax.seq_layout import device_order, natural_slots
from nsa_jax.step import step as S

from helpers import LAUNCH_TRAIN, TINY_NSA, cpu_env, python_c, run_module, set_flags

# Two KV heads of G = 2, the MLP compressor (it has weights, and its blocks straddle chunks).
MODEL = [*TINY_NSA, "model.n_heads=4", "model.n_kv_heads=2", "model.vocab_size=40", "model.n_layers=2"]
MODEL += ["model.nsa.cmp_phi=mlp", "model.init_std=0.05"]
# Tolerances: the noise floor measured below is 1e-7 (loss) and under 1e-6 (gradients).
LOSS_TOL, GRAD_TOL = 1e-6, 2e-6


def cfg_of(T: int, C: int, devices: int, *extra: str):
    base = [f"train.seq_len={T}", "train.global_batch=2", "train.accumulate=2", "train.warmup=0"]
    base += ["parallel.grad_reduce_dtype=float32", f"parallel.context={C}", f"parallel.num_devices={devices}"]
    return load_config(None, [*MODEL, *base, *extra])


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def grads_loss_stats(cfg, tokens):
    plan = S.make_plan(cfg, make_mesh(cfg))
    params = S.create_state(plan).params
    out = jax.jit(S.make_grad_fn(plan))(params, jax.device_put(tokens, plan.batch))
    return jax.device_get(out)


# ---------------------------------------------------------------------------
# the layout


@pytest.mark.parametrize("C", [1, 2, 3])
def test_device_order_puts_an_early_and_a_late_chunk_on_every_device(C):
    order = device_order(C)
    assert sorted(order.tolist()) == list(range(2 * C))
    for i in range(C):
        assert order[2 * i : 2 * i + 2].tolist() == [i, 2 * C - 1 - i]
    assert order[natural_slots(C)].tolist() == list(range(2 * C))
    layout = CX.SeqLayout(C, 4, 8 * C - 3)
    laid = np.asarray(layout.lay_out(jnp.arange(1, 8 * C - 2), 0))  # positions + 1; padding 0
    for i in range(C):
        held = laid[8 * i : 8 * i + 8]
        for c, part in zip((i, 2 * C - 1 - i), (held[:4], held[4:])):
            want = np.arange(4 * c, 4 * c + 4) + 1
            assert part.tolist() == np.where(want <= 8 * C - 3, want, 0).tolist()


def test_gather_positions_and_halo_inside_shard_map():
    C, S_, B = 2, 8, 1
    layout = CX.SeqLayout(C, S_, 2 * C * S_)
    mesh = Mesh(np.asarray(jax.devices()[:C]), (SEQ,))
    x_natural = jnp.arange(2 * C * S_, dtype=jnp.float32).reshape(B, -1, 1, 1) + 1

    def local(x):
        return layout.positions()[None], layout.gather(x), layout.prev_tails(x, 3)

    f = jax.shard_map(local, mesh=mesh, in_specs=P(None, SEQ), out_specs=(P(None, SEQ),) * 3, check_vma=False)
    pos, gathered, tails = f(layout.lay_out(x_natural, 1))
    assert np.asarray(pos).reshape(-1).tolist() == np.asarray(layout.lay_out(jnp.arange(2 * C * S_), 0)).tolist()
    # Every device holds the whole sequence in position order.
    np.testing.assert_array_equal(np.asarray(gathered).reshape(C, -1), np.tile(np.asarray(x_natural).ravel(), (C, 1)))
    # Each chunk's halo: the 3 tokens before it (chunk 0: zeros).
    held = np.asarray(tails).reshape(C, 2, 3)
    for i in range(C):
        for k, c in enumerate((i, 2 * C - 1 - i)):
            want = [0, 0, 0] if c == 0 else [c * S_ - 2, c * S_ - 1, c * S_]
            assert held[i, k].tolist() == want


# ---------------------------------------------------------------------------
# exactness on two devices


RAGGED_T = 53  # padded to 64 over 2 x 2 chunks of 16


@pytest.fixture(scope="module")
def tokens_ragged():
    return np.random.default_rng(0).integers(0, 40, size=(2, 2, RAGGED_T + 1)).astype(np.int32)


@pytest.fixture(scope="module")
def one_device_ragged(tokens_ragged):
    return grads_loss_stats(cfg_of(RAGGED_T, 1, 1, "model.n_layers=1"), tokens_ragged)


@pytest.mark.slow
def test_one_device_noise_floor(tokens_ragged, one_device_ragged):
    """The same model with another query chunk: the tolerances below sit just above this."""
    g1, l1, _ = one_device_ragged
    g2, l2, _ = grads_loss_stats(cfg_of(RAGGED_T, 1, 1, "model.n_layers=1", "model.nsa.query_chunk=16"), tokens_ragged)
    assert abs(float(l2 - l1)) / float(l1) < LOSS_TOL
    floor = max(rel(a, b) for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g1)))
    assert floor < GRAD_TOL


def test_two_devices_at_a_ragged_length_equal_one(tokens_ragged, one_device_ragged):
    """A ragged T (53, padded to 64 over 2 x 2 chunks), accumulate 2: loss, every gradient, every statistic."""
    g1, l1, s1 = one_device_ragged
    g2, l2, s2 = grads_loss_stats(cfg_of(RAGGED_T, 2, 2, "model.n_layers=1"), tokens_ragged)
    assert abs(float(l2 - l1)) / float(l1) < LOSS_TOL
    for path, a, b in zip(jax.tree_util.tree_leaves_with_path(g2), jax.tree.leaves(g2), jax.tree.leaves(g1)):
        assert rel(a, b) < GRAD_TOL, jax.tree_util.keystr(path[0])
    assert set(s2) == set(s1) and s1
    for k in s1:
        np.testing.assert_allclose(s2[k], s1[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.slow
@pytest.mark.parametrize("scorer", ["mix", "rescore"])
def test_the_scorers_under_two_devices_equal_one(tokens_ragged, scorer):
    """The block scorers under a split sequence (kernels/scorers.py): mix holds both halves, cmp's scores
    of each device's pieces and minmax's bounds over sub-blocks of 4 from the gathered selection keys;
    rescore cmp's candidates of each piece (6 of them) re-ranked over the gathered keys.
    C = 2 against C = 1, loss and every gradient. Blocks of 8 with n = 4: a free block to choose from
    position 24 on (the file's other tests select every block)."""
    extra = ["model.n_layers=1", f"model.nsa.scorer={scorer}", "train.accumulate=1", "model.nsa.lp=8", "model.nsa.n=4"]
    extra += {"mix": ["model.nsa.scorer_sub=4"], "rescore": ["model.nsa.scorer_candidates=6"]}[scorer]
    g1, l1, s1 = grads_loss_stats(cfg_of(RAGGED_T, 1, 1, *extra), tokens_ragged)
    g2, l2, s2 = grads_loss_stats(cfg_of(RAGGED_T, 2, 2, *extra), tokens_ragged)
    assert abs(float(l2 - l1)) / float(l1) < LOSS_TOL
    for path, a, b in zip(jax.tree_util.tree_leaves_with_path(g2), jax.tree.leaves(g2), jax.tree.leaves(g1)):
        assert rel(a, b) < GRAD_TOL, jax.tree_util.keystr(path[0])


@pytest.mark.slow
def test_a_chunked_loss_under_two_devices_equals_whole_logits_on_one(tokens_ragged, one_device_ragged):
    """train.loss_chunk=5 (no divisor of a device's 32 positions) under C = 2 and fsdp: the loss and
    every gradient as one device's loss over whole logits."""
    g1, l1, _ = one_device_ragged
    c2 = cfg_of(RAGGED_T, 2, 2, "model.n_layers=1", "train.loss_chunk=5", "parallel.strategy=fsdp")
    g2, l2, _ = grads_loss_stats(c2, tokens_ragged)
    assert abs(float(l2 - l1)) / float(l1) < LOSS_TOL
    for path, a, b in zip(jax.tree_util.tree_leaves_with_path(g2), jax.tree.leaves(g2), jax.tree.leaves(g1)):
        assert rel(a, b) < GRAD_TOL, jax.tree_util.keystr(path[0])


@pytest.mark.slow  # 35 s; the fast tier keeps zero1 and C = 2 apart
def test_zero1_under_context_parallelism_steps_as_dp_with_the_moments_split(tokens_ragged):
    """parallel.strategy=zero1 at C = 2 (data 1 x seq 2): two whole train steps (the reduced gradient,
    clipping, Adam on slices, the parameters gathered) give dp's state at C = 2, whose gradients the
    tests above hold to one device's, while every Adam moment with an even axis lives half on each
    device. Against one device: the loss and the gradient norm. (Its parameters differ where Adam
    turns the split's 1e-6 rounding of a near-zero gradient into a step of another sign, so they are
    compared with dp at the same split.)"""
    extra = ["model.n_layers=1", "train.grad_clip=0.5", "train.lr=1e-2"]
    runs = {}
    for name, cfg in (
        ("dp C=1", cfg_of(RAGGED_T, 1, 1, *extra)),
        ("dp C=2", cfg_of(RAGGED_T, 2, 2, *extra)),
        ("zero1 C=2", cfg_of(RAGGED_T, 2, 2, "parallel.strategy=zero1", *extra)),
    ):
        plan = S.make_plan(cfg, make_mesh(cfg))
        state = S.create_state(plan)
        step = S.make_train_step(plan)
        for batch in (tokens_ragged, tokens_ragged[::-1]):
            state, metrics = step(state, jax.device_put(batch, plan.batch))
        runs[name] = (plan, state, jax.device_get(metrics))
    (_, _, m1), (_, dp, _), (plan, got, m2) = runs["dp C=1"], runs["dp C=2"], runs["zero1 C=2"]
    assert float(m2["grad_norm"]) == pytest.approx(float(m1["grad_norm"]), rel=GRAD_TOL)
    assert float(m2["loss"]) == pytest.approx(float(m1["loss"]), rel=LOSS_TOL)
    for a, b in zip(jax.tree.leaves(jax.device_get(got.params)), jax.tree.leaves(jax.device_get(dp.params))):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)
    split = 0
    for leaf in jax.tree.leaves(got.opt_state):
        if any(size % 2 == 0 and size > 1 for size in leaf.shape):
            assert leaf.addressable_shards[0].data.size * 2 == leaf.size, leaf.sharding
            split += 1
    assert split >= 2 * len(jax.tree.leaves(got.params)) - 2  # both moments of (nearly) every weight
    assert plan.state.params == jax.tree.map(lambda _: plan.replicated, plan.state.params)


@pytest.mark.slow
def test_loss_weights_and_heldout_sums_under_two_devices():
    """kv_recall's answer-only loss (a weight that depends on the whole row) and the held-out sums."""
    extra = ["data.dataset=kv_recall", "data.kv_loss_mask=true", "model.n_layers=1"]
    T = 96
    c1, c2 = cfg_of(T, 1, 1, *extra), cfg_of(T, 2, 2, *extra)
    from nsa_jax.data import make_dataset

    rows = np.stack([next(make_dataset(c1, "train")) for _ in range(2)])  # [A, B, T + 1]
    g1, l1, _ = grads_loss_stats(c1, rows)
    g2, l2, _ = grads_loss_stats(c2, rows)
    assert abs(float(l2 - l1)) / float(l1) < LOSS_TOL
    assert max(rel(a, b) for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g1))) < GRAD_TOL

    plan2 = S.make_plan(c2, make_mesh(c2))
    params = S.create_state(plan2).params
    want = jax.jit(make_eval_fn(c1, make_mesh(c1)))(jax.device_get(params), rows[0])
    got = jax.jit(make_eval_fn(c2, plan2.mesh))(params, jax.device_put(rows[0], plan2.replicated))
    # fsdp at C = 2: the parameters in halves over (data, seq), each layer gathered as it runs.
    c3 = cfg_of(T, 2, 2, *extra, "parallel.strategy=fsdp")
    plan3 = S.make_plan(c3, make_mesh(c3))
    sliced = jax.device_put(jax.device_get(params), plan3.state.params)
    got3 = jax.jit(make_eval_fn(c3, plan3.mesh))(sliced, jax.device_put(rows[0], plan3.replicated))
    assert float(want["scored"]) > 0
    for k in want:
        np.testing.assert_allclose(float(got[k]), float(want[k]), rtol=1e-6, err_msg=k)
        np.testing.assert_allclose(float(got3[k]), float(want[k]), rtol=1e-6, err_msg=k)


# ---------------------------------------------------------------------------
# what runs, and bad input


def test_plan_names_the_context_and_keeps_cudnn_off():
    cfg = cfg_of(256, 2, 2)
    layout = CX.seq_layout(cfg)
    plan = plan_kernels(cfg.model.nsa, layout.seq_len, "gpu", layout=layout)
    assert plan.context == 2 and plan.layout is layout
    assert plan.describe()["context"].startswith("2 devices per sequence")
    nsa = dataclasses.replace(cfg.model.nsa, attention_impl="auto", compressed_kernel="cudnn")
    assert plan_kernels(nsa, 256, "gpu").cmp == "cudnn"
    assert plan_kernels(nsa, 256, "gpu", layout=layout).cmp == "pallas"
    assert "context" not in plan_kernels(cfg.model.nsa, 256, "gpu").describe()


@pytest.mark.parametrize(
    "overrides,words",
    [
        (["parallel.context=0"], "parallel.context must be >= 1"),
        (["parallel.context=2", "parallel.strategy=pmap"], "runs with parallel.strategy=dp"),
        (["parallel.context=2", "parallel.strategy=gspmd"], "runs with parallel.strategy=dp, zero1 or fsdp"),
        (["parallel.context=2", "train.scorer_distill=1.0"], "set train.scorer_distill=0"),
        (["parallel.context=4", "train.seq_len=40"], "set train.seq_len to at least 49"),
        (["parallel.context=2", "model.dtype=bfloat16", "model.nsa.compressed_kernel=cudnn"], "takes no query offset"),
    ],
)
def test_bad_context_settings_are_one_line(overrides, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, [*MODEL, "train.seq_len=64", *overrides])
    assert words in str(e.value) and "\n" not in str(e.value)


def test_context_that_does_not_divide_the_devices_is_one_line():
    cfg = cfg_of(64, 2, 0)
    with pytest.raises(ValueError, match=r"parallel.context=2 must divide the run's 3 device\(s\)"):
        make_mesh(cfg, jax.devices()[:1] * 3)


def test_too_few_cpu_devices_for_the_context_degree_name_the_host_device_flag():
    # One CPU device and parallel.context=2: no parallel.num_devices helps; the host-device flag does.
    with pytest.raises(ValueError) as e:
        make_mesh(cfg_of(64, 2, 0), jax.devices()[:1])
    msg = str(e.value)
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=2" in msg and "num_devices" not in msg, msg
    # More devices asked for than the test process's two: the same flag, with the number asked for.
    with pytest.raises(ValueError, match=r"num_devices is 4 but only 2 devices are visible; .*_device_count=4 "):
        make_mesh(cfg_of(64, 2, 4))


@pytest.mark.slow
@pytest.mark.parametrize("existed", [False, True])
def test_a_context_degree_one_cpu_device_cannot_run_leaves_the_out_dir_as_it_was(tmp_path, existed):
    out = tmp_path / "cp"
    if existed:
        out.mkdir()
    r = run_module(*LAUNCH_TRAIN[2:], "--out-dir", str(out), "--set", "parallel.context=2", env=cpu_env(devices=1))
    assert r.returncode == 2 and r.stderr.count("error:") == 1, r.stderr[-2000:]
    assert "--xla_force_host_platform_device_count=2" in r.stderr
    assert out.is_dir() == existed and (not existed or not any(out.iterdir()))


# ---------------------------------------------------------------------------
# four devices, and resume across degrees (subprocesses)

FOUR_DEVICES = """
import json, sys
import jax, numpy as np
jax.config.update("jax_default_matmul_precision", "highest")
sys.path.insert(0, "tests")
from test_context import cfg_of, grads_loss_stats, rel
from nsa_jax.mesh import make_mesh
from nsa_jax.step import step as S
rng = np.random.default_rng(1)
out = {}
# One reference on one device: loss and gradients do not depend on the data split (equal rows per
# shard); the statistics (ratios finished per shard) are compared where the split is the same.
for T in (100,):  # ragged: padded to 128 over 4 devices, as over 2 x 2
    tokens = rng.integers(0, 40, size=(2, 2, T + 1)).astype(np.int32)
    g1, l1, s1 = grads_loss_stats(cfg_of(T, 1, 1), tokens)
    for C, D, strategy in ((4, 1, "dp"), (2, 2, "dp"), (2, 2, "fsdp")):
        cfg = cfg_of(T, C, C * D, f"parallel.strategy={strategy}")
        g, l, s = grads_loss_stats(cfg, tokens)
        out[f"T{T}-C{C}xD{D}-{strategy}"] = {
            "loss": abs(float(l - l1)) / float(l1),
            "grad": max(rel(a, b) for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g1))),
            "stats": max(float(np.max(np.abs(np.asarray(s[k]) - np.asarray(s1[k])))) for k in s1) if D == 1 else 0.0,
            # leaves whose parameters live in quarters (fsdp: split over data and seq together)
            "quartered": sum(
                x.addressable_shards[0].data.size * 4 == x.size
                for x in jax.tree.leaves(S.create_state(S.make_plan(cfg, make_mesh(cfg))).params)
            ),
        }
print("RESULT", json.dumps(out))
"""


@pytest.mark.slow
def test_four_devices_equal_one_with_data_and_seq():
    r = python_c(
        "import os\n"  # four host devices, the test process's other XLA flags kept
        "flags = [f for f in os.environ.get('XLA_FLAGS', '').split() if 'device_count' not in f]\n"
        "os.environ['XLA_FLAGS'] = ' '.join([*flags, '--xla_force_host_platform_device_count=4'])\n"
        "os.environ['JAX_PLATFORMS'] = 'cpu'\n" + FOUR_DEVICES
    )
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.split("RESULT", 1)[1])
    assert set(result) == {"T100-C4xD1-dp", "T100-C2xD2-dp", "T100-C2xD2-fsdp"}
    for case, err in result.items():
        assert err["loss"] < LOSS_TOL and err["grad"] < GRAD_TOL and err["stats"] < 1e-5, (case, err)
    assert result["T100-C2xD2-dp"]["quartered"] == 0
    assert result["T100-C2xD2-fsdp"]["quartered"] >= 8  # every weight matrix of the layer and the MLP


RUN = [
    "model.d_model=64",
    "model.n_layers=1",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.d_ff=128",
    "train.seq_len=200",
    "train.global_batch=2",
    "train.log_every=1",
    "train.eval_every=1000",
    "checkpoint.save_every=3",
    "logging.tensorboard=false",
]


def _losses(out) -> dict[int, float]:
    with open(out / "training.csv") as f:
        return {int(r["step"]): float(r["loss"]) for r in csv.DictReader(f)}


@pytest.mark.slow
def test_a_checkpoint_of_two_devices_resumes_at_one_and_four(tmp_path):
    """6 steps at C = 2 (data 2 x seq 2); the step-3 checkpoint resumed at C = 1 (2 devices) and at
    C = 4 (one row group: the elastic split makes 2 micro-batches of 1): steps 4-6 as the uninterrupted run."""
    env = cpu_env(devices=4)

    def train(out, steps, *extra):
        args = ["--steps", str(steps), "--out-dir", str(out), *set_flags([*RUN, *extra])]
        r = run_module(*LAUNCH_TRAIN[2:], *args, env=env)
        assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
        return r

    full = tmp_path / "full"
    r = train(full, 3, "parallel.context=2")
    assert "x 2 on the seq axis (context parallelism: each sequence of 200 tokens, padded to 256" in r.stdout
    for C in (1, 4):  # the step-3 checkpoint, resumed at other degrees below
        shutil.copytree(full, tmp_path / f"c{C}")
    train(full, 6, "parallel.context=2")  # resumed at the same degree: what the other degrees must give
    want = _losses(full)
    for C, extra in ((1, ["parallel.num_devices=2"]), (4, [])):
        out = tmp_path / f"c{C}"
        r = train(out, 6, f"parallel.context={C}", *extra)
        got = _losses(out)
        for step in (4, 5, 6):
            assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (C, step, got[step], want[step])
        env_json = json.loads((out / "env.json").read_text())
        assert env_json["mesh"]["shape"] == {1: {"data": 2, "seq": 1}, 4: {"data": 1, "seq": 4}}[C]
    # Generation and evaluation of the C = 2 checkpoint run unchanged on one device.
    one = cpu_env(devices=1)
    r = run_module("launch.generate", "--ckpt", str(full), "--prompt", "ab", "--max-new-tokens", "8", env=one)
    assert r.returncode == 0, r.stderr[-2000:]
    ev = tmp_path / "eval"
    args = ["--ckpt", str(full), "--suites", "loss-by-position", "--lengths", "256", "--out", str(ev)]
    r = run_module("launch.evaluate", *args, env=one)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (ev / "evaluation.json").exists()


@pytest.mark.slow
def test_checkpoints_cross_between_fsdp_with_context_and_dp_on_one_device_per_row(tmp_path):
    """A dp run at C = 1 (2 devices) for 9 steps is the reference. Its step-3 checkpoint resumed under
    fsdp at C = 2 (data 2 x seq 2: parameters and moments in quarters) gives steps 4-6, and that run's
    step-6 checkpoint resumed under dp at C = 1 gives steps 7-9, as the reference does."""
    env = cpu_env(devices=4)
    dp1 = ["parallel.context=1", "parallel.num_devices=2"]
    fsdp2 = ["parallel.context=2", "parallel.strategy=fsdp"]

    def train(out, steps, extra):
        args = ["--steps", str(steps), "--out-dir", str(out), *set_flags([*RUN, *extra])]
        r = run_module(*LAUNCH_TRAIN[2:], *args, env=env)
        assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
        return r

    ref, cross = tmp_path / "ref", tmp_path / "cross"
    train(ref, 3, dp1)
    shutil.copytree(ref, cross)
    train(ref, 9, dp1)
    want = _losses(ref)
    r = train(cross, 6, fsdp2)
    assert "x 2 on the seq axis" in r.stdout
    train(cross, 9, dp1)
    got = _losses(cross)
    assert set(got) == set(range(1, 10))
    for step in range(4, 10):
        assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (step, got[step], want[step])


@pytest.mark.slow
def test_the_pallas_kernels_under_two_devices_equal_one():
    """The GPU path's kernels (interpreted here) at a query offset: C = 2 against C = 1 with the gather
    selection kernel, the long-context one (each kernel under an offset: tests/test_kernels_offset.py)."""
    tokens = np.random.default_rng(2).integers(0, 40, size=(1, 2, 91)).astype(np.int32)
    for kernel in ("gather",):
        extra = ["model.nsa.attention_impl=pallas", f"model.nsa.selection_kernel={kernel}", "train.accumulate=1"]
        extra.append("model.n_layers=1")
        g1, l1, _ = grads_loss_stats(cfg_of(90, 1, 1, *extra), tokens)
        g2, l2, _ = grads_loss_stats(cfg_of(90, 2, 2, *extra), tokens)
        assert abs(float(l2 - l1)) / float(l1) < LOSS_TOL, kernel
        assert max(rel(a, b) for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g1))) < GRAD_TOL, kernel


@pytest.mark.slow
def test_a_sequence_split_over_two_processes(tmp_path):
    """launch.spawn: 2 processes of one CPU device each, each sequence over both (seq spans the processes,
    which read the same rows): the losses of one process with 2 devices."""
    args = ["--steps", "3", *set_flags([*RUN, "parallel.context=2"])]
    one = run_module(*LAUNCH_TRAIN[2:], *args, "--out-dir", str(tmp_path / "one"), env=cpu_env(devices=2))
    assert one.returncode == 0, one.stderr[-2000:]
    cmd = [*LAUNCH_TRAIN, *args, "--out-dir", str(tmp_path / "two")]
    two = run_module("launch.spawn", "--nproc", "2", "--grace", "5", "--", *cmd, env=cpu_env(devices=1))
    assert two.returncode == 0, (two.stdout[-2000:], two.stderr[-2000:])
    assert "[0] boot: 2 processes, 1 cpu device on the data axis x 2 on the seq axis" in two.stdout
    want, got = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert set(got) == {1, 2, 3}
    for step in got:
        assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (step, got[step], want[step])
