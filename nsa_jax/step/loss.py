"""The training loss of one micro-batch, on the rows one device holds (nsa_jax/step/rows.py).

`Loss.part` is what every strategy differentiates: the model's next-token loss on this
device's part of a micro-batch's rows (all of them without context parallelism; its
positions of each row with it), as its share of the micro-batch's weighted mean (the
denominator is the whole micro-batch's), plus the layers' statistics as sums.
`Loss.finish` turns the sums of a whole micro-batch (added over `seq` first under context
parallelism) into the logged statistics. At one device `loss_and_stats` is the two in a
row, from tokens.

The loss is the weighted mean next-token loss (data/targets.py row_targets) of
`phase.model`, plus `phase.distill` times the layers' mean block-scorer KL, which the
layers compute only because the `losses` collection is mutable then. With
train.scorer_distill on, stats carry `ce` (the next-token loss alone) and `distill_kl`
in every phase (0 in one without it). With logging.aux_stats, stats carry what
nsa/stats.aux_stats makes of the sums the layers sow in `aux`: gate_mean [L, 3],
gate_entropy, sel_far_frac, cmp_k_ratio, cmp_v_ratio [L].
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from nsa_jax.config import Config
from nsa_jax.kernels import KernelPlan
from nsa_jax.model import NSALM, cast_dense_kernels, per_layer, rows_nll
from nsa_jax.nsa.stats import aux_stats
from nsa_jax.step import schedule
from nsa_jax.step.rows import Rows, denominators, lay_out_rows


@dataclasses.dataclass(frozen=True)
class Loss:
    """The loss of `phase` (default: cfg.model, train.scorer_distill at every step) with `kernels`
    (None: the layers' default for jax's backend; under context parallelism it carries the
    sequence layout the rows were laid out by)."""

    cfg: Config
    phase: schedule.Phase | None = None
    kernels: KernelPlan | None = None
    layer_gather: Callable | None = None  # fsdp: a layer's parameter slices -> whole (model.NSALM)

    def __post_init__(self):
        if self.phase is None:
            cfg = self.cfg
            object.__setattr__(self, "phase", schedule.Phase(0, cfg.model, schedule.scorer_distill(cfg)))

    def part(self, params, rows: Rows, denom: jax.Array) -> tuple[jax.Array, dict]:
        """(this device's share of the micro-batch's loss, its statistics' sums) for rows [b, L] of one
        group (rope [L] or None) and the group's denominator."""
        cfg, phase = self.cfg, self.phase
        params = cast_dense_kernels(params, phase.model.dtype)
        mutable = [c for c, on in (("aux", cfg.logging.aux_stats), ("losses", phase.distill)) if on]
        model = NSALM(phase.model, kernels=self.kernels, layer_gather=self.layer_gather)
        chunk = cfg.train.loss_chunk
        out, variables = model.apply(
            {"params": params}, rows.inputs, rope_positions_T=rows.rope, head=not chunk, mutable=mutable
        )
        nll, _ = rows_nll(phase.model, params, out, rows.targets, chunk)
        loss = jnp.sum(nll * rows.weights) / denom
        sums = {"aux": per_layer(variables, "aux", "stat_sums", cfg.model) or {}}
        if schedule.scorer_distill(cfg):
            kl_L = per_layer(variables, "losses", "scorer_kl", cfg.model)
            kl = jnp.mean(kl_L) if phase.distill else jnp.zeros((), jnp.float32)
            sums.update(ce=loss, distill_kl=kl)
            loss = loss + phase.distill * kl
        return loss, sums

    def finish(self, sums: dict) -> dict:
        """The statistics of a micro-batch from the sums of all its rows' parts."""
        stats = aux_stats(sums["aux"], self.phase.model) if sums["aux"] else {}
        return {**stats, **{k: v for k, v in sums.items() if k != "aux"}}

    def of_batch(self, params, batch_BxT1) -> tuple[jax.Array, dict]:
        """(loss, stats) of a whole micro-batch (tokens or LabeledRows) on one device (no layout)."""
        rows = lay_out_rows(batch_BxT1, self.cfg, None, rope_positions=self.cfg.train.rope_positions)
        loss, sums = self.part(params, rows, denominators(rows))
        return loss, self.finish(sums)


def loss_and_stats(
    params, batch_BxT1, *, cfg: Config, phase: schedule.Phase | None = None, kernels=None
) -> tuple[jax.Array, dict]:
    """Loss and statistics of one micro-batch [B, T+1] (tokens or LabeledRows) on one device (Loss.of_batch)."""
    return Loss(cfg, phase, kernels).of_batch(params, batch_BxT1)
