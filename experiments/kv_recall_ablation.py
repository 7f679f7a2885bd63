"""Does the selection branch learn what the window cannot reach?

Trains the same model on the `kv_recall` task (every queried key sits more than
w tokens before its query; by default the pairs sit at a random offset, so the
selection branch has to find their block) with different NSA branch sets, side by
side in one run, and prints the retrieval accuracy of each on held-out rows,
every --eval-every steps and at the end:

    python -m experiments.kv_recall_ablation --steps 600
    python -m experiments.kv_recall_ablation --variants cmp,slc,win:cmp,win --json out.json
    python -m experiments.kv_recall_ablation --variants "cmp,slc,win:win;model.nsa.w=512" --data-window 64

A variant is a branch set, optionally followed by `;key=value` overrides of its own
(the second example adds a full-attention control: one window branch wider than the
row). --data-window fixes the window the rows are laid out for (default: each
variant's model.nsa.w), so every variant sees the same rows.

The chance level is 1 / (number of keys). The full NSA model should clearly beat
the model without the selection branch. The validation rows are the same for every
variant (the `val` split of the same seed).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

from benchmarks.common import add_config_args
from nsa_jax.config import load_config
from nsa_jax.data import make_dataset
from nsa_jax.data.kv_recall import retrieval_counts, vocab_layout
from nsa_jax.mesh import make_mesh, put_batch
from nsa_jax.model import NSALM
from nsa_jax.step import step as S


def score(apply, params, val_batches: list[np.ndarray], vocab_size: int) -> float:
    hits = total = 0
    for tokens_BxT1 in val_batches:
        preds_BxT = np.asarray(apply(params, tokens_BxT1[:, :-1]))
        h, n = retrieval_counts(preds_BxT, tokens_BxT1, vocab_size)
        hits, total = hits + h, total + n
    return hits / max(total, 1)


def train_and_score(cfg, eval_batches: int, eval_every: int, label: str, data_cfg=None) -> dict:
    """Trains `cfg`'s model on the rows of `data_cfg` (default cfg) and scores it every eval_every steps."""
    data_cfg = cfg if data_cfg is None else data_cfg
    mesh = make_mesh(cfg)
    plan = S.make_plan(cfg, mesh)
    state, train_step = S.create_state(plan), S.make_train_step(plan)
    ds = make_dataset(data_cfg, "train")
    val = make_dataset(data_cfg, "val")
    val_batches = [next(val) for _ in range(eval_batches)]
    apply = jax.jit(lambda p, t: NSALM(cfg.model).apply({"params": p}, t).argmax(-1))

    t0 = time.time()
    losses, curve = [], []
    for step in range(1, cfg.train.steps + 1):
        tokens = np.stack([next(ds) for _ in range(cfg.train.accumulate)])
        state, metrics = train_step(state, put_batch(tokens, mesh))
        losses.append(float(metrics["loss"]))
        if step % eval_every == 0 or step == cfg.train.steps:
            acc = score(apply, state.params, val_batches, cfg.model.vocab_size)
            curve.append((step, acc))
            print(
                f"  [{label}] step {step:5d}  loss {np.mean(losses[-eval_every:]):.3f}  "
                f"retrieval accuracy {acc:.3f}  ({time.time() - t0:.0f}s)",
                flush=True,
            )
    return {
        "branches": ",".join(cfg.model.nsa.branches),
        "accuracy": curve[-1][1],
        "curve": curve,
        "answers": int(sum(b.shape[0] for b in val_batches) * cfg.data.kv_queries),
        "loss_first": losses[0],
        "loss_last": float(np.mean(losses[-10:])),
        "train_s": time.time() - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(ap, "cpu_tiny", dest="overrides")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument(
        "--variants",
        default="cmp,slc,win:cmp,win",
        help="branch sets separated by ':', each optionally with ';key=value' overrides",
    )
    ap.add_argument(
        "--data-window",
        type=int,
        default=None,
        help="lay the rows out for this window (default: each variant's model.nsa.w)",
    )
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--eval-every", type=int, default=100)
    args = ap.parse_args()

    rows = []
    base = ["data.dataset=kv_recall", f"train.steps={args.steps}", *args.overrides]
    for variant in args.variants.split(":"):
        branches, *extra = variant.split(";")
        cfg = load_config(args.config, [*base, f"model.nsa.branches={branches}", *extra])
        data_cfg = None
        if args.data_window is not None:
            data_cfg = load_config(args.config, [*base, f"model.nsa.w={args.data_window}"])
        label = variant.replace(";", " ")
        rows.append({**train_and_score(cfg, args.eval_batches, args.eval_every, label, data_cfg), "variant": label})
    n_keys = vocab_layout(cfg.model.vocab_size, cfg.data.kv_format)[0]
    print(
        f"kv_recall on {args.config}: {args.steps} steps, seq_len {cfg.train.seq_len}, "
        f"rows laid out for w {args.data_window or cfg.model.nsa.w}, "
        f"{cfg.data.kv_pairs} pairs, {cfg.data.kv_queries} queries, placement {cfg.data.kv_placement}, "
        f"format {cfg.data.kv_format}, "
        f"{rows[0]['answers']} held-out answers; chance {1 / n_keys:.3f}"
    )
    width = max(12, *(len(r["variant"]) for r in rows))
    print(f"{'variant':<{width}} {'accuracy':>9} {'final loss':>11} {'train s':>8}")
    for r in rows:
        print(f"{r['variant']:<{width}} {r['accuracy']:>9.3f} {r['loss_last']:>11.3f} {r['train_s']:>8.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "config": args.config,
                    "overrides": args.overrides,
                    "steps": args.steps,
                    "chance": 1 / n_keys,
                    "rows": rows,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
