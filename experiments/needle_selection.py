"""Does the selection find the needle? Per layer and KV group, on the needle or passkey suite's rows.

For a checkpoint, builds the rows `launch.evaluate --suites needle` (or `passkey`, the
pretrained model's grid) scores at length L (the same text, depths, samples and seed:
nsa_jax.evaluation.suites.needle_rows), runs the model's forward with the selection's
block indices and inputs sown, and prints, at the answer queries (the positions that
predict the key's tokens):

  exact      greedy exact match of the key and its log-probability, per depth (the
             suite's figures)
  selected   per layer x KV group: the share of answer queries whose selected blocks
             include a block holding a token of the key (either of the needle's two copies)
  mass       per layer: the share of the selection branch's full attention (its queries
             against every earlier selection key, softmax per head, mean over the group's
             heads) on the needle sentence, mean and largest over queries, rows and groups
  on sel.    the share of that mass on the blocks the layer selected (weighted by the mass),
             and the share of (query, row, group) whose needle mass lies wholly (> 0.99) on them

A model can fail with the block found (it does not read the key from it) or without (the
compressed scores never rank the needle's block high enough): `selected` tells which. A layer
with needle mass and little of it on selected blocks looks at the key and loses it to its block
scorer; more blocks (model.nsa.n) or a better scorer would keep it.

    python -m experiments.needle_selection --ckpt RUN/checkpoints/1700 [--ckpt ...] \\
        --length 1024 --text README.md docs/NSA.md
    python -m experiments.needle_selection --ckpt MODEL_FOLDER --suite passkey --length 8192 \\
        --text FILE --depths 0.1,0.5,0.9 --samples 1 --seed 1 --batch-size 1 [--set model.nsa.n=32] [--json OUT]
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from nsa_jax.config import replace
from nsa_jax.data import make_tokenizer
from nsa_jax.data.needle import NeedleRow, answer_mask, needle_pieces
from nsa_jax.evaluation.scorer import scored_chunks
from nsa_jax.evaluation.scoring import answer_scores
from nsa_jax.evaluation.suites import DEFAULT_DEPTHS, ROW_EXTRA, TextRows, needle_rows
from nsa_jax.inference.decode import inference_config
from nsa_jax.model import NSALM, per_layer
from nsa_jax.rundir.model_dir import load_model
from nsa_jax.rundir.resume import CheckpointError

WHOLE = 0.99  # a query's needle mass counts as wholly selected above this share


def key_blocks(row: NeedleRow, tokenizer, lp: int) -> set[int]:
    """Selection blocks (of lp tokens) holding a token of the pass key inside the needle."""
    needle, _, key = needle_pieces(tokenizer, row.value)
    starts = [i for i in range(len(needle) - len(key) + 1) if np.array_equal(needle[i : i + len(key)], key)]
    return {(row.needle_pos + s + j) // lp for s in starts for j in range(len(key))}


def selected_share(idx_LxTxKxN: np.ndarray, qpos_Q: np.ndarray, blocks: set[int]) -> np.ndarray:
    """[layers, K]: the share of queries qpos whose selected blocks (-1 = unused slot) meet `blocks`."""
    sel_LxQxKxN = idx_LxTxKxN[:, qpos_Q]
    return np.isin(sel_LxQxKxN, sorted(blocks)).any(-1).mean(1)


@jax.jit
def _needle_mass(q_QxHxD, k_TxKxD, idx_QxKxN, qpos_Q, needle_T, lp):
    Q, H, D = q_QxHxD.shape
    T, K, _ = k_TxKxD.shape
    q = q_QxHxD.astype(jnp.float32).reshape(Q, K, H // K, D)
    s = jnp.einsum("qkgd,tkd->qkgt", q, k_TxKxD.astype(jnp.float32)) * D**-0.5
    t_T = jnp.arange(T)
    s = jnp.where(t_T <= qpos_Q[:, None, None, None], s, -jnp.inf)
    on_needle = jnp.where(needle_T, jax.nn.softmax(s, axis=-1).mean(2), 0.0)  # [Q, K, T]
    selected = jnp.any(idx_QxKxN[..., None] == t_T // lp, axis=-2)
    return on_needle.sum(-1), jnp.where(selected, on_needle, 0.0).sum(-1)


def needle_mass(q_QxHxD, k_TxKxD, idx_QxKxN, qpos_Q, needle_T, *, lp: int) -> tuple[np.ndarray, np.ndarray]:
    """(mass, on_selected), each [Q, K]: the full attention's mass on the needle tokens (`needle_T`
    bool [T]) of the queries at positions `qpos_Q`, and the part of it on their selected blocks."""
    got = _needle_mass(*(jnp.asarray(x) for x in (q_QxHxD, k_TxKxD, idx_QxKxN, qpos_Q, needle_T)), lp)
    return tuple(np.asarray(x, np.float64) for x in got)


def summarise(mass: np.ndarray, on_selected: np.ndarray) -> dict:
    """One layer's mass figures (the module docstring) over every query, row and group."""
    return {
        "mass": float(mass.mean()),
        "max_mass": float(mass.max()),
        "on_selected": float(on_selected.sum() / max(mass.sum(), 1e-12)),
        "wholly": float(np.mean(on_selected > WHOLE * mass)),
    }


