"""Held-out evaluation: a fixed validation set and its metrics.

Owns which rows are evaluated and what is measured on them:
  - the rows: the first `train.eval_batches` batches of this process's `val` split,
    read once and kept on the host. Every evaluation scores the same rows, so the
    curve in val.csv moves only because the model does (also across a resume);
  - the metrics: mean next-token loss over the positions the training loss counts
    (nsa_jax/data/targets.py row_targets), perplexity exp(loss), and for rows with answers
    the retrieval accuracy (argmax at the answer targets: kv_recall's values, the needle's
    pass key, a fine-tune's answer).

The jitted function lays the rows out as the train step does (nsa_jax/step/rows.py) and
scores them inside one shard_map over (data, seq): each device its rows, and under
context parallelism its positions of them (a row need not fit one device). It takes
the parameters as the training strategy keeps them and gathers them as the step does
(strategies.ParamGather: under fsdp each layer as it runs).
`dispatch` returns device arrays without waiting, so an evaluation overlaps the next
train step; `finish` reads them.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nsa_jax.config import Config
from nsa_jax.data import make_dataset
from nsa_jax.kernels import plan_kernels
from nsa_jax.mesh import DATA, SEQ, process_rows
from nsa_jax.model import NSALM, rows_nll
from nsa_jax.nsa.context import seq_layout
from nsa_jax.step.rows import Rows, lay_out_rows, rows_spec
from nsa_jax.step.strategies import param_gather, state_shardings


def make_eval_fn(cfg: Config, mesh: Mesh, kernel_fallback: frozenset = frozenset()):
    """(params, batch_BxT1) -> {'loss_sum', 'tokens', 'correct', 'scored'}: sums over the batch.

    `correct`/`scored` count the answer targets (targets.row_targets; zero for datasets without
    answers). Sums, not means, so batches of any split add up exactly. The rows are laid out as
    the train step lays them out (rows.lay_out_rows) and scored inside one shard_map over
    (data, seq): each device scores its rows, or under context parallelism its positions of them
    (padded targets weigh nothing). `kernel_fallback`: the NSA branches the run's kernel guard
    moved to XLA (kernels/guard.py), moved here too.
    """
    layout = seq_layout(cfg)
    # The parameters as the strategy keeps them; fsdp's layers are gathered as each layer runs, as in the step.
    sliced = state_shardings(cfg, mesh).params if cfg.parallel.strategy == "fsdp" else None  # strategies
    gather = param_gather(cfg.parallel.strategy, sliced)

    def local(params, rows: Rows, plan):
        model = NSALM(cfg.model, kernels=plan, layer_gather=gather.layer)
        params = gather.early(params)
        chunk = cfg.train.loss_chunk  # the logits a chunk at a time, as the train step makes them
        out = model.apply({"params": params}, rows.inputs, head=not chunk)
        nll, hit = rows_nll(cfg.model, params, out, rows.targets, chunk, hits=True)
        hit = hit & rows.answers
        sums = {
            "loss_sum": jnp.sum(nll * rows.weights),
            "tokens": jnp.sum(rows.weights),
            "correct": jnp.sum(hit).astype(jnp.float32),
            "scored": jnp.sum(rows.answers).astype(jnp.float32),
        }
        return jax.tree.map(lambda x: jax.lax.psum(x, (DATA, SEQ)), sums)

    def eval_fn(params, batch_BxT1):
        rows = lay_out_rows(batch_BxT1, cfg, layout, answers=True)
        seq_len = rows.inputs.shape[-1]  # T' under context parallelism
        plan = plan_kernels(
            cfg.model.nsa, seq_len, mesh.devices.flat[0].platform, kernel_fallback, layout, backward=False
        )
        specs = rows_spec(rows, 0)
        rows = jax.tree.map(lambda x, spec: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec)), rows, specs)
        fn = jax.shard_map(
            functools.partial(local, plan=plan),
            mesh=mesh,
            in_specs=(gather.specs, specs),
            out_specs=P(),
            check_vma=False,
        )
        return fn(params, rows)

    return eval_fn


class Evaluator:
    """The fixed held-out rows of one run and the jitted metric function over them."""

    def __init__(self, cfg: Config, mesh: Mesh, kernel_fallback: frozenset = frozenset()):
        self.cfg = cfg
        self.sharding = NamedSharding(mesh, P(DATA))
        self.groups = process_rows(mesh)[1]
        self.fn = jax.jit(make_eval_fn(cfg, mesh, kernel_fallback), out_shardings=NamedSharding(mesh, P()))
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

    def _place(self, local_bxT1: Any) -> Any:
        """This process's rows as the global array (each leaf of a batch pytree: LabeledRows)."""

        def place(x: np.ndarray) -> jax.Array:
            shape = (x.shape[0] * self.groups, *x.shape[1:])
            return jax.make_array_from_process_local_data(self.sharding, x, shape)

        return jax.tree.map(place, local_bxT1)

    def dispatch(self, params) -> dict[str, jax.Array]:
        """Sums over the held-out set, as device arrays (not waited for)."""
        total = None
        for batch in self.batches:
            out = self.fn(params, batch)
            total = out if total is None else jax.tree.map(jnp.add, total, out)
        return total

    @staticmethod
    def finish(pending: dict[str, jax.Array]) -> dict[str, float | None]:
        """Blocks on `dispatch`'s arrays -> val_loss, val_ppl, retrieval_acc (None without answers), answers."""
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
