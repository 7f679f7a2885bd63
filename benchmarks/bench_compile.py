"""Compile time and compiled memory of the training step, by remat and layer-scan setting.

For a config (default `a100_pcie`, T = train.seq_len = 2048) and each
combination of `model.remat` (none, full) and `model.scan_layers` (true, false),
this lowers and compiles one optimizer step: value_and_grad of the next-token
cross-entropy of `NSALM(cfg.model)` over the `train.accumulate` micro-batches,
then the AdamW update. It reports

* lower and compile wall seconds (tracing + StableHLO, then XLA),
* the size of the lowered StableHLO text (program size; grows with depth when
  layers are unrolled, stays flat with `nn.scan`),
* `compiled.memory_analysis()`: argument, output, alias, temp and generated
  code bytes, and total = argument + output + temp - alias (what XLA planned for
  one device; the state is donated, so its buffers are reused for the output).

Nothing is allocated or run: parameters, optimizer state and batch are
`jax.ShapeDtypeStruct`s from `jax.eval_shape`. The step is
`nsa_jax.step.step.make_train_step` (data-parallel shard_map over a mesh of
`--devices` devices, donated state), or with `--step minimal` a minimal
equivalent built here.

Compilation targets the local backend: on a CPU host that is XLA:CPU with the
XLA attention kernels (`attention_impl: auto` picks Pallas only on GPU), so the
seconds and bytes describe that target; the scan-vs-unrolled and remat trends
are what carries over.

Usage:
  python -m benchmarks.bench_compile [--config a100_pcie] [--seq-len 2048]
      [--remat none,full] [--scan true,false] [--n-layers 2,12] [--json out.json]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import optax

from benchmarks.common import (
    add_config_args,
    config_meta,
    fmt,
    fmt_mib,
    log,
    parse_ints,
    print_header,
    print_table_header,
    short_error,
    write_json,
)
from nsa_jax.config import Config, load_config
from nsa_jax.kernels import cudnn_fits, plan_kernels
from nsa_jax.model import NSALM, cross_entropy, init_params
from nsa_jax.ops.memory import compiled_memory
from nsa_jax.tools.aot import train_step_args


def project_step(cfg: Config, n_devices: int):
    """(jitted step, abstract args) from nsa_jax.train, on the first `n_devices` local devices."""
    return train_step_args(cfg, jax.devices()[:n_devices])


def minimal_step(cfg: Config):
    """A single-device stand-in for the project step: accumulate grads over micro-batches, AdamW."""
    model = NSALM(cfg.model)
    t = cfg.train
    tx = optax.chain(
        optax.clip_by_global_norm(t.grad_clip) if t.grad_clip > 0 else optax.identity(),
        optax.adamw(t.lr, b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay),
    )

    def loss_fn(params, tokens_BxT1):
        logits_BxTxV = model.apply({"params": params}, tokens_BxT1[:, :-1])
        return cross_entropy(logits_BxTxV, tokens_BxT1[:, 1:])

    def step(params, opt_state, tokens_AxBxT1):
        def micro(carry, tokens_BxT1):
            loss, grads = jax.value_and_grad(loss_fn)(params, tokens_BxT1)
            return jax.tree.map(jnp.add, carry, (loss, grads)), None

        zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
        (loss, grads), _ = jax.lax.scan(micro, zeros, tokens_AxBxT1)
        A = tokens_AxBxT1.shape[0]
        grads = jax.tree.map(lambda g: g / A, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss / A

    params = jax.eval_shape(lambda: init_params(cfg.model, jax.random.PRNGKey(0), 2 * cfg.model.nsa.lp))
    opt_state = jax.eval_shape(tx.init, params)
    tokens_AxBxT1 = jax.ShapeDtypeStruct((t.accumulate, t.global_batch, t.seq_len + 1), jnp.int32)
    return jax.jit(step, donate_argnums=(0, 1)), (params, opt_state, tokens_AxBxT1)


def measure(cfg: Config, step_kind: str, n_devices: int) -> dict:
    used = "minimal" if step_kind == "minimal" else "project"  # auto: the project step
    step, args = minimal_step(cfg) if used == "minimal" else project_step(cfg, n_devices)
    t0 = time.perf_counter()
    lowered = step.lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    mem = compiled_memory(compiled)
    n_params = sum(int(x.size) for x in jax.tree.leaves(args[0].params if used == "project" else args[0]))
    return {
        "step": used,
        "lower_s": t1 - t0,
        "compile_s": t2 - t1,
        "total_s": t2 - t0,
        "stablehlo_kib": len(lowered.as_text()) / 1024,
        "n_params": n_params,
        "mem": mem,
    }


def parse_bools(text: str) -> list[bool]:
    table = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}
    return [table[s.strip().lower()] for s in text.split(",") if s.strip()]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_args(parser, "a100_pcie")
    parser.add_argument("--seq-len", type=int, default=2048, help="train.seq_len to compile for")
    parser.add_argument("--remat", default="none,full", help="model.remat values to compare")
    parser.add_argument("--scan", default="true,false", help="model.scan_layers values to compare")
    parser.add_argument("--n-layers", default=None, help="model.n_layers values (default: the config's)")
    parser.add_argument("--devices", type=int, default=1, help="devices on the data mesh (project step only)")
    parser.add_argument(
        "--step",
        default="auto",
        choices=("auto", "project", "minimal"),
        help="project (and auto) = nsa_jax.step.step.make_train_step; minimal = a step built here",
    )
    opts = parser.parse_args(argv)

    # Persistent-cache hits would time a cache read, not a compilation.
    jax.config.update("jax_enable_compilation_cache", False)
    env = print_header("Train-step compile time and compiled memory (nothing allocated, nothing run)")
    base = load_config(opts.config, [f"train.seq_len={opts.seq_len}", *opts.set])
    depths = parse_ints(opts.n_layers) if opts.n_layers else [base.model.n_layers]
    m, t = base.model, base.train
    impl = plan_kernels(m.nsa, t.seq_len, jax.default_backend(), cudnn_ok=cudnn_fits(m)).describe()
    print(
        f"config {opts.config}: L={m.n_layers} D={m.d_model} H={m.n_heads} K={m.n_kv_heads} F={m.d_ff} "
        f"V={m.vocab_size} dtype={m.dtype} | T={t.seq_len} micro-batch B={t.global_batch} "
        f"x accumulate A={t.accumulate} "
        f"on {opts.devices} device(s) | kernels slc/win={impl['slc']}/{impl['win']}"
    )

    rows = []
    for L in depths:
        for remat in [s.strip() for s in opts.remat.split(",") if s.strip()]:
            for scan in parse_bools(opts.scan):
                overrides = [f"model.n_layers={L}", f"model.remat={remat}", f"model.scan_layers={str(scan).lower()}"]
                cfg = load_config(opts.config, [f"train.seq_len={opts.seq_len}", *opts.set, *overrides])
                row = {"n_layers": L, "remat": remat, "scan_layers": scan}
                log(f"L={L} remat={remat} scan_layers={scan} ...")
                try:
                    row.update(measure(cfg, opts.step, opts.devices))
                except SystemExit:
                    raise
                except Exception as e:  # report and go on with the other variants
                    row["error"] = short_error(e)
                    log(f"  failed: {row['error']}")
                rows.append(row)

    header = (
        f"{'L':>3} {'remat':<5} {'scan':<5} {'lower s':>8} {'compile s':>9} {'total s':>8} {'HLO KiB':>8} "
        f"{'arg MiB':>9} {'out MiB':>9} {'alias MiB':>9} {'temp MiB':>9} {'code MiB':>9} {'total MiB':>9}"
    )
    print_table_header(header)
    for r in rows:
        mem = r.get("mem") or {}
        print(
            f"{r['n_layers']:>3} {r['remat']:<5} {str(r['scan_layers']).lower():<5} "
            f"{fmt(r.get('lower_s'), '{:8.2f}', 8)} {fmt(r.get('compile_s'))} {fmt(r.get('total_s'), '{:8.2f}', 8)} "
            f"{fmt(r.get('stablehlo_kib'), '{:8.0f}', 8)} "
            + " ".join(fmt_mib(mem.get(k)) for k in ("argument", "output", "alias", "temp", "generated_code", "total"))
            + (f"  {r['error']}" if "error" in r else "")
        )
    steps = sorted({r["step"] for r in rows if "step" in r})
    print(
        f"step: {', '.join(steps) or '-'}; total MiB = argument + output + temp - alias (compiled plan, one device). "
        "Compile seconds are single measurements on a shared host."
    )
    meta = dict(
        env,
        **config_meta(opts.config, opts.set, t),
        devices=opts.devices,
        kernels=impl,
        memory_note="compiled memory from memory_analysis(); total = argument + output + temp - alias",
    )
    write_json(opts.json, meta, rows)


if __name__ == "__main__":
    main()
