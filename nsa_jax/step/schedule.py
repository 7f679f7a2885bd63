"""The selection branch's training schedule: config -> phases (docs/NSA.md "Learning options").

`train.dense_selection_steps` and `train.scorer_distill` / `train.scorer_distill_steps`
split training into at most three phases. A phase changes only what the loss computes
(the model's n: every block selected; the distillation weight), never the parameters,
so the train step compiles one loss per phase and the step counter picks one
(step.make_phased_grad_fn). Pure: no jax.

`lr_change_on_resume` says what a resume with changed learning-rate settings does: the
LR is a function of the step and of train.steps, warmup, lr, min_lr and decay_steps
(nsa_jax/step/optimizer.py), so the resumed run follows the new schedule from the
restored step on; a cosine that had reached min_lr rises again when train.steps grows.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from nsa_jax.config import Config, ModelConfig, TrainConfig
from nsa_jax.words import count

# The settings the learning rate is a function of (besides the step).
LR_SCHEDULE_KEYS = ("steps", "warmup", "lr", "min_lr", "decay_steps")


@dataclasses.dataclass(frozen=True)
class Phase:
    """From step `start` on: the loss runs `model` and adds `distill` times the block-scorer KL."""

    start: int
    model: ModelConfig
    distill: float


def dense_selection_steps(cfg: Config) -> int:
    """Steps with every block selected (train.dense_selection_steps); 0 without the selection branch."""
    return cfg.train.dense_selection_steps if "slc" in cfg.model.nsa.branches else 0


def scorer_distill(cfg: Config) -> float:
    """The distillation weight of the first step (train.scorer_distill); 0 without the selection branch."""
    return cfg.train.scorer_distill if "slc" in cfg.model.nsa.branches else 0.0


def dense_selection_model(cfg: Config) -> ModelConfig:
    """cfg.model with n = every selection block of train.seq_len.

    Block 0, the current and the previous block are forced and the other slots take the
    best-scored earlier blocks, so with n >= ceil(T / lp) every query selects every block
    up to its own: the selection branch is causal attention over all keys.
    """
    a = cfg.model.nsa
    nsa = dataclasses.replace(a, n=max(a.n, -(-cfg.train.seq_len // a.lp)))
    return dataclasses.replace(cfg.model, nsa=nsa)


def phases(cfg: Config) -> list[Phase]:
    """The phases the step counter walks through, in order of their first step.

    One phase unless the dense selection or a limited distillation is on: before
    train.dense_selection_steps every block is selected; before train.scorer_distill_steps
    (0: never stops) the loss adds the distillation.
    """
    dense_until, weight = dense_selection_steps(cfg), scorer_distill(cfg)
    distill_until = cfg.train.scorer_distill_steps if weight else 0
    out = []
    for start in sorted({0, dense_until, distill_until}):
        model = dense_selection_model(cfg) if start < dense_until else cfg.model
        out.append(Phase(start, model, 0.0 if distill_until and start >= distill_until else weight))
    return out


def lr_change_on_resume(
    saved_train: dict[str, Any], now: TrainConfig, step: int, lr_at: Callable[[int, TrainConfig], float]
) -> str | None:
    """One line on the LR of a run resumed at `step` whose schedule settings changed since the
    checkpoint (`saved_train`: the checkpoint's train section); None when none changed.

    `lr_at(s, train)`: the LR of the update that follows s completed steps.
    """
    changed = [k for k in LR_SCHEDULE_KEYS if k in saved_train and saved_train[k] != getattr(now, k)]
    if not changed or step < 1:
        return None
    old = dataclasses.replace(now, **{k: saved_train[k] for k in changed})
    last, nxt = lr_at(step - 1, old), lr_at(step, now)
    what = ", ".join(f"train.{k} {saved_train[k]} -> {getattr(now, k)}" for k in changed)
    advice = "to continue at the peak and decay only at the end (staged training), set train.decay_steps"
    if now.warmup >= now.steps:  # the run ends inside its warm-up: no cosine at all
        end = lr_at(now.steps - 1, now)
        shape = (
            f"its warm-up ({count(now.warmup, 'step')}) ends past the last step: the LR rises to {end:.2e} "
            f"at step {now.steps} and never decays"
        )
        advice = f"for a decay within the run, set train.warmup below {now.steps}"
    elif now.decay_steps:
        shape = f"held at {now.lr:.2e} until the last {count(now.decay_steps, 'step')}, then a cosine"
        shape += f" to {now.min_lr:.2e} at step {now.steps}"
    else:
        shape = f"a cosine from the end of the warm-up to {now.min_lr:.2e} at step {now.steps}"
    return (
        f"resume: {what}: the LR schedule is recomputed for the new settings ({shape}); "
        f"step {step} trained at lr {last:.2e}, step {step + 1} trains at {nxt:.2e}; {advice}"
    )
