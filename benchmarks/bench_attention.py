"""Benchmark the full NSA attention layer against a dense causal attention layer.

Both layers map x[B, T, D] -> [B, T, D] at the production head configuration of
`configs/a100_pcie.yaml` (D=768, H=12 query heads, K=2 KV heads, Dk=Dv=64; NSA
with l=32, d=16, lp=64, n=16, w=512):

* ``nsa``: `NSAAttention` as the model runs it: shared Q, three K/V projection
  pairs, compression MLPs, top-n block selection, the compressed / selected /
  sliding-window branches and the sigmoid gates (kernels picked by
  `attention_impl`: Pallas on GPU, the chunked XLA path elsewhere).
* ``dense``: the same Q/K/V/O projections and RoPE with full causal softmax
  attention, as the faster of two XLA formulations, each timed:
    - ``xla``: `jax.nn.dot_product_attention(implementation="xla")`, which
      materialises the H x T x T scores;
    - ``chunked``: `chunked_causal_attention` below, query chunks against only
      the key chunks at or before them (online softmax), ~half the FLOPs of
      the full matrix and O(T * chunk) live memory.

For every T and mode (forward; forward+backward w.r.t. params and input) one
row gives the median milliseconds of each, the speedup of NSA over the best
dense variant, and compiled memory (`memory_analysis()`: argument + output +
temp - alias bytes, i.e. what XLA planned, not a measured peak). A program whose
compiled memory exceeds the free memory of the device is compiled but not run.

Usage:
  python -m benchmarks.bench_attention [--seq-lens 2048,4096,8192] [--backward]
      [--dtype float32|bfloat16] [--iters 3] [--json out.json] [--plot out.png]

Defaults: on CPU T = 2048,4096,8192 forward only, float32 (XLA:CPU runs bf16
matmuls slower than fp32), ~5 minutes on 2 cores; longer T are flags
(`--seq-lens 16384,32768`, `--backward`). On GPU T = 2k..64k, forward and
backward, bfloat16.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (
    MiB,
    add_config_args,
    available_memory_bytes,
    compile_fn,
    fmt,
    fmt_mib,
    import_pyplot,
    log,
    on_gpu,
    parse_ints,
    print_header,
    print_table_header,
    short_error,
    time_compiled,
    write_json,
)
from nsa_jax.config import ModelConfig, load_config
from nsa_jax.kernels import cudnn_fits, plan_kernels
from nsa_jax.layers import rope
from nsa_jax.nsa.layer import NSAAttention
from nsa_jax.ops.memory import compiled_memory

GPU_SEQ_LENS = (2048, 4096, 8192, 16384, 32768, 65536)
CPU_SEQ_LENS = (2048, 4096, 8192)
NEG_INF = -1e30
# Share of the free device memory a program may plan to use before it is not run.
MEMORY_HEADROOM = 0.85


# ---------------------------------------------------------------------------
# dense baseline


def chunked_causal_attention(
    q_BxTxHxDk: jax.Array, k_BxTxKxDk: jax.Array, v_BxTxKxDv: jax.Array, chunk: int = 512
) -> jax.Array:
    """Causal GQA attention that skips the key blocks a query chunk cannot see.

    Static shapes throughout: T is padded to n = ceil(T / C) chunks of C. An outer
    `lax.map` walks the n query chunks; for chunk c an inner `lax.scan` walks all
    n key chunks j with an online softmax, and a `lax.switch` on (j, c) picks
    "skip" (j > c: fully masked), "full" (j < c: no mask needed) or "diagonal"
    (j == c: causal mask). A traced switch executes only the chosen branch, in
    the backward pass too, so ~n(n+1)/2 of the n^2 blocks are computed, without
    the dynamic trip counts (while loops) reverse-mode autodiff cannot handle,
    and without gathering a variable number of keys per chunk.

    Each query chunk is rematerialised (as in nsa_jax.kernels.xla), so the
    backward pass holds one chunk's C x T probabilities at a time, not T x T.
    Padded keys sit after every real query, so the causal mask hides them;
    padded queries are dropped.
    """
    B, T, H, Dk = q_BxTxHxDk.shape
    K, Dv = k_BxTxKxDk.shape[2], v_BxTxKxDv.shape[3]
    G = H // K
    scale = Dk**-0.5
    C = min(chunk, T)
    n = -(-T // C)
    pad = n * C - T

    def chunks(x):  # [B, T, ...] -> [n, B, C, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(B, n, C, *x.shape[2:]), 1, 0)

    q_nxBxCxKxGxD = chunks(q_BxTxHxDk).reshape(n, B, C, K, G, Dk)
    k_nxBxCxKxD = chunks(k_BxTxKxDk)
    v_nxBxCxKxD = chunks(v_BxTxKxDv)
    causal_CxC = jnp.arange(C)[None, :] <= jnp.arange(C)[:, None]

    def query_chunk(c, q_BxCxKxGxD):
        def attend(masked):
            def update(carry, k_BxCxKxD, v_BxCxKxD):
                m_BxKxGxC, l_BxKxGxC, acc_BxKxGxCxD = carry
                s = jnp.einsum("bckgd,bskd->bkgcs", q_BxCxKxGxD, k_BxCxKxD, preferred_element_type=jnp.float32)
                s = s * scale
                if masked:
                    s = jnp.where(causal_CxC, s, NEG_INF)
                m_new = jnp.maximum(m_BxKxGxC, jnp.max(s, axis=-1))
                p = jnp.exp(s - m_new[..., None])
                correction = jnp.exp(m_BxKxGxC - m_new)
                l_new = l_BxKxGxC * correction + jnp.sum(p, axis=-1)
                pv = jnp.einsum(
                    "bkgcs,bskd->bkgcd", p.astype(v_BxCxKxD.dtype), v_BxCxKxD, preferred_element_type=jnp.float32
                )
                return m_new, l_new, acc_BxKxGxCxD * correction[..., None] + pv

            return update

        def skip(carry, k_BxCxKxD, v_BxCxKxD):
            return carry

        def step(carry, j_k_v):
            j, k_BxCxKxD, v_BxCxKxD = j_k_v
            branch = jnp.where(j > c, 0, jnp.where(j < c, 1, 2))
            carry = jax.lax.switch(branch, [skip, attend(False), attend(True)], carry, k_BxCxKxD, v_BxCxKxD)
            return carry, None

        # Key chunk 0 is visible to every query (its own position at least for
        # c = 0), so m is finite after the first step and NEG_INF never meets NEG_INF.
        init = (
            jnp.full((B, K, G, C), NEG_INF, jnp.float32),
            jnp.zeros((B, K, G, C), jnp.float32),
            jnp.zeros((B, K, G, C, Dv), jnp.float32),
        )
        (_, l, acc), _ = jax.lax.scan(step, init, (jnp.arange(n), k_nxBxCxKxD, v_nxBxCxKxD))
        o_BxKxGxCxD = acc / l[..., None]
        return jnp.moveaxis(o_BxKxGxCxD, 3, 1).reshape(B, C, H, Dv).astype(q_BxTxHxDk.dtype)

    rematted = jax.checkpoint(query_chunk)
    o_nxBxCxHxD = jax.lax.map(lambda args: rematted(*args), (jnp.arange(n), q_nxBxCxKxGxD))
    return jnp.moveaxis(o_nxBxCxHxD, 0, 1).reshape(B, n * C, H, Dv)[:, :T]


def xla_causal_attention(q_BxTxHxDk, k_BxTxKxDk, v_BxTxKxDv):
    """Full causal attention through jax.nn.dot_product_attention's XLA path."""
    return jax.nn.dot_product_attention(q_BxTxHxDk, k_BxTxKxDk, v_BxTxKxDv, is_causal=True, implementation="xla")


