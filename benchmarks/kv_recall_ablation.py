"""Does the selection branch learn what the window cannot reach?

Trains the same model on the `kv_recall` task (every queried key sits more than
w tokens before its query) with different NSA branch sets, side by side in one
run, and prints the retrieval accuracy of each on held-out rows:

    python benchmarks/kv_recall_ablation.py --steps 300
    python benchmarks/kv_recall_ablation.py --variants cmp,slc,win:cmp,win --json out.json

The chance level is 1 / (number of keys). The full NSA model should clearly beat
the model without the selection branch.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

from nsa_jax.config import load_config
from nsa_jax.data import make_dataset
from nsa_jax.data.kv_recall import answer_mask_from_tokens, vocab_layout
from nsa_jax.model import NSALM
from nsa_jax.train import step as S


def train_and_score(cfg, eval_batches: int) -> dict:
    mesh = S.make_mesh(cfg)
    state = S.create_state(cfg, mesh)
    train_step = S.make_train_step(cfg, mesh)
    ds = make_dataset(cfg, "train")
    t0 = time.time()
    losses = []
    for _ in range(cfg.train.steps):
        tokens = np.stack([next(ds) for _ in range(cfg.train.accumulate)])
        state, metrics = train_step(state, S.put_batch(tokens, mesh))
        losses.append(float(metrics["loss"]))
    train_s = time.time() - t0

    apply = jax.jit(lambda p, t: NSALM(cfg.model).apply({"params": p}, t))
    val = make_dataset(cfg, "val")
    hits = total = 0
    for _ in range(eval_batches):
        tokens_BxT1 = next(val)
        preds = np.asarray(apply(state.params, tokens_BxT1[:, :-1]).argmax(-1))
        mask = answer_mask_from_tokens(tokens_BxT1, cfg.model.vocab_size)
        hits += int(((preds == tokens_BxT1[:, 1:]) & mask).sum())
        total += int(mask.sum())
    return {
        "branches": ",".join(cfg.model.nsa.branches),
        "accuracy": hits / max(total, 1),
        "answers": total,
        "loss_first": losses[0],
        "loss_last": float(np.mean(losses[-10:])),
        "train_s": train_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="cpu_tiny")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--variants", default="cmp,slc,win:cmp,win", help="branch sets separated by ':'")
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--json")
    args = ap.parse_args()

    rows = []
    for branches in args.variants.split(":"):
        cfg = load_config(
            args.config,
            ["data.dataset=kv_recall", f"train.steps={args.steps}", f"model.nsa.branches={branches}", *args.overrides],
        )
        rows.append(train_and_score(cfg, args.eval_batches))
        r = rows[-1]
        print(
            f"  {r['branches']:<12} accuracy {r['accuracy']:.3f} over {r['answers']} answers | "
            f"loss {r['loss_first']:.3f} -> {r['loss_last']:.3f} | {r['train_s']:.0f}s",
            flush=True,
        )
    n_keys = vocab_layout(cfg.model.vocab_size)[0]
    print(
        f"kv_recall, {args.config}, {args.steps} steps, seq_len {cfg.train.seq_len}, w {cfg.model.nsa.w}; "
        f"chance {1 / n_keys:.3f}"
    )
    print(f"{'branches':<12} {'accuracy':>9} {'final loss':>11}")
    for r in rows:
        print(f"{r['branches']:<12} {r['accuracy']:>9.3f} {r['loss_last']:>11.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "steps": args.steps, "chance": 1 / n_keys, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
