"""Evaluation inside a training run: the held-out metrics and `eval.suites` at every evaluation.

`RunEvaluation(cfg, mesh)` is built once by the Trainer and called at every
train.eval_every steps. The first call reads the held-out rows (heldout.Evaluator, on
every process; when some process has none the call says why, and the run evaluates
nothing from then on). Each call returns the held-out metrics (val_loss, val_ppl,
retrieval_acc, answers: val.csv) and the eval.suites figures (long_eval.csv,
TensorBoard `long/...`; {} without suites).

`TrainingSuites(cfg)(params)` scores the current parameters with run_suites (the
run's validation text, `eval.lengths` or train.seq_len) on this process's first
device, one row per forward, and returns the figures a run logs
(suites.scalars). The parameters are gathered to the host whatever their sharding,
so every strategy works.
"""

from __future__ import annotations

import time
from typing import Callable

import jax
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from nsa_jax.agreement import agree_any
from nsa_jax.config import Config
from nsa_jax.evaluation.heldout import Evaluator
from nsa_jax.evaluation.scorer import ModelScorer
from nsa_jax.evaluation.suites import TextRows, run_suites, scalars
from nsa_jax.inference import stack_layers


class TrainingSuites:
    def __init__(self, cfg: Config, kernel_fallback: frozenset = frozenset()):
        self.cfg, self.kernel_fallback = cfg, kernel_fallback
        self.lengths = tuple(cfg.eval.lengths) or (cfg.train.seq_len,)
        self.text = TextRows(cfg)
        self.scorer: ModelScorer | None = None

    def __call__(self, params) -> dict[str, float]:
        full = params
        if not all(x.is_fully_addressable for x in jax.tree.leaves(params)):
            full = multihost_utils.process_allgather(params, tiled=True)
        host = stack_layers(self.cfg.model, jax.device_get(full))
        if self.scorer is None:
            self.scorer = ModelScorer(self.cfg.model, host, batch=1, kernel_fallback=self.kernel_fallback)
        else:
            self.scorer.params = jax.device_put(host, self.scorer.device)
        e = self.cfg.eval
        kw = dict(text=self.text, depths=e.depths, samples=e.samples, rows=e.rows)
        results = run_suites(self.scorer, self.cfg, e.suites, self.lengths, **kw)
        return scalars(results)


class RunEvaluation:
    """What a run evaluates; the held-out rows and the suites are built at the first evaluation."""

    def __init__(self, cfg: Config, mesh: Mesh, kernel_fallback: frozenset = frozenset()):
        # kernel_fallback: the branches the kernel guard moved to XLA; evaluation runs them there too.
        self.cfg, self.mesh, self.kernel_fallback = cfg, mesh, kernel_fallback
        self.evaluator: Evaluator | None = None
        self.suites: TrainingSuites | None = None

    def __call__(self, params, step: int, doing: Callable[[str | None], None]) -> tuple:
        """(held-out metrics with eval_s, eval_s, eval.suites figures, None) of `params` after `step`, waited for.

        (None, None, {}, why) when the validation rows cannot be read on some process (a
        split with no document): the run evaluates nothing from then on. `doing` names
        what runs (the run's progress thread reports it when it takes long).
        """
        first = "" if self.evaluator is not None else " (the first one reads the held-out rows and compiles)"
        doing(f"eval: step {step}: evaluating{first}")
        t0 = time.perf_counter()
        cause = self._start()
        if cause is not None:
            doing(None)
            return None, None, {}, f"no validation rows ({cause}); this run evaluates nothing from step {step} on"
        val = Evaluator.finish(self.evaluator.dispatch(params))
        val["eval_s"] = eval_s = time.perf_counter() - t0
        doing(None)
        return val, eval_s, self._long(params), None

    def _start(self) -> str | None:
        """Reads the held-out rows (once); why there are none (one line) when a process has none, else None.

        A collective: every process evaluates, or none.
        """
        if self.evaluator is not None:
            return None
        error: ValueError | None = None
        try:
            evaluator = Evaluator(self.cfg, self.mesh, self.kernel_fallback)
        except ValueError as e:
            error, evaluator = e, None
        if agree_any(error is not None):
            if error is None:
                return "on another process"
            return f"{type(error).__name__}: {error}".splitlines()[0][:500]
        self.evaluator = evaluator
        return None

    def _long(self, params) -> dict[str, float]:
        """The eval.suites figures of `params` (long_eval.csv columns, with long_eval_s); {} without suites."""
        if not self.cfg.eval.suites:
            return {}
        t0 = time.perf_counter()
        if self.suites is None:
            self.suites = TrainingSuites(self.cfg, self.kernel_fallback)
        return {**self.suites(params), "long_eval_s": time.perf_counter() - t0}
