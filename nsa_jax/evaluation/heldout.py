"""Held-out evaluation: a fixed validation set and its metrics.

Owns which rows are evaluated and what is measured on them:
  - the rows: the first `train.eval_batches` batches of this process's `val` split,
    read once and kept on the host. Every evaluation scores the same rows, so the
    curve in val.csv moves only because the model does (also across a resume);
  - the metrics: mean next-token loss over the positions the training loss counts
    (nsa_jax/data/targets.py loss_weights), perplexity exp(loss), and for `kv_recall`
    and `needle` the retrieval accuracy (argmax at the answer positions of
    targets.answer_mask: kv_recall's values, the needle's pass key).

The jitted function is plain jit over a batch sharded on the `data` axis: it takes
the parameters in whatever sharding the training strategy keeps them, and XLA
inserts what the layout needs. Under context parallelism (parallel.context > 1) the
rows are laid out over `seq` as the train step lays them out and the model runs
inside shard_map, each device scoring its tokens (a row need not fit one device).
`dispatch` returns device arrays without waiting, so an evaluation overlaps the next
train step; `finish` reads them.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nsa_jax.config import Config
from nsa_jax.data import make_dataset
from nsa_jax.data.targets import answer_mask, loss_weights
from nsa_jax.kernels import plan_kernels
from nsa_jax.mesh import DATA, SEQ, process_rows
from nsa_jax.model import NSALM, cross_entropy, token_nll
from nsa_jax.nsa.context import seq_shard


def make_eval_fn(cfg: Config, kernel_fallback: frozenset = frozenset()):
    """(params, tokens_BxT1) -> {'loss_sum', 'tokens', 'correct', 'scored'}: sums over the batch.

    `correct`/`scored` count the answer positions (targets.answer_mask; zero for datasets without answers).
    Sums, not means, so batches of any split add up exactly. `kernel_fallback`: the NSA branches the
    run's kernel guard moved to XLA (kernels/guard.py), moved here too.
    """

    def eval_fn(params, tokens_BxT1):
        inputs_BxT, targets_BxT = tokens_BxT1[:, :-1], tokens_BxT1[:, 1:]
        plan = plan_kernels(cfg.model.nsa, inputs_BxT.shape[1], jax.default_backend(), kernel_fallback)
        logits_BxTxV = NSALM(cfg.model, kernels=plan).apply({"params": params}, inputs_BxT)
        # The training loss's weights (all targets alike, kv_recall's answers, the needle's weighted key).
        weight_BxT = loss_weights(tokens_BxT1, cfg)
        n_tokens = jnp.asarray(targets_BxT.size if weight_BxT is None else weight_BxT.sum(), jnp.float32)
        out = {"loss_sum": cross_entropy(logits_BxTxV, targets_BxT, weight_BxT) * n_tokens, "tokens": n_tokens}
        answer_BxT = answer_mask(tokens_BxT1, cfg)  # answer accuracy: kv_recall's values, the pass key
        if answer_BxT is None:
            out["correct"] = out["scored"] = jnp.zeros((), jnp.float32)
            return out
        hit_BxT = (logits_BxTxV.argmax(-1) == targets_BxT) & answer_BxT
        out["correct"] = hit_BxT.sum().astype(jnp.float32)
        out["scored"] = answer_BxT.sum().astype(jnp.float32)
        return out

    return eval_fn


def make_context_eval_fn(cfg: Config, mesh: Mesh, kernel_fallback: frozenset = frozenset()):
    """make_eval_fn's sums under context parallelism: each row padded and split over `seq`
    (nsa/context.py), every device scoring its own tokens; padded targets weigh nothing."""
    shard = seq_shard(cfg)
    plan = plan_kernels(cfg.model.nsa, shard.seq_len, mesh.devices.flat[0].platform, kernel_fallback, shard.size)
    rows = NamedSharding(mesh, P(DATA, SEQ))

    def local(params, inputs_bxL, targets_bxL, weight_bxL, answer_bxL):
        logits_bxLxV = NSALM(cfg.model, kernels=plan, shard=shard).apply({"params": params}, inputs_bxL)
        hit = (logits_bxLxV.argmax(-1) == targets_bxL) & answer_bxL
        sums = {
            "loss_sum": jnp.sum(token_nll(logits_bxLxV, targets_bxL) * weight_bxL),
            "tokens": jnp.sum(weight_bxL),
            "correct": jnp.sum(hit).astype(jnp.float32),
            "scored": jnp.sum(answer_bxL).astype(jnp.float32),
        }
        return jax.tree.map(lambda x: jax.lax.psum(x, (DATA, SEQ)), sums)

    def eval_fn(params, tokens_BxT1):
        inputs_BxT, targets_BxT = tokens_BxT1[:, :-1], tokens_BxT1[:, 1:]
        weight_BxT = loss_weights(tokens_BxT1, cfg)
        weight_BxT = jnp.ones(targets_BxT.shape, jnp.float32) if weight_BxT is None else weight_BxT
        answer_BxT = answer_mask(tokens_BxT1, cfg)
        answer_BxT = jnp.zeros(targets_BxT.shape, bool) if answer_BxT is None else answer_BxT
        parts = [inputs_BxT, targets_BxT, weight_BxT.astype(jnp.float32), answer_BxT]
        parts = [jax.lax.with_sharding_constraint(shard.lay_out(x, 1), rows) for x in parts]
        spec = P(DATA, SEQ)
        fn = jax.shard_map(local, mesh=mesh, in_specs=(P(), spec, spec, spec, spec), out_specs=P(), check_vma=False)
        return fn(params, *parts)

    return eval_fn


class Evaluator:
    """The fixed held-out rows of one run and the jitted metric function over them."""

    def __init__(self, cfg: Config, mesh: Mesh, kernel_fallback: frozenset = frozenset()):
        self.cfg = cfg
        self.sharding = NamedSharding(mesh, P(DATA))
        self.groups = process_rows(mesh)[1]
        fn = (
            make_eval_fn(cfg, kernel_fallback)
            if cfg.parallel.context == 1
            else make_context_eval_fn(cfg, mesh, kernel_fallback)
        )
        self.fn = jax.jit(fn, out_shardings=NamedSharding(mesh, P()))
        val = make_dataset(cfg, "val", *process_rows(mesh))
        try:
            rows = [next(val) for _ in range(cfg.train.eval_batches)]
        except StopIteration:
            raise ValueError(
                f"the validation split has fewer than train.eval_batches={cfg.train.eval_batches} batches; "
                "lower train.eval_batches or raise data.val_fraction"
            ) from None
        finally:
            val.close()
        self.batches = [self._place(r) for r in rows]

    def _place(self, local_bxT1: np.ndarray) -> jax.Array:
        shape = (local_bxT1.shape[0] * self.groups, local_bxT1.shape[1])
        return jax.make_array_from_process_local_data(self.sharding, local_bxT1, shape)

    def dispatch(self, params) -> dict[str, jax.Array]:
        """Sums over the held-out set, as device arrays (not waited for)."""
        total = None
        for batch in self.batches:
            out = self.fn(params, batch)
            total = out if total is None else jax.tree.map(jnp.add, total, out)
        return total

    @staticmethod
    def finish(pending: dict[str, jax.Array]) -> dict[str, float | None]:
        """Blocks on `dispatch`'s arrays -> val_loss, val_ppl, retrieval_acc (None unless kv_recall), answers."""
        sums = {k: float(v) for k, v in jax.device_get(pending).items()}
        loss = sums["loss_sum"] / sums["tokens"]
        return {
            "val_loss": loss,
            "val_ppl": math.exp(loss) if loss < 700 else math.inf,
            "retrieval_acc": sums["correct"] / sums["scored"] if sums["scored"] else None,
            "answers": int(sums["scored"]) if sums["scored"] else None,
        }


def format_eval(m: dict[str, Any]) -> str:
    """' | val 3.2100 ppl 24.78 | recall 0.812' for the progress line."""
    line = f" | val {m['val_loss']:.4f} ppl {m['val_ppl']:.2f}"
    if m.get("retrieval_acc") is not None:
        line += f" | recall {m['retrieval_acc']:.3f}"
    return line
