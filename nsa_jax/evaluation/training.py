"""The long-context suites inside a training run: `eval.suites` at every evaluation.

`TrainingSuites(cfg)(params)` scores the current parameters with run_suites (the
run's validation text, `eval.lengths` or train.seq_len) on this process's first
device, one row per forward, and returns the figures a run logs
(suites.scalars: long_eval.csv columns, TensorBoard `long/...`). The parameters are
gathered to the host whatever their sharding, so every strategy works.
"""

from __future__ import annotations

import jax
from jax.experimental import multihost_utils

from nsa_jax.config import Config
from nsa_jax.evaluation.scorer import ModelScorer
from nsa_jax.evaluation.suites import TextRows, run_suites, scalars
from nsa_jax.inference import stack_layers


class TrainingSuites:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.lengths = tuple(cfg.eval.lengths) or (cfg.train.seq_len,)
        self.text = TextRows(cfg)
        self.scorer: ModelScorer | None = None

    def __call__(self, params) -> dict[str, float]:
        full = params
        if not all(x.is_fully_addressable for x in jax.tree.leaves(params)):
            full = multihost_utils.process_allgather(params, tiled=True)
        host = stack_layers(self.cfg.model, jax.device_get(full))
        if self.scorer is None:
            self.scorer = ModelScorer(self.cfg.model, host, batch=1)
        else:
            self.scorer.params = jax.device_put(host, self.scorer.device)
        e = self.cfg.eval
        kw = dict(text=self.text, depths=e.depths, samples=e.samples, rows=e.rows)
        results = run_suites(self.scorer, self.cfg, e.suites, self.lengths, **kw)
        return scalars(results)
