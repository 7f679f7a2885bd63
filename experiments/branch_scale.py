"""How large each branch's keys and values grow during training.

Why it matters: docs/EXPERIMENTS.md "Why the MLP compressor fails on retrieval".

Trains one config (experiments.compare's base config, overrides and rows) and, at
step 0 and at --at steps, prints the root mean square of every key/value tensor the NSA
layers feed their branches, over one held-out batch and all layers:

  cmp_k, cmp_v   the compressed keys and values (the output of phi, model.nsa.cmp_phi)
  k_slc, v_slc   the selection keys and values (projections)
  k_win, v_win   the window keys and values (projections)

A branch whose values grow far beyond the others' dominates the gated sum and, after
the next RMSNorm, hides the other branches' signal. Any dataset works:

    python -m experiments.branch_scale $(KV_BASE of docs/EXPERIMENTS.md) --seed 2 \\
        --set model.nsa.branches=cmp,slc --set model.nsa.n=8 --at 25,50,100,200,300
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict

from benchmarks.common import add_config_args
from nsa_jax.config import ConfigError, load_config
from nsa_jax.data import make_dataset
from nsa_jax.mesh import make_mesh, put_batch
from nsa_jax.model import NSALM
from nsa_jax.step import step as S

# The branch tensors measured (docs above): the compressors' outputs, and the selection
# and window keys and values (the projections of the attention input, before RoPE, which
# rotates pairs and leaves the RMS as it is).
COMPRESSED = ("cmp_k", "cmp_v")
PROJECTED = ("k_slc", "v_slc", "k_win", "v_win")
TENSORS = COMPRESSED + PROJECTED


def tensor_rms(model: NSALM, params, tokens_BxT: jax.Array) -> dict[str, jax.Array]:
    """RMS of every TENSORS tensor over the batch and all layers.

    The compressors' outputs are caught by flax; the projections are recomputed from
    each layer's caught attention input and its kernels (the layer multiplies by all of
    them at once, layers.fused_dense, so no module returns one alone).
    """
    keep = ("attn_norm", *COMPRESSED)
    _, state = model.apply(
        {"params": params},
        tokens_BxT,
        capture_intermediates=lambda m, method: method == "__call__" and m.name in keep,
        mutable=["intermediates"],
    )
    sums: dict[str, list[jax.Array]] = {}

    def add(name, x):
        x = x.astype(jnp.float32)
        sums.setdefault(name, []).append(jnp.mean(x * x))

    for path, value in flatten_dict(state["intermediates"]).items():
        # Paths end in (..., module name, "__call__"); the value is a one-element tuple.
        if path[-1] != "__call__":
            continue
        if path[-2] in COMPRESSED:
            add(path[-2], value[0])
        elif path[-2] == "attn_norm":  # (block, "attn_norm"): that block's attention input
            h = value[0].astype(jnp.float32)  # [L, B, T, D] in a layer scan, [B, T, D] per layer
            attn = params
            for key in (*path[:-2], "attn"):
                attn = attn[key]
            for name in PROJECTED:
                kernel = attn[name]["kernel"].astype(jnp.float32)
                add(name, jnp.einsum("...btd,...dn->...btn", h, kernel))
    return {name: jnp.sqrt(jnp.mean(jnp.stack(v))) for name, v in sums.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(ap, "cpu_tiny", dest="overrides", json=False)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--at", default="25,50,100,200,300", help="steps to measure at (comma list); step 0 always")
    # Accepted so that the harness's base flags can be passed as they are; the run ends at max(--at).
    for flag in ("--steps", "--eval-every", "--eval-batches"):
        ap.add_argument(flag, type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    try:
        at = sorted({int(s) for s in args.at.split(",") if s.strip()})
    except ValueError:
        raise SystemExit(f"error: --at {args.at!r} must be a comma list of step numbers, e.g. 25,50,100") from None
    if not at or at[0] < 1:
        raise SystemExit(f"error: --at {args.at!r} must name steps >= 1")
    try:
        cfg = load_config(args.config, [*args.overrides, f"train.steps={at[-1]}", f"train.seed={args.seed}"])
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    mesh = make_mesh(cfg)
    plan = S.make_plan(cfg, mesh)
    state, train_step = S.create_state(plan), S.make_train_step(plan)
    ds = make_dataset(cfg, "train")
    tokens = jnp.asarray(np.asarray(next(make_dataset(cfg, "val")))[:, :-1])
    model = NSALM(cfg.model)
    measure = jax.jit(lambda params: tensor_rms(model, params, tokens))
    print(f"branches {','.join(cfg.model.nsa.branches)}, cmp_phi {cfg.model.nsa.cmp_phi}, seed {args.seed}")
    print("RMS over one held-out batch and all layers")
    t0 = time.time()

    def report(step):
        rms = {k: float(v) for k, v in measure(state.params).items()}
        cells = "  ".join(f"{k} {rms[k]:8.3f}" for k in TENSORS if k in rms)
        print(f"step {step:5d}  {cells}  ({time.time() - t0:.0f}s)", flush=True)

    report(0)
    for step in range(1, at[-1] + 1):
        batch = np.stack([next(ds) for _ in range(cfg.train.accumulate)])
        state, _ = train_step(state, put_batch(batch, mesh))
        if step in at:
            report(step)


if __name__ == "__main__":
    main()
