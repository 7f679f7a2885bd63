"""Block scorers tried through a whole model before any kernel is written for them.

A scorer's figures that matter (the held-out loss by position, the pass key, the needle's share
on selected blocks) come from the project's own commands, `launch.evaluate` and
`experiments.needle_selection`. This runs either with the XLA path's `minmax` scorer
(kernels/scorers.py `select_minmax_xla`) swapped for a trial scorer, so a rule is measured end to
end before it earns a config value, a Pallas kernel and a decode cache:

  ceiling   the n blocks of most mass of the selection branch's full attention: each head's
            softmax over every earlier key summed per block and averaged over the KV group's
            heads (nsa/distill.py `full_block_mass`), the forced blocks forced, as
            experiments/selection_recall.py's "best n". No scorer, trained or training-free,
            chooses better blocks at that n: what it misses is the budget's.
  lse:S     each block's sub-blocks of S keys pooled to their mean key; a head's score of a
            block the log-sum-exp of its sub-blocks' logits (the block's attention mass if
            every key were its sub-block's mean), then minmax's softmax over complete blocks,
            summed over the group's heads. S = lp is one mean key a block; smaller S keeps
            more of a block's peak for T/S key columns.
  rescore:M two stages: the compressed scorer's (cmp's) best M blocks, then among them the n of
            most mass of each head's softmax over those M blocks' keys alone, summed over the
            group's heads: exact within the candidates, M x lp keys a query whatever T is.

XLA only (a CPU run): the ceiling costs the full attention's T x T scores, so it is a
measurement, not a setting.

    python -m experiments.scorer_trial ceiling evaluate --ckpt MODEL --suites text --text FILE --lengths 8192 ...
    python -m experiments.scorer_trial lse:8 needle_selection --ckpt MODEL --suite passkey --length 8192 ...

Every argument after the command goes to launch.evaluate or experiments.needle_selection, with
`--set model.nsa.scorer=minmax --set model.nsa.scorer_sub=S` added (S = 1 for the ceiling;
rescore runs as `mix`, whose XLA path hands cmp's block scores to the selection).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

import nsa_jax.kernels
from experiments import needle_selection
from launch import evaluate
from nsa_jax.kernels import scorers
from nsa_jax.kernels.xla import map_query_chunks, masked_softmax, select_blocks
from nsa_jax.nsa.distill import full_block_mass

COMMANDS = ("evaluate", "needle_selection")


def ceiling_block_scores(q_BxCxHxDk, kmin, kmax_BxSxKxDk, t_C, *, lp: int, sub: int, scale: float):
    """[B, C, K, Nb] fp32 (minmax_block_scores' contract): the full attention's mass per block."""
    if sub != 1:
        raise ValueError(f"the ceiling reads every key: model.nsa.scorer_sub must be 1, got {sub}")
    del kmin  # with one key a sub-block, its minimum and its maximum are the key
    return full_block_mass(q_BxCxHxDk, kmax_BxSxKxDk, t_C, lp=lp, scale=scale)


def sub_block_means(k_BxTxKxDk, lp: int, sub: int, num_blocks: int | None = None):
    """(mean, mean) [B, Nb * lp / sub, K, Dk] in fp32 (key_bounds' contract): each sub-block's mean key."""
    B, T, K, Dk = k_BxTxKxDk.shape
    n_blocks = -(-T // lp) if num_blocks is None else num_blocks
    k = jnp.pad(k_BxTxKxDk.astype(jnp.float32), [(0, 0), (0, n_blocks * lp - T), (0, 0), (0, 0)])
    mean = k.reshape(B, n_blocks * lp // sub, sub, K, Dk).mean(axis=2)
    return mean, mean


def lse_block_logits(qg_BxCxKxGxDk, kmin_BxSxKxDk, kmax_BxSxKxDk, lp: int, sub: int, scale: float):
    """[B, C, K, G, Nb] fp32 (bound_block_logits' contract): the log-sum-exp of a block's sub-block logits."""
    del kmin_BxSxKxDk  # the mean key (sub_block_means gives it twice)
    s = jnp.einsum("bckgd,bskd->bckgs", qg_BxCxKxGxDk.astype(jnp.float32), kmax_BxSxKxDk) * scale
    return jax.nn.logsumexp(s.reshape(*s.shape[:-1], s.shape[-1] // (lp // sub), lp // sub), axis=-1)


def rescore_select(m: int):
    """select_minmax_xla's contract for the `mix` call (plus_scores: cmp's block scores [B, T, K, Nb]):
    cmp's best m blocks, re-ranked by each head's softmax over their keys, summed over the group."""

    def select(q_BxTxHxDk, k_BxTxKxDk, *, lp, n, sub, plus_scores=None, q_offset=0, num_blocks=None, **_):
        del sub
        if plus_scores is None:
            raise ValueError("rescore reads cmp's block scores: it runs as model.nsa.scorer=mix")
        B, T, H, Dk = q_BxTxHxDk.shape
        K = k_BxTxKxDk.shape[2]
        n_blocks = -(-k_BxTxKxDk.shape[1] // lp) if num_blocks is None else num_blocks
        k = jnp.pad(k_BxTxKxDk, [(0, 0), (0, n_blocks * lp - k_BxTxKxDk.shape[1]), (0, 0), (0, 0)])
        k = jax.lax.stop_gradient(k).astype(jnp.float32)
        j_Nb = jnp.arange(n_blocks, dtype=jnp.int32)

        def body(start, q_c, cmp_c):
            t_C = start + q_offset + jnp.arange(q_c.shape[1], dtype=jnp.int32)
            cand = select_blocks(cmp_c, lp, m, t_C)  # [B, C, K, m]
            in_cand = jnp.any(cand[..., None] == j_Nb, axis=-2)  # [B, C, K, Nb]
            qg = jax.lax.stop_gradient(q_c).astype(jnp.float32).reshape(B, -1, K, H // K, Dk)
            s = jnp.einsum("bckgd,btkd->bckgt", qg, k) * Dk**-0.5
            pos = jnp.arange(n_blocks * lp, dtype=jnp.int32)
            vis = (pos[None, :] <= t_C[:, None])[None, :, None, None, :] & jnp.repeat(in_cand, lp, axis=-1)[
                :, :, :, None
            ]
            p = masked_softmax(s, vis)
            mass = p.reshape(*p.shape[:-1], n_blocks, lp).sum(-1).sum(axis=3)  # [B, C, K, Nb]
            return select_blocks(jnp.where(in_cand, mass, -1.0), lp, n, t_C)

        return map_query_chunks(body, 256, q_BxTxHxDk, plus_scores)

    return select


def install(trial: str) -> int:
    """Swaps the minmax scorer's pieces for `trial`'s; returns the scorer_sub the run must set."""
    name, _, sub = trial.partition(":")
    if name == "ceiling" and not sub:
        scorers.minmax_block_scores = ceiling_block_scores  # select_minmax_xla reads it from the module
        return 1
    if name == "lse" and sub.isdigit() and int(sub) >= 1:
        scorers.key_bounds, scorers.bound_block_logits = sub_block_means, lse_block_logits
        return int(sub)
    if name == "rescore" and sub.isdigit() and int(sub) >= 1:
        nsa_jax.kernels.select_minmax_xla = rescore_select(int(sub))  # what BranchCalls.blocks calls
        return 0
    raise SystemExit(
        f"error: trial scorer {trial!r}: use ceiling, lse:S (S keys a sub-block, dividing lp) or rescore:M"
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[1] not in COMMANDS:
        raise SystemExit(f"usage: python -m experiments.scorer_trial ceiling|lse:S {{{','.join(COMMANDS)}}} ARGS ...")
    sub = install(argv[0])
    run = evaluate.main if argv[1] == "evaluate" else needle_selection.main
    sets = ["model.nsa.scorer=mix"] if argv[0].startswith("rescore") else ["model.nsa.scorer=minmax"]
    sets.append(f"model.nsa.scorer_sub={sub}")
    return run(argv[2:] + [a for kv in sets for a in ("--set", kv)]) or 0


if __name__ == "__main__":
    raise SystemExit(main())