class DenseAttention(nn.Module):
    """x[B, T, D] -> dense causal GQA attention [B, T, D]; NSA's Q/K/V/O shapes and RoPE."""

    cfg: ModelConfig
    impl: str = "xla"  # xla | chunked | cudnn (GPU: cuDNN's fused flash attention)
    chunk: int = 512

    @nn.compact
    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        cfg = self.cfg
        B, T, D = x_BxTxD.shape
        H, K, Dk, Dv = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.v_head_dim
        dtype = jnp.dtype(cfg.dtype)
        init = nn.initializers.normal(cfg.init_std)
        positions_T = jnp.arange(T, dtype=jnp.int32)

        def proj(name, heads, dim):
            y = nn.Dense(heads * dim, use_bias=False, dtype=dtype, kernel_init=init, name=name)(x_BxTxD)
            return y.reshape(B, T, heads, dim)

        q = rope(proj("q", H, Dk), positions_T, cfg.rope_theta)
        k = rope(proj("k", K, Dk), positions_T, cfg.rope_theta)
        v = proj("v", K, Dv)
        if self.impl == "xla":
            o = xla_causal_attention(q, k, v)
        elif self.impl == "cudnn":
            o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        else:
            o = chunked_causal_attention(q, k, v, self.chunk)
        o = o.astype(dtype).reshape(B, T, H * Dv)
        return nn.Dense(D, use_bias=False, dtype=dtype, kernel_init=init, name="o")(o)