def diagnose(path: str, args: argparse.Namespace) -> dict:
    cfg, params = load_model(path)
    if args.set:
        cfg = replace(cfg, args.set)
    a = cfg.model.nsa
    if cfg.model.attention != "nsa" or "slc" not in a.branches:
        raise SystemExit(f"error: {path}: the model has no selection branch (model.nsa.branches without slc)")
    tok = make_tokenizer(cfg.data)
    L, depths = args.length, args.depths
    built = needle_rows(TextRows(cfg, args.text), tok, L, depths, args.samples, args.seed, ROW_EXTRA[args.suite])
    icfg = inference_config(cfg.model)

    @jax.jit
    def forward(p, tokens_BxT1):  # the suite's scores (nll, greedy hit) and what the layers sowed
        x_BxTxD, state = NSALM(icfg).apply(
            {"params": p}, tokens_BxT1[:, :-1], head=False, mutable=["intermediates", "scorer_inputs"]
        )
        return scored_chunks(icfg, p, x_BxTxD, tokens_BxT1[:, 1:]), state

    exact, logp, shares, masses = [], [], [], []
    for start in range(0, len(built), args.batch_size):
        rows = [r for _, _, r in built[start : start + args.batch_size]]
        tokens_BxT1 = np.stack([r.tokens_T1 for r in rows])
        (nll_BxT, hit_BxT), state = forward(params, tokens_BxT1)
        answer_BxT = np.stack([answer_mask(r) for r in rows])
        # Scored as the suites score (greedy: every answer target is the argmax).
        lp_B, exact_B = answer_scores(np.asarray(nll_BxT), np.asarray(hit_BxT), answer_BxT)
        exact.extend(exact_B)
        logp.extend(lp_B)
        idx = per_layer(state, "intermediates", "block_idx", cfg.model)  # [layers, B, T, K, N]
        q, k = (per_layer(state, "scorer_inputs", n, cfg.model) for n in ("queries", "selection_keys"))
        for b, r in enumerate(rows):
            qpos_Q = np.flatnonzero(answer_BxT[b])
            shares.append(selected_share(np.asarray(idx[:, b]), qpos_Q, key_blocks(r, tok, a.lp)))
            needle_T = np.zeros(answer_BxT.shape[1], bool)
            needle_T[r.needle_pos : r.needle_pos + len(needle_pieces(tok, r.value)[0])] = True
            masses.append(
                [
                    needle_mass(q[i, b, qpos_Q], k[i, b], idx[i, b, qpos_Q], qpos_Q, needle_T, lp=a.lp)
                    for i in range(len(q))
                ]
            )
    d_N = np.array([d for d, _, _ in built])
    exact_N, logp_N = np.array(exact), np.array(logp)
    mass_NxLxQxK = np.array([[m for m, _ in row] for row in masses])
    on_sel_NxLxQxK = np.array([[o for _, o in row] for row in masses])
    return dict(
        checkpoint=path,
        suite=args.suite,
        length=L,
        lp=a.lp,
        n=a.n,
        samples=args.samples,
        seed=args.seed,
        depths=list(depths),
        exact=[float(exact_N[d_N == d].mean()) for d in range(len(depths))],
        logprob=[float(logp_N[d_N == d].mean()) for d in range(len(depths))],
        layers=[
            {"selected": share.tolist(), **summarise(mass_NxLxQxK[:, i], on_sel_NxLxQxK[:, i])}
            for i, share in enumerate(np.stack(shares).mean(0))
        ],
    )


def print_report(res: dict, n_kv: int) -> None:
    print(f"{res['checkpoint']}: {res['suite']} L={res['length']}, lp={res['lp']}, n={res['n']}, ", end="")
    print(f"{res['samples']} keys per depth, seed {res['seed']}")
    print("  exact by depth:  " + " ".join(f"{e:.2f}" for e in res["exact"]))
    print("  log p(answer) by depth:  " + " ".join(f"{x:.2f}" for x in res["logprob"]))
    print(
        f"  at the answer queries, per layer: key block selected (KV groups 0..{n_kv - 1}) | the full attention's "
        "mass on the needle, mean (max) | share of it on selected blocks | wholly selected"
    )
    for layer, r in enumerate(res["layers"]):
        print(
            f"    layer {layer}: "
            + " ".join(f"{s:.2f}" for s in r["selected"])
            + f" | {r['mass']:.3f} ({r['max_mass']:.3f}) | {r['on_selected']:.2f} | {r['wholly']:.2f}"
        )


def _depths(text: str) -> list[float]:
    try:
        depths = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give numbers in [0, 1] joined by commas") from None
    if not all(0.0 <= d <= 1.0 for d in depths):
        raise argparse.ArgumentTypeError(f"{text!r}: every depth lies in [0, 1]")
    return depths


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--ckpt",
        action="append",
        required=True,
        help="a model folder, a run folder or one checkpoint in it; repeatable",
    )
    p.add_argument("--suite", choices=("needle", "passkey"), default="needle", help="whose rows (default needle)")
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--text", nargs="+", required=True, help="held-out text files (as launch.evaluate --text)")
    p.add_argument("--depths", type=_depths, default=list(DEFAULT_DEPTHS), help="needle depths (default 0,0.1,..,1)")
    p.add_argument("--samples", type=int, default=16, help="needles per depth (16, as the recipe evaluates)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config override, e.g. model.nsa.n=32"
    )
    p.add_argument("--json", default=None, help="write the figures of every checkpoint to this JSON file")
    args = p.parse_args(argv)
    if args.samples < 1 or args.batch_size < 1:
        p.error("--samples and --batch-size must be >= 1")
    results = []
    for path in args.ckpt:
        try:
            res = diagnose(path, args)
        except (CheckpointError, ValueError, OSError) as e:
            raise SystemExit(f"error: {path}: {e}") from None
        print_report(res, len(res["layers"][0]["selected"]))
        results.append(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
