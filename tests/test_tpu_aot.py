"""The `tpu` tier: the TPU program compiled on this CPU host with libtpu (pip install -e ".[tpu]").

Marked `tpu` and skipped, saying so, without libtpu. The selection branch's Pallas TPU (Mosaic) kernels
and splash attention's (the window branch, dense causal attention, the compressed branch) compile, forward
and backward, for v5e and v6e at the a100_pcie layer's shapes (Mosaic refuses a kernel over VMEM); the
selection kernels move fewer bytes (XLA's cost analysis, with the kernels' own cost estimates) than the
XLA selection path; a reduced a100_pcie train step compiles for a v5e slice with the kernels in it, and
its gradient all-reduce carries every parameter once in bf16; `launch.info --target` takes a TPU slice
and refuses an unknown one. Nothing runs on a TPU here.
"""

from __future__ import annotations

import os

# pytest-xdist's workers each load libtpu: without this the second one fails on libtpu's lockfile.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from launch import info as info_cli  # noqa: E402
from nsa_jax.config import load_config  # noqa: E402
from nsa_jax.kernels import xla  # noqa: E402
from nsa_jax.kernels.selection_tpu import selection_attention_tpu  # noqa: E402
from nsa_jax.kernels.splash_tpu import compressed_attention_splash, window_attention_splash  # noqa: E402
from nsa_jax.model import init_params  # noqa: E402
from nsa_jax.tools import aot, xla_dump  # noqa: E402

pytestmark = [
    pytest.mark.tpu,
    pytest.mark.skipif(not aot.tpu_compiler_available(), reason=f"libtpu is not installed ({aot.TPU_INSTALL_HINT})"),
]

# The a100_pcie layer's selection: 12 heads over 2 KV heads, head dim 64, lp = 64, n = 16.
T, G, K, D, LP, N = 8192, 6, 2, 64, 64, 16


def _abstract(target: str, n: int = 1):
    sharding = NamedSharding(Mesh(np.array(aot.target_devices(target, n)), ("d",)), P())
    sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    return sds((1, T, G * K, D), jnp.bfloat16), sds((1, T, K, D), jnp.bfloat16), sds((1, T, K, N), jnp.int32)


def _fwd_bwd(attend):
    def loss(q, k, v, idx):
        return attend(q, k, v, idx).astype(jnp.float32).sum()

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def tpu_attend(q, k, v, idx):
    return selection_attention_tpu(q, k, v, idx, LP)


def xla_attend(q, k, v, idx):
    # One query chunk: XLA's cost analysis counts a loop's body once, not once per trip.
    return xla.selection_attention_xla(q, k, v, idx, LP, query_chunk=T)


@pytest.mark.parametrize("target", ["v5e-4", "v6e-4"])  # one chip of each
def test_selection_kernels_compile_for_tpu_and_move_fewer_bytes_than_xla(target):
    q, kv, idx = _abstract(target)
    kernels = _fwd_bwd(tpu_attend).lower(q, kv, kv, idx).compile()
    assert "tpu_custom_call" in kernels.as_text()  # the Mosaic kernels, not a fallback
    gathered = _fwd_bwd(xla_attend).lower(q, kv, kv, idx).compile()
    moved = {name: c.cost_analysis()["bytes accessed"] for name, c in (("tpu", kernels), ("xla", gathered))}
    assert moved["tpu"] < moved["xla"], moved
    temp = {name: c.memory_analysis().temp_size_in_bytes for name, c in (("tpu", kernels), ("xla", gathered))}
    assert temp["tpu"] < temp["xla"], temp


@pytest.mark.parametrize("target", ["v5e-4", "v6e-4"])
def test_splash_attention_compiles_for_tpu(target):
    # The window branch (w = 512), dense causal attention and the compressed branch (l = 32, d = 16): each
    # a forward and its dQ and dK/dV kernels.
    q, kv, _ = _abstract(target)
    kc = jax.ShapeDtypeStruct((1, (T - 32) // 16 + 1, K, D), jnp.bfloat16, sharding=kv.sharding)
    for attend, keys in (
        (lambda q, k, v, _: window_attention_splash(q, k, v, 512), kv),
        (lambda q, k, v, _: window_attention_splash(q, k, v, T), kv),
        (lambda q, k, v, _: compressed_attention_splash(q, k, v, l=32, d=16), kc),
    ):
        text = _fwd_bwd(attend).lower(q, keys, keys, None).compile().as_text()
        assert text.count("tpu_custom_call") >= 3, text.count("tpu_custom_call")


def test_splash_at_a_traced_chunk_offset_compiles_for_tpu():
    # Context parallelism: a device's chunk of T/4 queries over the whole sequence's keys at an offset
    # traced from its index: one kernel per chunk offset (forward, dQ, dK/dV each), switched.
    q, kv, _ = _abstract("v5e-4")
    chunk, offsets = T // 4, tuple(range(0, T, T // 4))
    q_chunk = jax.ShapeDtypeStruct((1, chunk, G * K, D), q.dtype, sharding=q.sharding)
    offset = jax.ShapeDtypeStruct((), jnp.int32, sharding=q.sharding)
    attend = lambda q, k, v, o: window_attention_splash(q, k, v, 512, q_offset=o, offsets=offsets)  # noqa: E731
    text = _fwd_bwd(attend).lower(q_chunk, kv, kv, offset).compile().as_text()
    assert text.count("tpu_custom_call") >= 3 * len(offsets), text.count("tpu_custom_call")


def test_a_reduced_a100_pcie_step_compiles_for_a_v5e_slice_with_the_kernels():
    cfg = load_config("a100_pcie", ["model.n_layers=2", "model.scan_unroll=1", "train.global_batch=4"])
    compiled = aot.compile_train_step(cfg, "v5e-4", 4)
    text = compiled.executable.as_text()  # the layers are one scanned body: each kernel in it once or more
    assert text.count("tpu_custom_call") >= 6 and all(
        name in text for name in ("fwd_kernel", "dq_kernel", "dkv_kernel", "splash_mha")
    )
    assert 0 < compiled.memory["total"] <= aot.get_target("v5e-4").usable_bytes()
    # dp's one gradient all-reduce in bf16 (parallel.grad_reduce_dtype), read from the compiled text: every
    # parameter's 2 bytes, and a few scalars (the loss, the token count).
    params = jax.eval_shape(lambda: init_params(cfg.model, jax.random.PRNGKey(0), cfg.train.seq_len))
    grad_bytes = 2 * sum(x.size for x in jax.tree.leaves(params))
    reduced = xla_dump.hlo_collectives(text)["all-reduce"]["payload_bytes"]
    assert grad_bytes <= reduced <= grad_bytes + 4096, (reduced, grad_bytes)


def test_info_targets_a_tpu_slice_and_refuses_an_unknown_one(capsys):
    assert info_cli.main(["--config", "a100_pcie", "--target", "v7x-8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown target 'v7x-8'") and "TPU slices: v4-8" in err
    assert info_cli.main(["--config", "a100_pcie", "--target", "v5e-8", "--devices", "16"]) == 2
    assert "--devices 16: v5e-8 has 8 chips" in capsys.readouterr().err