def normal(shape, dtype, seed: int = 0) -> jax.Array:
    """Standard normal array drawn on the host: eager jax.random compiles one threefry kernel per shape."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32), dtype)


def check_chunked(chunk: int) -> float:
    """Max abs error of chunked vs dot_product_attention (output and grads) on a small case.

    T is not a multiple of the chunk, so padding, skipped, full and diagonal
    blocks are all exercised.
    """
    C = min(chunk, 16)
    T, H, K, D = 3 * C + C // 2, 4, 2, 8
    shapes = [(1, T, H, D), (1, T, K, D), (1, T, K, D), (1, T, H, D)]
    q, k, v, ct = (normal(shape, jnp.float32, seed) for seed, shape in enumerate(shapes))

    def out_and_grads(fn):
        o, vjp = jax.vjp(fn, q, k, v)
        return (o, *vjp(ct))

    @jax.jit
    def max_err():
        ref = out_and_grads(xla_causal_attention)
        got = out_and_grads(lambda q, k, v: chunked_causal_attention(q, k, v, C))
        return jnp.max(jnp.stack([jnp.max(jnp.abs(a - b)) for a, b in zip(ref, got)]))

    with jax.default_matmul_precision("highest"):
        return float(max_err())


# ---------------------------------------------------------------------------
# measurement


def random_params(module: nn.Module, x_BxTxD: jax.Array, std: float):
    """Parameters of `module`'s shapes drawn N(0, std^2) on the host.

    Run time does not depend on the values (every branch has static shapes and
    selects a fixed number of blocks). Shapes come from `init` under eval_shape
    and values from numpy, so nothing is compiled: a jitted `init` (threefry per
    leaf) compiles for longer on XLA:CPU than the layer itself.
    """
    shapes = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), x_BxTxD)["params"])
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda s: jnp.asarray(std * rng.standard_normal(s.shape, np.float32), s.dtype), shapes)


def layer_programs(module: nn.Module, backward: bool):
    """(fn, needs_cotangent): forward x -> y, or forward+backward -> grads of (params, x)."""

    def forward(p, x_BxTxD):
        return module.apply({"params": p}, x_BxTxD)

    if not backward:
        return forward, False

    def forward_backward(p, x_BxTxD, ct_BxTxD):
        _, vjp = jax.vjp(forward, p, x_BxTxD)
        return vjp(ct_BxTxD)

    return forward_backward, True


def measure(name, module, params, x, ct, backward, opts, free_bytes):
    """Compiles, reads compiled memory, and times (if it fits) one layer program."""
    fn, with_ct = layer_programs(module, backward)
    args = (params, x, ct) if with_ct else (params, x)
    out = {"ms": None, "min_ms": None, "cpu_ms": None, "n": 0, "compile_s": None, "mem": None, "note": None}
    try:
        compiled, lower_s, compile_s = compile_fn(fn, *args)
    except Exception as e:  # unsupported size, compile-time OOM, ...
        out["note"] = short_error(e)
        log(f"  {name}: compile failed: {out['note']}")
        return out
    out["compile_s"] = lower_s + compile_s
    out["mem"] = compiled_memory(compiled)
    need = (out["mem"] or {}).get("total")
    if free_bytes is not None and need is not None and need > MEMORY_HEADROOM * free_bytes:
        out["note"] = (
            f"not run: compiled memory {need / 2**30:.1f} GiB > {MEMORY_HEADROOM:.0%} "
            f"of free {free_bytes / 2**30:.1f} GiB"
        )
        log(f"  {name}: {out['note']}")
        return out
    try:
        t = time_compiled(compiled, args, opts.warmup, opts.iters, opts.max_seconds)
        out.update(ms=t["median_ms"], min_ms=t["min_ms"], cpu_ms=t["cpu_ms"], n=t["n"])
    except Exception as e:  # runtime out of memory
        out["note"] = short_error(e)
        log(f"  {name}: run failed: {out['note']}")
    return out


DENSE_VARIANTS = ("xla", "chunked", "cudnn")


def dense_choice(text: str | None, gpu: bool) -> list[str]:
    """The dense baselines `--dense` names (default: xla and chunked, plus cudnn on a GPU)."""
    if text is None:
        return ["xla", "chunked"] + (["cudnn"] if gpu else [])
    if text.strip() == "none":
        return []
    chosen = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in chosen if v not in DENSE_VARIANTS or (v == "cudnn" and not gpu)]
    if bad:
        raise SystemExit(
            f"error: --dense {bad[0]!r} is not one of {', '.join(DENSE_VARIANTS)} (cudnn needs a GPU) or 'none'"
        )
    return chosen


def device_peak_bytes() -> int | None:
    """peak_bytes_in_use of device 0 (None where the backend keeps no such count, as on a CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def run(opts) -> tuple[dict, list[dict]]:
    gpu = on_gpu()
    env = print_header("NSA layer vs dense causal attention layer (x[B,T,D] -> [B,T,D])")
    dtype = opts.dtype or ("bfloat16" if gpu else "float32")
    overrides = [f"model.dtype={dtype}", *opts.set]
    cfg = load_config(opts.config, overrides).model
    a = cfg.nsa
    seq_lens = parse_ints(opts.seq_lens) if opts.seq_lens else list(GPU_SEQ_LENS if gpu else CPU_SEQ_LENS)
    backward = opts.backward if opts.backward is not None else gpu
    modes = ["fwd"] + (["fwd+bwd"] if backward else [])
    backend = jax.default_backend()

    # The layer's own plan (NSAAttention without kernels: a training layer, so with a backward).
    def plan_at(model, T):
        return plan_kernels(model.nsa, T, backend, cudnn_ok=cudnn_fits(model)).describe()

    impl = plan_at(cfg, seq_lens[0])
    # On a GPU the strongest dense baseline is cuDNN's fused attention.
    dense_variants = dense_choice(opts.dense, gpu)
    print(
        f"config {opts.config}: D={cfg.d_model} H={cfg.n_heads} K={cfg.n_kv_heads} Dk={cfg.head_dim} "
        f"Dv={cfg.v_head_dim} | NSA l={a.l} d={a.d} lp={a.lp} n={a.n} w={a.w} branches={','.join(a.branches)} "
        f"kernels cmp/slc/win={impl['cmp']}/{impl['slc']}/{impl['win']} query_chunk={a.query_chunk}"
    )
    by_len = {T: (d["slc"].split("/")[-1], d["cmp"]) for T in seq_lens for d in [plan_at(cfg, T)]}
    if len(set(by_len.values())) > 1:
        print("selection / compressed kernels by T: " + ", ".join(f"{T} {s} / {c}" for T, (s, c) in by_len.items()))
    print(
        f"dtype {dtype}, batch {opts.batch}, warmup {opts.warmup}, median of {opts.iters} calls "
        f"(fewer once a program's timed calls pass {opts.max_seconds:g} s); "
        f"dense = fastest of xla (jax.nn.dot_product_attention), chunked (C={opts.dense_chunk})"
        + (" and cudnn (fused flash attention)" if gpu else "")
        + (f"; timed here: {', '.join(dense_variants) or 'none'}" if opts.dense else "")
    )
    if not gpu:
        print("CPU run: absolute times are host-bound and noisy; compare columns within a row.")

    check_err = check_chunked(opts.dense_chunk)
    print(f"chunked dense vs dot_product_attention (small case, out + grads): max abs err {check_err:.2e}")

    init_T = max(2 * a.lp, a.l)  # parameter shapes do not depend on T
    x0 = jnp.zeros((1, init_T, cfg.d_model), jnp.dtype(dtype))
    layers = {"nsa": NSAAttention(cfg)}
    params = {"nsa": random_params(layers["nsa"], x0, cfg.init_std)}
    # The same layer and parameters with other model.nsa settings (another kernel), timed in the same run.
    variant_kernels = {}
    for name, variant in opts.variant_cfgs.items():
        layers[name] = NSAAttention(variant)
        params[name] = params["nsa"]
        variant_kernels[name] = plan_at(variant, seq_lens[0])
        print(f"{name}: kernels cmp/slc/win=" + "/".join(variant_kernels[name][b] for b in ("cmp", "slc", "win")))
    dense_params = None
    for variant in dense_variants:
        layers[f"dense_{variant}"] = DenseAttention(cfg, impl=variant, chunk=opts.dense_chunk)
        if dense_params is None:  # one parameter tree for every dense variant
            dense_params = random_params(layers[f"dense_{variant}"], x0, cfg.init_std)
        params[f"dense_{variant}"] = dense_params

    rows = []
    for T in seq_lens:
        x = normal((opts.batch, T, cfg.d_model), dtype, seed=T)
        ct = normal((opts.batch, T, cfg.d_model), dtype, seed=T + 1)
        for mode in modes:
            row = {"seq": T, "mode": mode}
            for name, module in layers.items():
                log(f"T={T} {mode} {name} ...")
                res = measure(name, module, params[name], x, ct, mode == "fwd+bwd", opts, available_memory_bytes())
                row[f"{name}_ms"] = res["ms"]
                row[f"{name}_min_ms"] = res["min_ms"]
                row[f"{name}_cpu_ms"] = res["cpu_ms"]
                row[f"{name}_n_timed"] = res["n"]
                row[f"{name}_compile_s"] = res["compile_s"]
                row[f"{name}_mem"] = res["mem"]
                if res["note"]:
                    row[f"{name}_note"] = res["note"]
            # The device's high-water mark so far in this process (cumulative over rows: run one
            # T and mode alone, `--dense none`, for the peak of that program).
            row["device_peak_bytes"] = device_peak_bytes()
            for name in variant_names(opts.variants):
                best_dense = min((row[f"dense_{v}_ms"] for v in dense_variants if row[f"dense_{v}_ms"]), default=None)
                row[f"{name}_speedup_vs_dense"] = (
                    best_dense / row[f"{name}_ms"] if best_dense and row[f"{name}_ms"] else None
                )
            timed = {v: row[f"dense_{v}_ms"] for v in dense_variants if row[f"dense_{v}_ms"] is not None}
            best = min(timed, key=timed.get) if timed else None
            row["dense_best"] = best
            row["dense_ms"] = timed[best] if best else None
            row["speedup_nsa_vs_dense"] = row["dense_ms"] / row["nsa_ms"] if best and row["nsa_ms"] else None
            dense_cpu = row[f"dense_{best}_cpu_ms"] if best else None
            nsa_cpu = row["nsa_cpu_ms"]
            row["cpu_time_ratio_dense_vs_nsa"] = dense_cpu / nsa_cpu if dense_cpu and nsa_cpu else None
            nsa_mem = (row["nsa_mem"] or {}).get("total")
            dense_mem = (row[f"dense_{best}_mem"] or {}).get("total") if best else None
            row["dense_mem_total"] = dense_mem
            row["mem_ratio_dense_vs_nsa"] = dense_mem / nsa_mem if dense_mem and nsa_mem else None
            rows.append(row)
    meta = dict(
        env,
        config=opts.config,
        overrides=overrides,
        dtype=dtype,
        batch=opts.batch,
        warmup=opts.warmup,
        iters=opts.iters,
        max_seconds=opts.max_seconds,
        dense_chunk=opts.dense_chunk,
        kernels=impl,
        variant_kernels=variant_kernels,
        model=dict(
            d_model=cfg.d_model,
            n_heads=cfg.n_heads,
            n_kv_heads=cfg.n_kv_heads,
            head_dim=cfg.head_dim,
            v_head_dim=cfg.v_head_dim,
            l=a.l,
            d=a.d,
            lp=a.lp,
            n=a.n,
            w=a.w,
            branches=list(a.branches),
            query_chunk=a.query_chunk,
        ),
        chunked_check_max_abs_err=check_err,
        memory_note="compiled memory: argument + output + temp - alias bytes from memory_analysis()",
    )
    return meta, rows


# ---------------------------------------------------------------------------
# output


def print_table(rows: list[dict], show_cpu: bool) -> None:
    cpu_head = f" {'cpu d/n':>8}" if show_cpu else ""
    cudnn = any("dense_cudnn_ms" in r for r in rows)
    cudnn_head = f" {'cudnn ms':>9}" if cudnn else ""
    peak = any(r.get("device_peak_bytes") for r in rows)
    peak_head = f" {'peak MiB':>9}" if peak else ""
    header = (
        f"{'T':>6} {'mode':<7} {'nsa ms':>9} {'xla ms':>9} {'chunk ms':>9}{cudnn_head} {'dense':>7} {'dense/nsa':>9}"
        f"{cpu_head} "
        f"{'nsa MiB':>9} {'xla MiB':>9} {'chunk MiB':>9} {'mem d/n':>8}{peak_head}"
    )
    print_table_header(header)
    for r in rows:
        mem = lambda name: (r.get(f"{name}_mem") or {}).get("total")  # noqa: E731
        cpu = f" {fmt(r['cpu_time_ratio_dense_vs_nsa'], '{:7.2f}x', 8)}" if show_cpu else ""
        cudnn_cell = f" {fmt(r.get('dense_cudnn_ms'))}" if cudnn else ""
        print(
            f"{r['seq']:>6} {r['mode']:<7} {fmt(r['nsa_ms'])} {fmt(r.get('dense_xla_ms'))} "
            f"{fmt(r.get('dense_chunked_ms'))}{cudnn_cell} {r['dense_best'] or '-':>7} "
            f"{fmt(r['speedup_nsa_vs_dense'], '{:8.2f}x')}{cpu} {fmt_mib(mem('nsa'))} {fmt_mib(mem('dense_xla'))} "
            f"{fmt_mib(mem('dense_chunked'))} {fmt(r['mem_ratio_dense_vs_nsa'], '{:7.2f}x', 8)}"
            + (f" {fmt_mib(r.get('device_peak_bytes'))}" if peak else "")
        )
    print(
        "ms = median wall time; dense = the fastest dense variant (xla | chunked | cudnn); dense/nsa > 1: NSA is faster"
        + ("; cpu d/n = the same ratio in process CPU time (less sensitive to other jobs)" if show_cpu else "")
        + ".\nMiB = compiled memory (argument + output + temp - alias), not a measured peak; "
        "mem d/n = dense (winner) / NSA."
        + ("\npeak MiB = the device's measured high-water mark so far in this process (cumulative)." if peak else "")
    )
    notes = sorted({(k[: -len("_note")], r["seq"], r["mode"], r[k]) for r in rows for k in r if k.endswith("_note")})
    for name, T, mode, note in notes:
        print(f"  T={T} {mode} {name}: {note}")


def variant_names(variants: list[str]) -> list[str]:
    """The row names of `--variants`: nsa[KEY=VALUE,...]."""
    return [f"nsa[{v}]" for v in variants]


def variant_configs(opts, overrides: list[str]) -> dict:
    """{row name: ModelConfig} of each `--variants` entry: the config with its model.nsa settings on top;
    a bad key or value exits with one line naming the variant."""
    cfgs = {}
    for name, variant in zip(variant_names(opts.variants), opts.variants):
        try:
            cfgs[name] = load_config(opts.config, [*overrides, *(f"model.nsa.{kv}" for kv in variant.split(","))]).model
        except (ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"error: --variants {variant!r}: {e}") from None
    return cfgs


def print_variants(rows: list[dict], variants: list[str]) -> None:
    """The layer with each other model.nsa setting, beside the config's (`nsa`), timed in the same run."""
    names = variant_names(variants)
    width = max(14, *(len(n) + 3 for n in names))
    header = f"{'T':>6} {'mode':<7} {'nsa ms':>9} " + " ".join(f"{n + ' ms':>{width}} {'dense/x':>8}" for n in names)
    print_table_header(header)
    for r in rows:
        cells = " ".join(
            f"{fmt(r.get(f'{n}_ms'), '{:' + str(width) + '.2f}', width)} "
            f"{fmt(r.get(f'{n}_speedup_vs_dense'), '{:7.2f}x', 8)}"
            for n in names
        )
        print(f"{r['seq']:>6} {r['mode']:<7} {fmt(r['nsa_ms'])} {cells}")


def plot(rows: list[dict], meta: dict, path: str) -> None:
    plt = import_pyplot()
    if plt is None:
        return
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {"fwd": "-", "fwd+bwd": "--"}
    colors = {"nsa": "C0", "dense_xla": "C1", "dense_chunked": "C2", "dense_cudnn": "C3"}
    for mode, ls in styles.items():
        sub = [r for r in rows if r["mode"] == mode]
        if not sub:
            continue
        for name, color in colors.items():
            pts = [(r["seq"], r[f"{name}_ms"]) for r in sub if r.get(f"{name}_ms") is not None]
            if pts:
                ax_t.plot(*zip(*pts), ls, marker="o", color=color, label=f"{name} {mode}")
            pts = [(r["seq"], r[f"{name}_mem"]["total"] / MiB) for r in sub if r.get(f"{name}_mem")]
            if pts:
                ax_m.plot(*zip(*pts), ls, marker="o", color=color, label=f"{name} {mode}")
    for ax, ylabel in ((ax_t, "median time (ms)"), (ax_m, "compiled memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(
        f"NSA vs dense attention layer: {meta['device']} ({meta['backend']}), {meta['dtype']}, B={meta['batch']}"
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_args(parser, "a100_pcie")
    parser.add_argument(
        "--seq-lens",
        default=None,
        help="comma-separated T (2k, 64k accepted); default: "
        f"{','.join(map(str, CPU_SEQ_LENS))} on CPU, {','.join(map(str, GPU_SEQ_LENS))} on GPU",
    )
    parser.add_argument(
        "--backward",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time forward+backward (default: on GPU only)",
    )
    parser.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16"),
        help="compute dtype (default: bfloat16 on GPU, float32 on CPU)",
    )
    parser.add_argument(
        "--variants",
        default="",
        help="NSA layers to time beside the config's in the same run, ';' between variants, each ','-separated "
        "model.nsa KEY=VALUE settings, e.g. 'compressed_kernel=cudnn;selection_kernel=blocksparse' "
        "(rows nsa[KEY=VALUE,...])",
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=20.0,
        help="stop timing a program once its timed calls add up to this (at least one call)",
    )
    parser.add_argument("--dense-chunk", type=int, default=512, help="query/key chunk of the chunked dense baseline")
    parser.add_argument(
        "--dense",
        default=None,
        help="comma-separated dense baselines to time, of xla, chunked, cudnn (GPU only); 'none' times NSA alone "
        "(default: all that run here)",
    )
    parser.add_argument("--plot", default=None, help="write a time / memory plot to this PNG (needs matplotlib)")
    opts = parser.parse_args(argv)
    opts.dtype = opts.dtype or ("bfloat16" if on_gpu() else "float32")
    opts.variants = [v.strip().replace(" ", "") for v in opts.variants.split(";") if v.strip()]
    # Checked at the run's dtype before anything is timed; run() builds these layers.
    opts.variant_cfgs = variant_configs(opts, [f"model.dtype={opts.dtype}", *opts.set])
    meta, rows = run(opts)
    print_table(rows, show_cpu=meta["backend"] == "cpu")
    if opts.variants:
        print_variants(rows, opts.variants)
    write_json(opts.json, meta, rows)
    if opts.plot:
        plot(rows, meta, opts.plot)


if __name__ == "__main__":
    main()
