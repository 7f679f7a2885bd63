"""Does the selection find the needle? Per layer and KV head, on the needle suite's own rows.

For each checkpoint, builds the rows `launch.evaluate --suites needle` scores at length
L (the same text, depths, samples and seed: nsa_jax.evaluation.suites.needle_rows), runs
the model's forward with the selection's block indices sown, and prints

  exact      greedy exact match of the key, per depth (the needle suite's figure)
  selected   per layer x KV head: the share of answer queries (the positions that
             predict the key's digits) whose selected blocks include a block holding a
             digit of the key (either of the needle's two copies)

A model can fail with the block found (it does not read the key from it) or without
(the compressed scores never rank the needle's block high enough): this tells which.

    python -m experiments.needle_selection --ckpt RUN/checkpoints/1700 [--ckpt ...] \\
        --length 1024 --text README.md docs/NSA.md
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

from nsa_jax.data import make_tokenizer
from nsa_jax.data.needle import NeedleRow, answer_mask, needle_pieces
from nsa_jax.evaluation.scoring import answer_scores
from nsa_jax.evaluation.suites import DEFAULT_DEPTHS, TextRows, needle_rows
from nsa_jax.inference.decode import inference_config
from nsa_jax.model import NSALM, per_layer
from nsa_jax.rundir.checkpoint import load_for_inference
from nsa_jax.rundir.resume import CheckpointError


def key_blocks(row: NeedleRow, tokenizer, lp: int) -> set[int]:
    """Selection blocks (of lp tokens) holding a token of the pass key inside the needle."""
    needle, _, key = needle_pieces(tokenizer, row.value)
    starts = [i for i in range(len(needle) - len(key) + 1) if np.array_equal(needle[i : i + len(key)], key)]
    return {(row.needle_pos + s + j) // lp for s in starts for j in range(len(key))}


def selected_share(idx_LxTxKxN: np.ndarray, qpos_Q: np.ndarray, blocks: set[int]) -> np.ndarray:
    """[layers, K]: the share of queries qpos whose selected blocks (-1 = unused slot) meet `blocks`."""
    sel_LxQxKxN = idx_LxTxKxN[:, qpos_Q]
    return np.isin(sel_LxQxKxN, sorted(blocks)).any(-1).mean(1)


def block_indices(state: dict, cfg) -> np.ndarray:
    """The sown `block_idx` as [rows, layers, T, K, N]."""
    idx_LxBxTxKxN = per_layer(state, "intermediates", "block_idx", cfg.model)
    if idx_LxBxTxKxN is None:
        raise SystemExit("error: the model sows no block_idx (model.nsa.branches has no slc)")
    return np.moveaxis(np.asarray(idx_LxBxTxKxN), 0, 1)


def diagnose(path: str, length: int, text: list[str], samples: int, seed: int, batch: int) -> None:
    cfg, params = load_for_inference(path)
    tok = make_tokenizer(cfg.data)
    built = needle_rows(TextRows(cfg, text), tok, length, DEFAULT_DEPTHS, samples, seed)
    apply = jax.jit(lambda p, t: NSALM(inference_config(cfg.model)).apply({"params": p}, t, mutable=["intermediates"]))
    exact, shares = [], []
    for start in range(0, len(built), batch):
        rows = [r for _, _, r in built[start : start + batch]]
        tokens_BxT1 = np.stack([r.tokens_T1 for r in rows])
        logits_BxTxV, state = apply(params, tokens_BxT1[:, :-1])
        target_BxT = tokens_BxT1[:, 1:]
        logp_BxTxV = np.asarray(jax.nn.log_softmax(logits_BxTxV.astype(np.float32)))
        nll_BxT = -np.take_along_axis(logp_BxTxV, target_BxT[..., None], -1)[..., 0]
        answer_BxT = np.stack([answer_mask(r) for r in rows])
        # Scored as the needle suite scores (greedy: every answer target is the argmax).
        exact.extend(answer_scores(nll_BxT, logp_BxTxV.argmax(-1) == target_BxT, answer_BxT)[1])
        idx = block_indices(state, cfg)
        for b, r in enumerate(rows):
            qpos_Q = np.flatnonzero(answer_BxT[b])
            shares.append(selected_share(idx[b], qpos_Q, key_blocks(r, tok, cfg.model.nsa.lp)))
    d_N = np.array([d for d, _, _ in built])
    exact_N, share_NxLxK = np.array(exact), np.stack(shares)
    a = cfg.model.nsa
    print(f"{path}: L={length}, lp={a.lp}, n={a.n}, {samples} needles per depth")
    print("  exact by depth:  " + " ".join(f"{exact_N[d_N == d].mean():.2f}" for d in range(len(DEFAULT_DEPTHS))))
    heads = f"KV heads 0..{cfg.model.n_kv_heads - 1}"
    print(f"  exact mean {exact_N.mean():.2f}; needle block selected at the answer queries ({heads}):")
    for layer, row in enumerate(share_NxLxK.mean(0)):
        print(f"    layer {layer}: " + " ".join(f"{s:.2f}" for s in row))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", action="append", required=True, help="a run folder or one checkpoint in it; repeatable")
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--text", nargs="+", required=True, help="held-out text files (as launch.evaluate --text)")
    p.add_argument("--samples", type=int, default=16, help="needles per depth (16, as the recipe evaluates)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=4)
    args = p.parse_args()
    for path in args.ckpt:
        try:
            diagnose(path, args.length, args.text, args.samples, args.seed, args.batch_size)
        except CheckpointError as e:
            raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
