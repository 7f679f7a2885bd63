"""Held-out evaluation: the fixed validation rows, loss/perplexity and kv_recall accuracy.

The reference is independent of the evaluator: logits of the model on one device,
a float64 numpy log-softmax for the loss, and `kv_recall.retrieval_counts` (numpy,
positions from the data generator's own answer mask) for the accuracy.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
import pytest

from nsa_jax.config import load_config
from nsa_jax.data import kv_recall, make_dataset
from nsa_jax.evaluation.heldout import Evaluator
from nsa_jax.mesh import DATA, make_mesh
from nsa_jax.model import NSALM
from nsa_jax.step.loss import loss_and_stats
from nsa_jax.step.state import init_state

from helpers import TINY_NSA

TINY = [
    *TINY_NSA,
    "model.init_std=0.5",
    "train.seq_len=48",
    "train.global_batch=4",
    "train.eval_batches=3",
]


def reference_metrics(cfg, params, batches, masks=None):
    """(mean loss over `masks` (default: every target), correct, scored), batch by batch on the host."""
    apply = jax.jit(NSALM(cfg.model).apply)
    nll_sum = tokens = correct = scored = 0
    for i, tokens_BxT1 in enumerate(batches):
        logits = np.asarray(apply({"params": params}, tokens_BxT1[:, :-1]), np.float64)
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        targets = tokens_BxT1[:, 1:]
        mask = np.ones(targets.shape, bool) if masks is None else masks[i]
        nll_sum += -np.take_along_axis(logp, targets[..., None], -1)[..., 0][mask].sum()
        tokens += mask.sum()
        if cfg.data.dataset == "kv_recall":
            c, s = kv_recall.retrieval_counts(logits, tokens_BxT1, cfg.model.vocab_size)
            correct, scored = correct + c, scored + s
    return nll_sum / tokens, correct, scored


@pytest.mark.slow
def test_evaluator_matches_host_reference_on_two_devices():
    cfg = load_config(None, TINY + ["model.vocab_size=64"])
    mesh = make_mesh(cfg)
    assert mesh.shape[DATA] == 2
    params = init_state(cfg).params
    ev = Evaluator(cfg, mesh)
    val = make_dataset(cfg, "val")
    batches = [next(val) for _ in range(3)]
    # The held-out rows are the first eval_batches of the val split, and never change.
    for got, want in zip(ev.batches, batches):
        np.testing.assert_array_equal(np.asarray(got), want)
    m = Evaluator.finish(ev.dispatch(params))
    loss, _, _ = reference_metrics(cfg, params, batches)
    assert abs(m["val_loss"] - loss) < 1e-5 * loss
    assert math.isclose(m["val_ppl"], math.exp(loss), rel_tol=1e-5)
    assert m["retrieval_acc"] is None and m["answers"] is None
    # Same rows, same numbers: a second evaluation is identical.
    assert Evaluator.finish(ev.dispatch(params)) == m
    # train.loss_chunk makes the logits a few positions at a time here too (model.rows_nll): the same loss.
    chunked = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, loss_chunk=7))
    assert abs(Evaluator.finish(Evaluator(chunked, mesh).dispatch(params))["val_loss"] - loss) < 1e-5 * loss
    # Different params, different loss (the evaluator really reads them).
    other = jax.tree.map(lambda p: p * 1.5, params)
    assert abs(Evaluator.finish(ev.dispatch(other))["val_loss"] - m["val_loss"]) > 1e-4


@pytest.mark.slow
def test_evaluator_retrieval_accuracy_matches_data_module(monkeypatch):
    cfg = load_config(
        None,
        TINY
        + ["model.vocab_size=32", "data.dataset=kv_recall", "data.kv_pairs=3", "data.kv_queries=3", "train.seq_len=40"],
    )
    mesh = make_mesh(cfg)
    params = init_state(cfg).params
    kbs = [make_dataset(cfg, "val").kv_batch_at(i) for i in range(3)]
    batches = [kb.tokens_BxT1 for kb in kbs]
    # data.kv_loss_mask (default): val_loss, like the training loss, counts the answers only.
    loss, correct, scored = reference_metrics(cfg, params, batches, [kb.answer_mask_BxT for kb in kbs])
    assert scored == 3 * 4 * 3  # batches x rows x queries
    m = Evaluator.finish(Evaluator(cfg, mesh).dispatch(params))
    assert m["answers"] == scored and m["retrieval_acc"] == correct / scored
    assert abs(m["val_loss"] - loss) < 1e-5 * loss

    # A stand-in model that always predicts one value id: the evaluator must count exactly
    # the answers whose stored value is that id (found here from the generator's own mask).
    n_keys, _, _ = kv_recall.vocab_layout(cfg.model.vocab_size)
    guess = n_keys  # the first value id
    answers = np.concatenate([kb.tokens_BxT1[:, 1:][kb.answer_mask_BxT] for kb in kbs])
    want = int((answers == guess).sum())
    assert 0 < want < scored, "pick another seed: the check needs some hits and some misses"

    class AlwaysGuess:
        def __init__(self, model_cfg, kernels=None, layer_gather=None):  # NSALM(cfg.model, ...)
            self.V = model_cfg.vocab_size

        def apply(self, variables, inputs_BxT, head=True):
            return jax.nn.one_hot(jax.numpy.full(inputs_BxT.shape, guess), self.V)

    monkeypatch.setattr("nsa_jax.evaluation.heldout.NSALM", AlwaysGuess)
    m = Evaluator.finish(Evaluator(cfg, mesh).dispatch(params))
    assert m["answers"] == scored and m["retrieval_acc"] == want / scored


@pytest.mark.slow
def test_kv_recall_training_loss_counts_the_answers_only():
    kv = [
        *TINY,
        "model.vocab_size=32",
        "data.dataset=kv_recall",
        "data.kv_pairs=3",
        "data.kv_queries=3",
        "train.seq_len=40",
        "logging.aux_stats=false",
    ]
    cfg = load_config(None, kv)
    params = init_state(cfg).params
    kb = make_dataset(cfg, "train").kv_batch_at(0)
    answers, _, _ = reference_metrics(cfg, params, [kb.tokens_BxT1], [kb.answer_mask_BxT])
    every, _, _ = reference_metrics(cfg, params, [kb.tokens_BxT1])
    assert abs(answers - every) > 1e-3  # the two losses differ, so the check below can tell them apart
    loss, _ = jax.jit(lambda p, t: loss_and_stats(p, t, cfg=cfg))(params, kb.tokens_BxT1)
    assert abs(float(loss) - answers) < 1e-5 * answers
    off = load_config(None, [*kv, "data.kv_loss_mask=false"])
    loss_all, _ = jax.jit(lambda p, t: loss_and_stats(p, t, cfg=off))(params, kb.tokens_BxT1)
    assert abs(float(loss_all) - every) < 1e-5 * every
