"""Where block selection fails on kv_recall: the selection branch's own attention vs the block scorer.

Trains one variant (experiments.compare's config, overrides and rows) for --steps
steps, then on one held-out batch, for every answer whose queried pair lies in a free
block (not block 0 nor the two local blocks, which are always selected), per layer:

  pair-token mass   the selection branch's attention on the pair token if it saw every
                    earlier key (its queries against all causal selection keys; mean over
                    the group's heads): has the branch learned the lookup?
  target on block   that attention summed per block over the free blocks, renormalised:
                    the share on the pair's block (the scorer distillation's target)
  scorer on block   the compressed block scores (Eq. 9-10) over the free blocks,
                    renormalised: the share on the pair's block
  scorer top-1      how often the pair's block has the highest free score (with one free
                    slot, n = 4 here, this is the selection recall over free blocks)
  uniform           1 / number of free blocks, the chance level of the last two

    python -m experiments.selection_diagnosis $(KV_BASE of docs/EXPERIMENTS.md) --steps 600 \\
        --set model.nsa.gate_bias_init=-2,2,-2 --set train.scorer_distill=1.0
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import add_config_args
from experiments.compare import make_evaluator, pair_positions
from nsa_jax.config import ConfigError, load_config
from nsa_jax.data import make_dataset
from nsa_jax.mesh import make_mesh, put_batch
from nsa_jax.model import NSALM
from nsa_jax.nsa import layer as nsa_layer
from nsa_jax.step import step as S


def free_blocks(t: int, lp: int) -> list[int]:
    return list(range(1, t // lp - 1))


def diagnose(q_BxTxHxD, kc_BxTcxKxD, k_BxTxKxD, qpos_BxQ, tpos_BxQ, *, l: int, d: int, lp: int) -> dict[str, float]:
    """The module docstring's measures (float64 loops) for one layer."""
    q, kc, k = (np.asarray(x, np.float64) for x in (q_BxTxHxD, kc_BxTcxKxD, k_BxTxKxD))
    B, T, H, Dk = q.shape
    Tc, K = kc.shape[1], kc.shape[2]
    G, Nb, scale = H // K, -(-T // lp), Dk**-0.5
    rows = {"pair-token mass": [], "target on block": [], "scorer on block": [], "scorer top-1": [], "uniform": []}
    for b in range(B):
        for t, p in zip(qpos_BxQ[b], tpos_BxQ[b]):
            free = free_blocks(int(t), lp)
            if p < 0 or p // lp not in free:
                continue
            for kv in range(K):
                target, scorer, mass = np.zeros(Nb), np.zeros(Nb), 0.0
                for h in range(kv * G, (kv + 1) * G):
                    s = q[b, t, h] @ k[b, : t + 1, kv].T * scale
                    pr = np.exp(s - s.max())
                    pr /= pr.sum()
                    mass += pr[p] / G
                    np.add.at(target, np.arange(t + 1) // lp, pr / G)
                    vis = np.array([i for i in range(Tc) if i * d + l - 1 <= t])
                    c = kc[b, vis, kv] @ q[b, t, h] * scale
                    pc = np.exp(c - c.max())
                    pc /= pc.sum()
                    for i, pi in zip(vis, pc):
                        for j in range(Nb):
                            if i * d < (j + 1) * lp and i * d + l > j * lp:
                                scorer[j] += pi
                tf = target[free] / target[free].sum()
                sf = scorer[free] / scorer[free].sum()
                at = free.index(p // lp)
                rows["pair-token mass"].append(mass)
                rows["target on block"].append(tf[at])
                rows["scorer on block"].append(sf[at])
                rows["scorer top-1"].append(float(np.argmax(sf) == at))
                rows["uniform"].append(1.0 / len(free))
    out = {key: float(np.mean(v)) if v else float("nan") for key, v in rows.items()}
    return out | {"answers": len(rows["uniform"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(ap, "cpu_tiny", dest="overrides", json=False)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--eval-batches", type=int, default=4)
    args = ap.parse_args()
    common = [*args.overrides, f"train.steps={args.steps}", f"train.seed={args.seed}"]
    try:
        cfg = load_config(args.config, common)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    if cfg.data.dataset != "kv_recall" or "slc" not in cfg.model.nsa.branches or not cfg.model.scan_layers:
        raise SystemExit("error: needs data.dataset=kv_recall, a selection branch and model.scan_layers=true")
    mesh = make_mesh(cfg)
    plan = S.make_plan(cfg, mesh)
    state, train_step = S.create_state(plan), S.make_train_step(plan)
    ds, val = make_dataset(cfg, "train"), make_dataset(cfg, "val")
    val_batches = [np.asarray(next(val)) for _ in range(args.eval_batches)]
    evaluate = make_evaluator(cfg, val_batches)
    t0 = time.time()
    for step in range(1, args.steps + 1):
        tokens = np.stack([next(ds) for _ in range(cfg.train.accumulate)])
        state, _ = train_step(state, put_batch(tokens, mesh))
        if step % max(args.steps // 4, 1) == 0 or step == args.steps:
            ev = evaluate(state.params, step)
            took = time.time() - t0
            print(f"step {step} accuracy {ev['accuracy']:.3f} sel_recall {ev['sel_recall']:.3f} ({took:.0f}s)")

    # The layer's q, compressed keys and selection keys, caught where the distillation reads them.
    caught = []
    a = cfg.model.nsa
    original = nsa_layer.score_distill_kl

    def catch(q, kc, k, **kw):
        jax.debug.callback(lambda *xs: caught.append([np.asarray(x) for x in xs]), q, kc, k)
        return original(q, kc, k, **kw)

    nsa_layer.score_distill_kl = catch
    try:
        tokens = val_batches[0]
        # A mutable `losses` collection asks the layers for the distillation (nsa/layer.py).
        NSALM(cfg.model).apply({"params": state.params}, jnp.asarray(tokens[:, :-1]), mutable=["losses"])
        jax.effects_barrier()
    finally:
        nsa_layer.score_distill_kl = original
    qpos, tpos = pair_positions(tokens, cfg.model.vocab_size, cfg.data.kv_format)
    print(f"\nstep {args.steps}, seed {args.seed}, one held-out batch; free blocks only (see the docstring)")
    for i, (q, kc, k) in enumerate(caught):
        res = diagnose(q, kc, k, qpos, tpos, l=a.l, d=a.d, lp=a.lp)
        cells = [f"{key} {v:.3f}" if key != "answers" else f"{key} {v}" for key, v in res.items()]
        print(f"layer {i}: " + "; ".join(cells))


if __name__ == "__main__":
    main()
