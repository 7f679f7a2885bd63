"""A finished step's metrics as the run records them: the training.csv row, TensorBoard scalars, warnings.

Pure functions of the step's metrics on the host (`jax.device_get` of the train step's
output: loss, lr, grad_norm, skipped, and with logging.aux_stats the per-layer gate and
scale statistics); the loop (loop.py) writes what they return. Column names are
nsa_jax/rundir/files.py's.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from nsa_jax.rundir.files import BRANCHES, CMP_SCALE_WARN, SCALE_COLUMNS
from nsa_jax.words import count

# TensorBoard `train/...` scalars of every step, from its training.csv row.
TRAIN_SCALARS = ("loss", "lr", "grad_norm", "toks_per_s", "step_time_s")


def aux_means(m: dict[str, Any]) -> dict[str, float]:
    """The aux statistics averaged over the layers (training.csv's AUX_COLUMNS); {} without them."""
    if "gate_mean" not in m:
        return {}
    g = np.asarray(m["gate_mean"]).mean(axis=0)
    out = {f"gate_{b}": float(g[i]) for i, b in enumerate(BRANCHES)}
    out["gate_entropy"] = float(np.mean(m["gate_entropy"]))
    out["sel_far_frac"] = float(np.mean(m["sel_far_frac"]))
    for k in SCALE_COLUMNS:  # the largest layer's: the warning signal
        out[k] = float(np.max(m[k]))
    return out


def aux_per_layer(m: dict[str, Any]) -> dict[str, float]:
    """The aux statistics of each layer as TensorBoard scalars (`layer<i>/...`); {} without them."""
    if "gate_mean" not in m:
        return {}
    out = {}
    for i, g in enumerate(np.asarray(m["gate_mean"])):
        out.update({f"layer{i}/gate_{b}": float(g[j]) for j, b in enumerate(BRANCHES)})
        out[f"layer{i}/gate_entropy"] = float(m["gate_entropy"][i])
        out[f"layer{i}/sel_far_frac"] = float(m["sel_far_frac"][i])
        out.update({f"layer{i}/{k}": float(m[k][i]) for k in SCALE_COLUMNS})
    return out


def step_row(
    step: int,
    m: dict[str, Any],
    step_s: float,
    tokens_per_step: int,
    elapsed_s: float,
    val: dict[str, Any] | None,
    eval_s: float | None,
) -> dict[str, Any]:
    """training.csv's row of a step: its metrics, its own time and throughput, and its evaluation (None)."""
    return {
        "step": step,
        "loss": float(m["loss"]),
        "lr": float(m["lr"]),
        "toks_per_s": tokens_per_step / max(step_s, 1e-9),
        "grad_norm": float(m["grad_norm"]),
        "step_time_s": step_s,
        "tokens": step * tokens_per_step,
        "elapsed_s": elapsed_s,
        "skipped": int(m["skipped"]),
        "val_loss": val and val["val_loss"],
        "eval_s": eval_s,
        **aux_means(m),
    }


def train_scalars(row: dict[str, Any]) -> dict[str, Any]:
    return {f"train/{k}": row[k] for k in TRAIN_SCALARS}


def eval_scalars(val: dict[str, Any], eval_s: float | None) -> dict[str, Any]:
    return {
        "eval/loss": val["val_loss"],
        "eval/ppl": val["val_ppl"],
        "eval/retrieval_acc": val["retrieval_acc"],
        "eval/seconds": eval_s,
    }


def interval_scalars(rate: float, m: dict[str, Any]) -> dict[str, Any]:
    """The scalars written with a step line: tokens/s over its interval and the aux statistics, whole and per layer."""
    return {"train/toks_per_s_interval": rate, **{f"aux/{k}": v for k, v in aux_means(m).items()}, **aux_per_layer(m)}


def branch_scale_warning(m: dict[str, Any]) -> tuple[float, str, int] | None:
    """(ratio, 'keys'/'values', layer) of the largest compressed/selection scale above CMP_SCALE_WARN, else None."""
    if SCALE_COLUMNS[0] not in m:
        return None
    worst = max(
        (float(r), what, i)
        for key, what in zip(SCALE_COLUMNS, ("keys", "values"), strict=True)
        for i, r in enumerate(np.asarray(m[key]))
    )
    return worst if worst[0] > CMP_SCALE_WARN else None


def branch_scale_message(ratio: float, what: str, layer: int) -> str:
    return (
        f"the compressed {what} of layer {layer} are {ratio:.0f}x the selection branch's (RMS); "
        f"the compressed branch may swamp the others (docs/NSA.md, cmp_phi): "
        f"consider model.nsa.cmp_phi=avg or a lower train.lr"
    )


def skipped_update(step: int, loss: float, skips: int, max_skips: int) -> tuple[str, str, bool]:
    """(anomaly kind, message, ops.max_skips reached) of a step whose update was skipped, the `skips`-th."""
    kind = "nan_loss" if not math.isfinite(loss) else "nan_grad"
    msg = f"non-finite {'loss' if kind == 'nan_loss' else 'gradient'} at step {step}; update skipped"
    too_many = 0 < max_skips <= skips
    if too_many:
        msg += f"; {count(skips, 'update')} skipped, ops.max_skips={max_skips} reached"
    return kind, msg, too_many
