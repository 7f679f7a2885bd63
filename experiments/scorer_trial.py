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

XLA only (a CPU run): the ceiling costs the full attention's T x T scores, so it is a
measurement, not a setting.

    python -m experiments.scorer_trial ceiling evaluate --ckpt MODEL --suites text --text FILE --lengths 8192 ...
    python -m experiments.scorer_trial lse:8 needle_selection --ckpt MODEL --suite passkey --length 8192 ...

Every argument after the command goes to launch.evaluate or experiments.needle_selection, with
`--set model.nsa.scorer=minmax --set model.nsa.scorer_sub=S` added (S = 1 for the ceiling).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from experiments import needle_selection
from launch import evaluate
from nsa_jax.kernels import scorers
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


def install(trial: str) -> int:
    """Swaps the minmax scorer's pieces for `trial`'s; returns the scorer_sub the run must set."""
    name, _, sub = trial.partition(":")
    if name == "ceiling" and not sub:
        scorers.minmax_block_scores = ceiling_block_scores  # select_minmax_xla reads it from the module
        return 1
    if name == "lse" and sub.isdigit() and int(sub) >= 1:
        scorers.key_bounds, scorers.bound_block_logits = sub_block_means, lse_block_logits
        return int(sub)
    raise SystemExit(f"error: trial scorer {trial!r}: use ceiling or lse:S (S keys a sub-block, dividing lp)")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[1] not in COMMANDS:
        raise SystemExit(f"usage: python -m experiments.scorer_trial ceiling|lse:S {{{','.join(COMMANDS)}}} ARGS ...")
    sub = install(argv[0])
    run = evaluate.main if argv[1] == "evaluate" else needle_selection.main
    return run(argv[2:] + ["--set", "model.nsa.scorer=minmax", "--set", f"model.nsa.scorer_sub={sub}"]) or 0


if __name__ == "__main__":
    raise SystemExit(main())
