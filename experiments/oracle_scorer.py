"""What any block scorer could reach: a model run whose blocks are chosen by the full attention's mass.

The ceiling of block selection at a given n is the n blocks that hold most of the selection
branch's attention with every earlier key visible (experiments/selection_recall.py's "best n").
This runs a whole model with those blocks, so the loss, the pass key and the needle shares of
the ceiling can be read with the project's own commands: no scorer, trained or training-free,
can choose better blocks at that n, so what the ceiling misses is the budget's, not the scorer's.

How: the `minmax` scorer with sub-blocks of one key (`model.nsa.scorer_sub=1`) keeps every
selection key (a sub-block's minimum and maximum are the key); its block scores are replaced by
`nsa/distill.py full_block_mass`, each head's softmax over every earlier key summed per block
and averaged over the KV group's heads, so `select_blocks` keeps the forced blocks (0, previous,
current) and the n - 3 free ones of most mass: selection_recall's "best n". XLA path only (a CPU
run); the full attention's scores cost T x T per head, so this is a measurement, not a setting.

    python -m experiments.oracle_scorer evaluate --ckpt MODEL --suites text --text FILE --lengths 8192 ...
    python -m experiments.oracle_scorer needle_selection --ckpt MODEL --suite passkey --length 8192 ...

Every argument after the command goes to launch.evaluate or experiments.needle_selection, with
`--set model.nsa.scorer=minmax --set model.nsa.scorer_sub=1` added.
"""

from __future__ import annotations

import sys

from experiments import needle_selection
from launch import evaluate
from nsa_jax.kernels import scorers
from nsa_jax.nsa.distill import full_block_mass

ORACLE_SETS = ["--set", "model.nsa.scorer=minmax", "--set", "model.nsa.scorer_sub=1"]


def ceiling_block_scores(q_BxCxHxDk, kmin, kmax_BxSxKxDk, t_C, *, lp: int, sub: int, scale: float):
    """[B, C, K, Nb] fp32 (minmax_block_scores' contract): the full attention's mass per block."""
    if sub != 1:
        raise ValueError(f"the ceiling reads every key: model.nsa.scorer_sub must be 1, got {sub}")
    del kmin  # with one key a sub-block, its minimum and its maximum are the key
    return full_block_mass(q_BxCxHxDk, kmax_BxSxKxDk, t_C, lp=lp, scale=scale)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = ("evaluate", "needle_selection")
    if not argv or argv[0] not in commands:
        raise SystemExit(f"usage: python -m experiments.oracle_scorer {{{','.join(commands)}}} ARGS ...")
    scorers.minmax_block_scores = ceiling_block_scores  # select_minmax_xla reads it from the module
    run = evaluate.main if argv[0] == "evaluate" else needle_selection.main
    return run(argv[1:] + ORACLE_SETS) or 0


if __name__ == "__main__":
    raise SystemExit(main())
