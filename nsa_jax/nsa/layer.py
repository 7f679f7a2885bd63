"""One NSA attention layer, the NSA core of the attention (docs/NSA.md "One layer").

From the shared input stage (nsa/inputs.py: the query and each branch's keys and values, with
their biases, norms and RoPE) to the output projection: the sigmoid gates, the three branches
and their gated sum. Branch math lives in compression.py and kernels/; this module wires them.
It sows `intermediates` (block indices, gates; for tests) and `aux` (stats.aux_stat_sums, for
the training logs). When the caller makes the `losses` collection mutable, it sows the block
scorer's distillation KL there (distill.py; the train step weighs it); a mutable
`scorer_inputs` gets the queries and selection keys the scorer works from. `mode="prefill"`
and `"decode"` run the same submodules with the cache (nsa/decode.py).

Local layers (model.global_every, Gemma's pattern): every layer has NSA's parameters (one layout
for the scan), and a local one attends with its window branch alone over model.dense_window keys,
its gates fixed at [0, 0, 1], so a converted local layer is the checkpoint's own; the kernels of
the other branches run in the global layers only (lax.cond per scanned layer).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from nsa_jax.config import BRANCHES
from nsa_jax.kernels import BranchCalls, cudnn_fits, plan_kernels
from nsa_jax.layers import DenseParams
from nsa_jax.nsa.attention import Attention, local_layer
from nsa_jax.nsa.compression import Compressor
from nsa_jax.nsa.context import SeqLayout, WholeSequence
from nsa_jax.nsa.decode import CACHE_NAMES, decode_branches, fill_cache, missing_cache
from nsa_jax.nsa.distill import score_distill_kl
from nsa_jax.nsa.inputs import Projected, output_projection, project, reprojected_key
from nsa_jax.nsa.stats import aux_stat_sums

# Each branch's keys and values, projected from x by the shared input stage (one k_norm for the keys).
KEYS = ("k_cmp", "k_slc", "k_win")
VALUES = ("v_cmp", "v_slc", "v_win")


def combine_branches(g_BxTxHx3: jax.Array, outputs: dict[str, jax.Array], branches) -> jax.Array:
    """sum over the used branches of gate * branch output [B, T, H, Dv], in fp32."""
    B, T, H, Dv = next(iter(outputs.values())).shape
    o = jnp.zeros((B, T, H, Dv), jnp.float32)
    for i, name in enumerate(BRANCHES):
        if name in branches:
            o = o + g_BxTxHx3[..., i : i + 1] * outputs[name].astype(jnp.float32)
    return o


def gated_output(g_BxTxHx3: jax.Array, outputs: dict[str, jax.Array], branches, out_proj, dtype) -> jax.Array:
    """The gated sum of the branches [B, T, H, Dv] through the output projection: [B, T, D]."""
    B, T = g_BxTxHx3.shape[:2]
    with jax.named_scope("nsa_combine"):
        o = combine_branches(g_BxTxHx3, outputs, branches)
    with jax.named_scope("nsa_out"):
        return out_proj(o.astype(dtype).reshape(B, T, -1))


def gate_bias_init(biases: tuple[float, ...], n_heads: int):
    """Bias initialiser of the last gate Dense: `biases` = [cmp, slc, win] for every head; () gives zeros.

    The Dense's 3H outputs are read as [H, 3] (head-major), so branch i of head h is output 3h + i.
    """
    if not biases:
        return nn.initializers.zeros

    def init(key, shape, dtype=jnp.float32):
        return jnp.tile(jnp.asarray(biases, dtype), n_heads).reshape(shape)

    return init


class NSAAttention(Attention):
    """x[B, T, D] -> NSA attention output [B, T, D].

    `mode`: "train" (the forward), "prefill" (the forward, and writes the cache
    of the first pos_B[b] tokens of each row) or "decode" (T = 1: the token of
    row b sits at position pos_B[b]). Prefill and decode need `layer` (index
    into the cache's layer axis) and `pos_B`. `kernels`: what each branch runs
    (kernels.plan_kernels); None: the plan of the config at this T on jax's backend.
    A plan with a `layout` (context parallelism; train mode, inside shard_map): x holds
    this device's 2S tokens of a sequence split over the `seq` axis (nsa/context.py); the
    branches see the whole sequence through its collectives, at the tokens' global positions.
    """

    @nn.compact
    def attend(self, x_BxTxD, layer, pos_B, rope_positions_T) -> jax.Array:
        cfg, a = self.cfg, self.cfg.nsa
        B, T, D = x_BxTxD.shape
        H = cfg.n_heads
        dtype = jnp.dtype(cfg.dtype)
        init = nn.initializers.normal(cfg.init_std)
        layout = None if self.kernels is None else self.kernels.layout
        if layout is not None and (self.mode != "train" or self.is_mutable_collection("losses")):
            raise ValueError(
                "context parallelism (a layout) is for training without train.scorer_distill; "
                "prefill and decode run on one device"
            )
        seq = layout or WholeSequence(T)  # the positions this device's rows hold
        positions_T = seq.positions()
        decode = self.mode == "decode"
        local = local_layer(cfg, layer)
        if self.kernels is None:  # this config's plan here; prefill and decode are never differentiated
            backward, fits = self.mode == "train", cudnn_fits(cfg)
            calls = BranchCalls(
                a,
                plan_kernels(a, seq.seq_len, jax.default_backend(), backward=backward, cudnn_ok=fits),
                cfg.attn_softcap,
            )
        else:
            calls = BranchCalls(a, self.kernels, cfg.attn_softcap)

        # The input stage (nsa/inputs.py), with the gate MLP's first layer in the same matmul. RoPE's
        # positions may differ from the token indices (train.rope_positions); the blocks, the window and
        # causality stay at the indices. Each part of the layer runs under a named scope: compiled
        # programs name it in their ops' metadata, so a profile (benchmarks/profile_step.py) or the
        # compiled program's traffic (benchmarks/gpu_aot.py --traffic) sums time and bytes per part.
        gate_fc1 = DenseParams(a.gate_hidden, use_bias=True, kernel_init=init, name="gate_fc1")
        with jax.named_scope("nsa_qkv"):
            rope_T = None if decode else positions_T if rope_positions_T is None else rope_positions_T
            p = project(cfg, x_BxTxD, KEYS, VALUES, rope_T, pos_B, extra=[gate_fc1], local=local)
        (gh,) = p.extra
        q = p.q
        kv = {n[0] + n[2:]: x for n, x in {**p.k, **p.v}.items()}  # k_cmp -> kcmp: the cache's names

        gate_fc2 = nn.Dense(
            3 * H, dtype=dtype, kernel_init=init, bias_init=gate_bias_init(a.gate_bias_init, H), name="gate_fc2"
        )
        with jax.named_scope("nsa_gates"):
            g = gate_fc2(nn.silu(gh))
            g_BxTxHx3 = jax.nn.sigmoid(g.astype(jnp.float32)).reshape(B, T, H, 3)
            if local is not None:  # a local layer: the window branch alone
                g_BxTxHx3 = jnp.where(local, jnp.asarray([0.0, 0.0, 1.0]), g_BxTxHx3)

        def compressor(name):
            return Compressor(a.l, a.d, a.cmp_phi, a.cmp_mlp_hidden, dtype=dtype, init_std=cfg.init_std, name=name)

        out_proj = output_projection(cfg)
        if self.mode != "train":  # prefill fills the cache, decode reads and advances it
            cache = {n: self.variable("cache", n, missing_cache("NSA"), n) for n in CACHE_NAMES}
        if decode:
            window = a.w if local is None else jnp.where(local, cfg.dense_window, a.w)
            outputs = decode_branches(
                cfg, cache, layer, pos_B, q[:, 0], {k: x[:, 0] for k, x in kv.items()}, compressor, window
            )
            return gated_output(g_BxTxHx3, {k: x[:, None] for k, x in outputs.items()}, a.branches, out_proj, dtype)

        cmp_k, cmp_v = compressor("cmp_k"), compressor("cmp_v")
        k_slc, v_slc = kv["kslc"], kv["vslc"]
        compressed = compress(a, seq, (kv["kcmp"], kv["vcmp"]), (cmp_k, cmp_v))
        kv_win = (kv["kwin"], kv["vwin"])
        outputs, idx = layer_kernels(a, calls, seq, q, compressed, (k_slc, v_slc), kv_win, local, cfg.dense_window)
        if "slc" in a.branches and self.is_mutable_collection("losses"):  # the caller asked for the scorer loss
            with jax.named_scope("nsa_slc"):
                kl = scorer_kl(a, x_BxTxD, p, cmp_k, dtype)
            self.sow("losses", "scorer_kl", kl if local is None else jnp.where(local, 0.0, kl))
        if "slc" in a.branches and self.is_mutable_collection("scorer_inputs"):
            # What the block scorer works from, for experiments (experiments/selection_recall.py).
            self.sow("scorer_inputs", "queries", q)
            self.sow("scorer_inputs", "selection_keys", k_slc)
            self.sow("scorer_inputs", "compressed_keys", compressed["whole"][0])
        if self.mode == "prefill":
            fill_cache(cfg, cache, layer, pos_B, kv, *compressed["whole"])
        if "slc" in a.branches:
            self.sow("intermediates", "block_idx", idx)
            with jax.named_scope("nsa_stats"):
                stat_sums = aux_stat_sums(
                    g_BxTxHx3, idx, *compressed["own"], k_slc, v_slc, a.lp, a.w,
                    positions_T, seq.real(), compressed["real"],
                )  # fmt: skip
            self.sow("aux", "stat_sums", stat_sums)
        self.sow("intermediates", "gates", g_BxTxHx3)
        return gated_output(g_BxTxHx3, outputs, a.branches, out_proj, dtype)


def scorer_kl(a, x_BxTxD, p: Projected, cmp_k, dtype) -> jax.Array:
    """The block scorer's distillation KL (distill.py), its compressed keys made again from a detached
    layer input: the KL trains the k_cmp projection and phi only, never the residual stream below
    (as DSA detaches its indexer's input), so it cannot pull on what the LM loss learns."""
    kc = cmp_k(reprojected_key(p, "k_cmp", jax.lax.stop_gradient(x_BxTxD), dtype))
    return score_distill_kl(p.q, kc, p.k["k_slc"], l=a.l, d=a.d, lp=a.lp, query_chunk=a.query_chunk)


def compress(a, seq: SeqLayout | WholeSequence, kv_cmp, compressors) -> dict:
    """The compression branch's tokens: {"whole": the sequence's compressed keys and values, "own":
    this device's, "real": which of its own count (None: all)} (nsa/context.py's compress_chunks)."""
    with jax.named_scope("nsa_cmp"), jax.named_scope("compress"):  # the compression MLP, apart from attention
        kc, kc_own, real_Tc = seq.compress_chunks(kv_cmp[0], compressors[0], a.l, a.d)
        vc, vc_own, _ = seq.compress_chunks(kv_cmp[1], compressors[1], a.l, a.d)
    return {"whole": (kc, vc), "own": (kc_own, vc_own), "real": real_Tc}


def layer_kernels(a, calls: BranchCalls, seq, q, compressed, kv_slc, kv_win, local, local_window: int):
    """branch_outputs of a global layer; of a local one (`local`, attention.local_layer), the window
    branch over `local_window` keys and zeros for the others (its gates are [0, 0, 1]), with no
    selected block (-1). A scanned layer's `local` is traced: lax.cond runs one of the two."""

    def global_layer(q, compressed, kv_slc, kv_win):
        return branch_outputs(a, calls, seq, q, compressed, kv_slc, kv_win)

    def local_layer_(q, compressed, kv_slc, kv_win):
        o, idx = jax.eval_shape(global_layer, q, compressed, kv_slc, kv_win)  # the shapes cond's sides share
        win = {"win": window_pieces(calls, seq, q, tuple(seq.gather(x) for x in kv_win), local_window)}
        zeros = {name: jnp.zeros(x.shape, x.dtype) for name, x in o.items() if name != "win"}
        return zeros | win, None if idx is None else jnp.full(idx.shape, -1, idx.dtype)

    operands = (q, compressed, kv_slc, kv_win)
    if local is None:
        return global_layer(*operands)
    if isinstance(local, bool):
        return (local_layer_ if local else global_layer)(*operands)
    return jax.lax.cond(local, local_layer_, global_layer, *operands)


def window_pieces(calls: BranchCalls, seq, q, full_win, window=None) -> jax.Array:
    """The window branch of this device's queries over the whole sequence's keys (`full_win`), one
    kernel per piece of consecutive positions (nsa/context.py); `window`: default model.nsa.w."""
    pieces = seq.pieces()
    parts = []
    for start, n, off in pieces:
        q_c = q if len(pieces) == 1 else q[:, start : start + n]
        with jax.named_scope("nsa_win"):
            parts.append(calls.window(q_c, *full_win, window=window, q_offset=off))
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def branch_outputs(a, calls: BranchCalls, seq: SeqLayout | WholeSequence, q, compressed, kv_slc, kv_win):
    """The three branches of this device's queries: (outputs per branch [B, T, H, Dv], the selected
    blocks [B, T, K, n] or None), from the compressed tokens (`compress`).

    `seq` says which positions this device's rows hold (nsa/context.py): WholeSequence (one device,
    the rows are the whole sequence) or a SeqLayout (context parallelism), whose `gather` brings the
    compressed tokens and the selection and window K/V of the whole sequence; each piece of
    consecutive positions then runs every branch's kernel with its first position as the query offset.
    """
    lp = a.lp
    num_blocks = None if isinstance(seq, WholeSequence) else seq.seq_len // lp
    kc, vc = compressed["whole"]
    full = {}
    if "slc" in a.branches:
        full["slc"] = tuple(seq.gather(x) for x in kv_slc)
    parts = {name: [] for name in BRANCHES}  # the compressed branch always runs: it selects the blocks
    idx_parts = []
    pieces = seq.pieces()
    for start, n, off in pieces:
        q_c = q if len(pieces) == 1 else q[:, start : start + n]
        with jax.named_scope("nsa_cmp"):
            # Block indices straight from the compressed branch: on the Pallas path one kernel
            # scores and selects, with no probability or block-score tensor.
            t_n = off + jnp.arange(n, dtype=jnp.int32)
            o_cmp, idx = calls.compressed(q_c, kc, vc, t_T=t_n, q_offset=off, num_blocks=num_blocks)
        parts["cmp"].append(o_cmp)
        if "slc" in a.branches and a.scorer != "cmp":  # a scorer of the selection keys (kernels/scorers.py)
            with jax.named_scope("nsa_score"):
                cmp_scores = idx if a.scorer in ("mix", "rescore") else None  # cmp's scores, or its candidates
                idx = calls.blocks(q_c, full["slc"][0], q_offset=off, num_blocks=num_blocks, cmp_scores=cmp_scores)
        if "slc" in a.branches:
            with jax.named_scope("nsa_slc"):
                parts["slc"].append(calls.selection(q_c, *full["slc"], idx, q_offset=off))
            idx_parts.append(idx)
    outputs = {name: x[0] if len(x) == 1 else jnp.concatenate(x, axis=1) for name, x in parts.items() if x}
    if "win" in a.branches:
        outputs["win"] = window_pieces(calls, seq, q, tuple(seq.gather(x) for x in kv_win))
    idx = None if not idx_parts else idx_parts[0] if len(idx_parts) == 1 else jnp.concatenate(idx_parts, axis=1)
    return outputs, idx
