"""One NSA attention layer (docs/NSA.md "One layer").

Owns the projections (shared Q, per-branch K/V), RoPE, the three branches, the
sigmoid gates and the output projection. Branch math lives in compression.py
and kernels/; this module wires them and reports statistics: `intermediates`
(block indices, gates; for tests) and `aux` (the sums behind the gate means,
gate entropy, share of selected blocks beyond the window and compressed vs
selection key/value scale, which aux_stats finishes; for training logs). When
the caller makes the `losses` collection mutable, it sows the block scorer's
distillation KL there (distill.py; the train step weighs it); a mutable
`scorer_inputs` gets the queries and selection keys the scorer works from.

It also owns decoding (docs/NSA.md "Decode") through the same
submodules: `mode="prefill"` runs the training path over a right-padded prompt
and writes each branch's state into the `cache` collection; `mode="decode"`
attends one new token per row at its own position from that state and updates
it. The cache layout (names, sizes) is nsa_jax/inference/cache.py's; the arrays
carry the scanned layers' leading axis, indexed by `layer` (they travel in the
scan carry, so a step's writes are in place).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from nsa_jax.config import BRANCHES, ModelConfig
from nsa_jax.kernels import BranchCalls, KernelPlan, cudnn_fits, plan_kernels
from nsa_jax.kernels.scorers import minmax_row_scores
from nsa_jax.kernels.xla import block_scores_from_cmp, masked_softmax, masked_softmax_attend, select_blocks
from nsa_jax.layers import DenseParams, RMSNorm, fused_dense, rope, rope_inv_freq, rope_rows
from nsa_jax.nsa.compression import Compressor
from nsa_jax.nsa.context import SeqLayout, WholeSequence
from nsa_jax.nsa.distill import score_distill_kl

MODES = ("train", "prefill", "decode")
# Per-layer decode state in the `cache` collection (layout: nsa_jax/inference/cache.py).
CACHE_NAMES = ("kslc", "vslc", "kwin", "vwin", "ktail", "vtail", "kcmp", "vcmp", "kmin", "kmax")
# Smallest number of compressed tokens a decode step reads (then doubling up to the cache's).
CMP_BUCKET = 64


def aux_stat_sums(
    g_BxTxHx3: jax.Array,
    idx_BxTxKxN: jax.Array,
    kc_BxTcxKxDk: jax.Array,
    vc_BxTcxKxDv: jax.Array,
    k_slc_BxTxKxDk: jax.Array,
    v_slc_BxTxKxDv: jax.Array,
    lp: int,
    w: int,
    t_T: jax.Array | None = None,
    real_T: jax.Array | None = None,
    real_Tc: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """The sums the logged statistics are made of (aux_stats), in two reductions.

    "tokens" [1 + 4H + 2KN + K(Dk + Dv)]: over the B x T tokens, the token count, the
    gates [H, 3], the gate entropies [H], the selected blocks beyond the window and all
    selected blocks [K, N], the squared selection keys and values. "cmp" [Dk + Dv + 1]:
    over the compressed tokens' B x Tc x K rows, squared keys, values, and the row count.
    One reduction for each, whatever the number of statistics; aux_stats finishes them
    outside the layers (a kernel per layer and micro-batch for each statistic otherwise).
    Under context parallelism (a device's share of the sums, added over `seq` by the
    train step): `t_T` the tokens' positions (default 0..T-1), `real_T` / `real_Tc` which
    tokens and compressed tokens count (padding and duplicates do not).
    """
    B, T = g_BxTxHx3.shape[:2]
    g = g_BxTxHx3.astype(jnp.float32)
    probs = g / jnp.maximum(jnp.sum(g, axis=-1, keepdims=True), 1e-9)
    entropy_BxTxH = -jnp.sum(probs * jnp.log(jnp.maximum(probs, 1e-9)), axis=-1)
    t = (jnp.arange(T) if t_T is None else t_T)[None, :, None, None]
    used = idx_BxTxKxN >= 0
    # A block lies beyond the window when its last token is before t - w + 1.
    far = used & ((idx_BxTxKxN + 1) * lp <= t - w + 1)
    terms = [jnp.ones((B, T)), g, entropy_BxTxH, far, used, jnp.square(k_slc_BxTxKxDk), jnp.square(v_slc_BxTxKxDv)]
    tokens = jnp.concatenate([x.astype(jnp.float32).reshape(B, T, -1) for x in terms], axis=-1)
    cmp = jnp.concatenate([kc_BxTcxKxDk, vc_BxTcxKxDv], axis=-1).astype(jnp.float32)
    cmp = jnp.concatenate([jnp.square(cmp), jnp.ones((*cmp.shape[:-1], 1), jnp.float32)], axis=-1)
    if real_T is not None:
        tokens = jnp.where(real_T[None, :, None], tokens, 0.0)
    if real_Tc is not None:
        cmp = jnp.where(real_Tc[None, :, None, None], cmp, 0.0)
    return {"tokens": jnp.sum(tokens, axis=(0, 1)), "cmp": jnp.sum(cmp, axis=(0, 1, 2))}


def aux_stats(sums: dict[str, jax.Array], cfg: ModelConfig) -> dict[str, jax.Array]:
    """The logged statistics from aux_stat_sums' sums (any leading axes, e.g. [L]), fp32:

    gate_mean [..., 3] (per branch), gate_entropy (mean over tokens and heads of the
    entropy of the normalised gates), sel_far_frac (share of the selected blocks that
    lie beyond the window), cmp_k_ratio / cmp_v_ratio (RMS of the compressed keys
    (values) over the selection keys' (values'); 0 with no compressed token: the MLP
    compressor's output can grow far past the projections', docs/EXPERIMENTS.md "Why the
    MLP compressor fails on retrieval", and the training loop warns when it does).
    """
    H, K, N, Dk, Dv = cfg.n_heads, cfg.n_kv_heads, cfg.nsa.n, cfg.head_dim, cfg.v_head_dim
    tok, cmp = sums["tokens"], sums["cmp"]
    count, g, entropy, far, used, kslc_sq, vslc_sq = jnp.split(
        tok, np.cumsum([1, 3 * H, H, K * N, K * N, K * Dk]), axis=-1
    )
    kc_sq, vc_sq, rows = jnp.split(cmp, [Dk, Dk + Dv], axis=-1)
    count, rows = count[..., 0], rows[..., 0]

    def rms_ratio(num_sq, num_n, den_sq, den_n):
        ratio = jnp.sqrt(jnp.sum(num_sq, -1) / jnp.maximum(num_n, 1)) / jnp.maximum(
            jnp.sqrt(jnp.sum(den_sq, -1) / den_n), 1e-9
        )
        return jnp.where(num_n > 0, ratio, 0.0)

    return {
        "gate_mean": jnp.sum(g.reshape(*g.shape[:-1], H, 3), axis=-2) / (count * H)[..., None],
        "gate_entropy": jnp.sum(entropy, -1) / (count * H),
        "sel_far_frac": jnp.sum(far, -1) / jnp.maximum(jnp.sum(used, -1), 1),
        "cmp_k_ratio": rms_ratio(kc_sq, rows * Dk, kslc_sq, count * K * Dk),
        "cmp_v_ratio": rms_ratio(vc_sq, rows * Dv, vslc_sq, count * K * Dv),
    }


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


def check_mode(mode: str, T: int, layer, pos_B) -> None:
    """ValueError unless `mode` is one of MODES with what it needs (prefill, decode: layer, pos_B; decode: T = 1)."""
    if mode not in MODES:
        raise ValueError(f"attention mode must be one of {MODES}, got {mode!r}")
    if mode != "train" and (layer is None or pos_B is None):
        raise ValueError(f"attention mode={mode!r} needs `layer` and `pos_B`")
    if mode == "decode" and T != 1:
        raise ValueError(f"decode feeds one token per row, got {T}")


class ModelPart(nn.Module):
    """The fields every module of the model's stack carries (NSALM, Block, the attentions): the model
    config, the mode (one of MODES) and what each NSA branch runs (kernels.plan_kernels; None: the
    config's plan at the input's length on jax's backend), with the sequence layout under context
    parallelism (`KernelPlan.layout`)."""

    cfg: ModelConfig
    mode: str = "train"
    kernels: KernelPlan | None = None


class Attention(ModelPart):
    """The call every attention of the stack answers (NSAAttention, nsa/dense.DenseAttention):
    x[B, T, D] -> [B, T, D]. `layer` (index into the cache's layer axis) and `pos_B` are for
    prefill and decode; `rope_positions_T` moves RoPE off the token indices (train only)."""

    def __call__(self, x_BxTxD: jax.Array, *, layer=None, pos_B=None, rope_positions_T=None) -> jax.Array:
        check_mode(self.mode, x_BxTxD.shape[1], layer, pos_B)
        return self.attend(x_BxTxD, layer, pos_B, rope_positions_T)

    def attend(self, x_BxTxD, layer, pos_B, rope_positions_T) -> jax.Array:
        raise NotImplementedError


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
        H, K, Dk, Dv = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.v_head_dim
        dtype = jnp.dtype(cfg.dtype)
        init = nn.initializers.normal(cfg.init_std)
        out_init = nn.initializers.normal(cfg.init_std / (2 * cfg.n_layers) ** 0.5)
        layout = None if self.kernels is None else self.kernels.layout
        if layout is not None and (self.mode != "train" or self.is_mutable_collection("losses")):
            raise ValueError(
                "context parallelism (a layout) is for training without train.scorer_distill; "
                "prefill and decode run on one device"
            )
        seq = layout or WholeSequence(T)  # the positions this device's rows hold
        positions_T = seq.positions()
        decode = self.mode == "decode"
        if self.kernels is None:  # this config's plan here; prefill and decode are never differentiated
            backward, fits = self.mode == "train", cudnn_fits(cfg)
            calls = BranchCalls(
                a, plan_kernels(a, seq.seq_len, jax.default_backend(), backward=backward, cudnn_ok=fits)
            )
        else:
            calls = BranchCalls(a, self.kernels)

        # RoPE's positions may differ from the token indices (train.rope_positions); the blocks,
        # the window and causality stay at the indices.
        rope_T = positions_T if rope_positions_T is None else rope_positions_T

        inv_freq = rope_inv_freq(Dk, cfg.rope_theta, cfg.rope_scaling)

        def roped(y):
            # Decode: each row sits at its own position.
            return rope_rows(y, pos_B, inv_freq) if decode else rope(y, rope_T, inv_freq=inv_freq)

        # Every projection of x with one matmul for x's gradient (fused_dense; the parameters
        # stay one Dense each).
        bias = cfg.qkv_bias
        qk_parts = [
            DenseParams(h * Dk, use_bias=bias, kernel_init=init, name=n)
            for n, h in (("q", H), ("k_cmp", K), ("k_slc", K), ("k_win", K))
        ]
        v_parts = [DenseParams(K * Dv, use_bias=bias, kernel_init=init, name=n) for n in ("v_cmp", "v_slc", "v_win")]
        gate_fc1 = DenseParams(a.gate_hidden, use_bias=True, kernel_init=init, name="gate_fc1")
        # Qwen3's per-head norms, one for the queries and one shared by the branches' keys.
        norms = [RMSNorm(cfg.norm_eps, dtype=dtype, name=n) for n in ("q_norm", "k_norm")] if cfg.qk_norm else None
        # Each part of the layer under a named scope: compiled programs name it in their ops'
        # metadata, so a profile (benchmarks/profile_step.py) or the compiled program's traffic
        # (benchmarks/gpu_aot.py --traffic) sums time and bytes per part.
        with jax.named_scope("nsa_qkv"):
            *qk, v_cmp, v_slc, v_win, gh = fused_dense(x_BxTxD, [*qk_parts, *v_parts, gate_fc1], dtype)
            qk = [y.reshape(B, T, -1, Dk) for y in qk]
            if norms:
                qk = [norms[min(i, 1)](y) for i, y in enumerate(qk)]
            q, k_cmp, k_slc, k_win = (roped(y) for y in qk)
            v_cmp, v_slc, v_win = (v.reshape(B, T, K, Dv) for v in (v_cmp, v_slc, v_win))

        gate_fc2 = nn.Dense(
            3 * H, dtype=dtype, kernel_init=init, bias_init=gate_bias_init(a.gate_bias_init, H), name="gate_fc2"
        )
        with jax.named_scope("nsa_gates"):
            g = gate_fc2(nn.silu(gh))
            g_BxTxHx3 = jax.nn.sigmoid(g.astype(jnp.float32)).reshape(B, T, H, 3)

        def compressor(name):
            return Compressor(a.l, a.d, a.cmp_phi, a.cmp_mlp_hidden, dtype=dtype, init_std=cfg.init_std, name=name)

        out_proj = nn.Dense(D, use_bias=False, dtype=dtype, kernel_init=out_init, name="o")
        if self.mode != "train":  # prefill fills the cache, decode reads and advances it
            cache = {n: self.variable("cache", n, _missing_cache, n) for n in CACHE_NAMES}
            kv = {"kcmp": k_cmp, "vcmp": v_cmp, "kslc": k_slc, "vslc": v_slc, "kwin": k_win, "vwin": v_win}
        if decode:
            outputs = decode_branches(
                cfg, cache, layer, pos_B, q[:, 0], {k: x[:, 0] for k, x in kv.items()}, compressor
            )
            return gated_output(g_BxTxHx3, {k: x[:, None] for k, x in outputs.items()}, a.branches, out_proj, dtype)

        cmp_k, cmp_v = compressor("cmp_k"), compressor("cmp_v")
        outputs, idx, compressed = branch_outputs(
            a, calls, seq, q, (k_cmp, v_cmp), (k_slc, v_slc), (k_win, v_win), (cmp_k, cmp_v)
        )
        if "slc" in a.branches and self.is_mutable_collection("losses"):  # the caller asked for the scorer loss
            with jax.named_scope("nsa_slc"):
                kl = scorer_kl(a, x_BxTxD, qk_parts[1], norms[1] if norms else None, roped, cmp_k, q, k_slc, dtype)
            self.sow("losses", "scorer_kl", kl)
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


def scorer_kl(a, x_BxTxD, k_proj, k_norm, roped, cmp_k, q_BxTxHxDk, k_slc_BxTxKxDk, dtype) -> jax.Array:
    """The block scorer's distillation KL (distill.py), its compressed keys made again from a detached
    layer input: the KL trains the k_cmp projection and phi only, never the residual stream below
    (as DSA detaches its indexer's input), so it cannot pull on what the LM loss learns."""
    (k,) = fused_dense(jax.lax.stop_gradient(x_BxTxD), [k_proj], dtype)
    k = k.reshape(k_slc_BxTxKxDk.shape[:3] + (-1,))
    kc = cmp_k(roped(k_norm(k) if k_norm is not None else k))
    return score_distill_kl(q_BxTxHxDk, kc, k_slc_BxTxKxDk, l=a.l, d=a.d, lp=a.lp, query_chunk=a.query_chunk)


def branch_outputs(a, calls: BranchCalls, seq: SeqLayout | WholeSequence, q, kv_cmp, kv_slc, kv_win, compressors):
    """The three branches of this device's queries: (outputs per branch [B, T, H, Dv], the selected
    blocks [B, T, K, n] or None, {"whole": the sequence's compressed keys and values, "own": this
    device's, "real": which of its own count (None: all)}).

    `seq` says which positions this device's rows hold (nsa/context.py): WholeSequence (one device,
    the rows are the whole sequence) or a SeqLayout (context parallelism), whose `gather` brings the
    compressed tokens and the selection and window K/V of the whole sequence; each piece of
    consecutive positions then runs every branch's kernel with its first position as the query offset.
    """
    lp = a.lp
    num_blocks = None if isinstance(seq, WholeSequence) else seq.seq_len // lp
    with jax.named_scope("nsa_cmp"), jax.named_scope("compress"):  # the compression MLP, apart from attention
        kc, kc_own, real_Tc = seq.compress_chunks(kv_cmp[0], compressors[0], a.l, a.d)
        vc, vc_own, _ = seq.compress_chunks(kv_cmp[1], compressors[1], a.l, a.d)
    full = {}
    if "slc" in a.branches:
        full["slc"] = tuple(seq.gather(x) for x in kv_slc)
    if "win" in a.branches:
        full["win"] = tuple(seq.gather(x) for x in kv_win)
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
                cmp_scores = idx if a.scorer == "mix" else None
                idx = calls.blocks(q_c, full["slc"][0], q_offset=off, num_blocks=num_blocks, cmp_scores=cmp_scores)
        if "slc" in a.branches:
            with jax.named_scope("nsa_slc"):
                parts["slc"].append(calls.selection(q_c, *full["slc"], idx, q_offset=off))
            idx_parts.append(idx)
        if "win" in a.branches:
            with jax.named_scope("nsa_win"):
                parts["win"].append(calls.window(q_c, *full["win"], q_offset=off))
    outputs = {name: x[0] if len(x) == 1 else jnp.concatenate(x, axis=1) for name, x in parts.items() if x}
    idx = None if not idx_parts else idx_parts[0] if len(idx_parts) == 1 else jnp.concatenate(idx_parts, axis=1)
    return outputs, idx, {"whole": (kc, vc), "own": (kc_own, vc_own), "real": real_Tc}


# ---------------------------------------------------------------------------
# decode: cache slot arithmetic, prefill fill, one-token step


def _missing_cache(name: str):
    raise ValueError(
        f"NSA prefill/decode found no cache variable {name!r}: pass variables "
        "{'params': ..., 'cache': nsa_jax.inference.init_cache(...).variables()} with mutable=['cache']"
    )


def ring_positions(last_B: jax.Array, size: int) -> jax.Array:
    """[B, size]: the position held by each ring slot once positions <= last are written.

    Slot s holds p = last - ((last - s) mod size), the latest p <= last with
    p = s (mod size); p < 0 means the slot was never written.
    """
    s = jnp.arange(size, dtype=jnp.int32)
    last = last_B.astype(jnp.int32)[:, None]
    return last - jnp.mod(last - s[None, :], size)


def compressed_visible(t_B: jax.Array, Tc: int, l: int, d: int) -> jax.Array:
    """[B, Tc]: compressed token i is visible to query t iff its block ended: i*d + l - 1 <= t."""
    end_Tc = jnp.arange(Tc, dtype=jnp.int32) * d + l - 1
    return end_Tc[None, :] <= t_B[:, None]


def gather_rows(x_BxTxKxD: jax.Array, pos_BxN: jax.Array) -> jax.Array:
    """x[b, pos[b, j]] -> [B, N, K, D], zero where pos < 0."""
    g = jnp.take_along_axis(x_BxTxKxD, jnp.maximum(pos_BxN, 0)[:, :, None, None], axis=1)
    return jnp.where((pos_BxN >= 0)[:, :, None, None], g, jnp.zeros((), g.dtype))


def fill_cache(cfg: ModelConfig, cache: dict, layer: jax.Array, lengths_B: jax.Array, kv: dict, kc, vc) -> None:
    """Writes layer `layer` of the cache from a prefill of a right-padded prompt [B, P].

    `kv` holds the forward's RoPE'd keys and values of every branch [B, P, K, D]
    (kcmp/vcmp: the raw compression inputs), kc/vc its compressed tokens
    [B, Tc(P), K, D]. Row b keeps its first lengths_B[b] positions; the rest is
    zeroed (raw, compressed) or never gathered (rings).
    """
    a = cfg.nsa
    B, P = kv["kslc"].shape[:2]
    S, R, Tc = cache["kslc"].value.shape[2], cache["kwin"].value.shape[2], cache["kcmp"].value.shape[2]
    lengths_B = lengths_B.astype(jnp.int32)
    live_BxP = jnp.arange(P, dtype=jnp.int32)[None, :] < lengths_B[:, None]

    def put(name, x_BxNxKxD, n):
        x = jnp.pad(x_BxNxKxD, [(0, 0), (0, n - x_BxNxKxD.shape[1]), (0, 0), (0, 0)])
        v = cache[name].value
        cache[name].value = v.at[layer].set(x.astype(v.dtype))

    for name in ("kslc", "vslc"):
        put(name, jnp.where(live_BxP[:, :, None, None], kv[name], jnp.zeros((), kv[name].dtype)), S)
    win_pos = ring_positions(lengths_B - 1, R)
    tail_pos = ring_positions(lengths_B - 1, a.l)
    for name in ("kwin", "vwin"):
        put(name, gather_rows(kv[name], win_pos), R)
    for name, src in (("ktail", "kcmp"), ("vtail", "vcmp")):
        put(name, gather_rows(kv[src], tail_pos), a.l)
    for name, x in (("kcmp", kc), ("vcmp", vc)):
        Tp = min(x.shape[1], Tc)
        done = compressed_visible(lengths_B - 1, Tp, a.l, a.d)[:, :, None, None]
        put(name, jnp.where(done, x[:, :Tp], jnp.zeros((), x.dtype)), Tc)
    U = cache["kmin"].value.shape[2]
    if U:  # the minmax scorer: each sub-block's extremes over the row's live keys (0 where none is)
        sub = S // U
        P_sub = -(-P // sub) * sub
        k = jnp.pad(kv["kslc"].astype(jnp.float32), [(0, 0), (0, P_sub - P), (0, 0), (0, 0)])
        live = jnp.pad(live_BxP, [(0, 0), (0, P_sub - P)])[:, :, None, None]
        k, live = k.reshape(B, P_sub // sub, sub, *k.shape[2:]), live.reshape(B, P_sub // sub, sub, 1, 1)
        any_live = jnp.any(live, axis=2)
        for name, reduce, fill in (("kmin", jnp.min, jnp.inf), ("kmax", jnp.max, -jnp.inf)):
            put(name, jnp.where(any_live, reduce(jnp.where(live, k, fill), axis=2), 0.0), U)


def cmp_buckets(Tc: int) -> tuple[int, ...]:
    """Static sizes a decode step may read of Tc compressed slots: CMP_BUCKET, doubling, then Tc."""
    sizes = []
    n = CMP_BUCKET
    while n < Tc:
        sizes.append(n)
        n *= 2
    return (*sizes, Tc)


def _compressed_step(qg_BxKxGxDk, kcmp, vcmp, layer, t_B, a, n_blocks: int, scale: float):
    """Compressed attention of one query per row, and its selection-block scores [B, K, Nb].

    Reads only a prefix of the compressed slots: the smallest bucket that holds
    every compressed token visible to some row. Slots beyond are invisible to
    every row, so the result equals the read of all Tc slots.
    """
    B, Tc, K, Dv = vcmp.shape[1], vcmp.shape[2], vcmp.shape[3], vcmp.shape[4]
    G = qg_BxKxGxDk.shape[2]

    def attend(Tb):
        def run():
            kc = jax.lax.dynamic_slice(kcmp, (layer, 0, 0, 0, 0), (1, B, Tb, K, kcmp.shape[4]))[0]
            vc = jax.lax.dynamic_slice(vcmp, (layer, 0, 0, 0, 0), (1, B, Tb, K, Dv))[0]
            s = jnp.einsum("bkgd,bikd->bkgi", qg_BxKxGxDk, kc, preferred_element_type=jnp.float32) * scale
            p = masked_softmax(s, compressed_visible(t_B, Tb, a.l, a.d)[:, None, None, :])
            o = jnp.einsum("bkgi,bikd->bkgd", p.astype(vc.dtype), vc, preferred_element_type=jnp.float32)
            # GQA sharing (Eq. 10); blocks past Tb overlap only zero-probability tokens.
            scores = block_scores_from_cmp(jnp.sum(p, axis=2), n_blocks, a.l, a.d, a.lp)
            return o, scores

        return run

    sizes = cmp_buckets(Tc)
    if len(sizes) == 1:
        return attend(Tc)()
    need = jnp.max(jnp.where(t_B + 1 >= a.l, (t_B + 1 - a.l) // a.d + 1, 0))
    branch = jnp.sum(jnp.asarray(sizes[:-1], jnp.int32) < need)
    o, scores = jax.lax.switch(branch, [attend(n) for n in sizes])
    assert o.shape == (B, K, G, Dv)
    return o, scores


def decode_branches(cfg: ModelConfig, cache: dict, layer, t_B, q_BxHxDk, new: dict, compressor) -> dict:
    """One decode step of every branch; writes position t_B[b] of each row into the cache first.

    `new` holds the token's RoPE'd keys/values per branch [B, K, D]; `compressor`
    builds the layer's Compressor submodules by name. Returns branch outputs [B, H, Dv].
    """
    a = cfg.nsa
    B, H, Dk = q_BxHxDk.shape
    K, Dv = cfg.n_kv_heads, cfg.v_head_dim
    G = H // K
    scale = Dk**-0.5
    S, R, Tc = cache["kslc"].value.shape[2], cache["kwin"].value.shape[2], cache["kcmp"].value.shape[2]
    b_B = jnp.arange(B)
    t_B = t_B.astype(jnp.int32)

    def write(name, slot_B, x_BxKxD, keep_B=None):
        v = cache[name].value
        x = x_BxKxD.astype(v.dtype)
        if keep_B is not None:
            x = jnp.where(keep_B[:, None, None], x, v[layer, b_B, slot_B])
        # Scatter into the scan carry: in place.
        cache[name].value = v.at[layer, b_B, slot_B].set(x)

    for name in ("kslc", "vslc"):
        write(name, t_B, new[name])
    for name in ("kwin", "vwin"):
        write(name, t_B % R, new[name])
    write("ktail", t_B % a.l, new["kcmp"])
    write("vtail", t_B % a.l, new["vcmp"])
    U = cache["kmin"].value.shape[2]
    if U:  # the minmax scorer's bounds: a sub-block's first key starts them, the others extend them
        sub, slot_B = S // U, t_B // (S // U)
        first_B = (t_B % sub == 0)[:, None, None]
        for name, extend in (("kmin", jnp.minimum), ("kmax", jnp.maximum)):
            old = cache[name].value[layer, b_B, slot_B].astype(jnp.float32)
            k_new = new["kslc"].astype(jnp.float32)
            write(name, slot_B, jnp.where(first_B, k_new, extend(old, k_new)))

    qg_BxKxGxDk = q_BxHxDk.reshape(B, K, G, Dk)
    outputs = {}
    if "cmp" in a.branches or "slc" in a.branches:
        # Compression block (t + 1 - l) / d completes at t: compress its l raw K/V (the tail
        # ring) with the layer's compressor and store it before attending, so the query at t
        # sees it, as in the forward (i*d + l - 1 <= t).
        emit_B = (t_B + 1 >= a.l) & (jnp.mod(t_B + 1 - a.l, a.d) == 0)
        ci_B = jnp.clip((t_B + 1 - a.l) // a.d, 0, Tc - 1)
        slots_Bxl = jnp.mod(t_B[:, None] + 1 - a.l + jnp.arange(a.l, dtype=jnp.int32)[None, :], a.l)
        for name, tail, cname in (("kcmp", "ktail", "cmp_k"), ("vcmp", "vtail", "cmp_v")):
            tail_BxlxKxD = jnp.take_along_axis(cache[tail].value[layer], slots_Bxl[:, :, None, None], axis=1)
            write(name, ci_B, compressor(cname)(tail_BxlxKxD)[:, 0], emit_B)
        o_cmp, scores_BxKxNb = _compressed_step(
            qg_BxKxGxDk, cache["kcmp"].value, cache["vcmp"].value, layer, t_B, a, S // a.lp, scale
        )
        outputs["cmp"] = o_cmp.reshape(B, H, Dv).astype(q_BxHxDk.dtype)

    if "slc" in a.branches:
        if U:  # minmax's scores (mix: added to cmp's)
            kb = (cache["kmin"].value[layer], cache["kmax"].value[layer])
            mm = minmax_row_scores(qg_BxKxGxDk, *kb, t_B, lp=a.lp, sub=S // U, scale=scale)
            scores_BxKxNb = mm + scores_BxKxNb if a.scorer == "mix" else mm
        # Rows as select_blocks' query axis, so each row gets its own position.
        idx_BxKxN = select_blocks(scores_BxKxNb[None], a.lp, a.n, t_B)[0]
        used = idx_BxKxN >= 0
        pos_BxKxNxLp = jnp.where(used, idx_BxKxN, 0)[..., None] * a.lp + jnp.arange(a.lp, dtype=jnp.int32)
        vis = (used[..., None] & (pos_BxKxNxLp <= t_B[:, None, None, None])).reshape(B, K, 1, a.n * a.lp)
        pos_BxKxM = pos_BxKxNxLp.reshape(B, K, a.n * a.lp)
        k_idx = jnp.arange(K)[None, :, None]
        # Gather only the selected blocks from the full buffer (no per-layer copy of it).
        kg = cache["kslc"].value[layer, b_B[:, None, None], pos_BxKxM, k_idx]
        vg = cache["vslc"].value[layer, b_B[:, None, None], pos_BxKxM, k_idx]
        s = jnp.einsum("bkgd,bkmd->bkgm", qg_BxKxGxDk, kg, preferred_element_type=jnp.float32) * scale
        o = masked_softmax_attend(s, vis, vg, "bkgm,bkmd->bkgd")
        outputs["slc"] = o.reshape(B, H, Dv).astype(q_BxHxDk.dtype)

    if "win" in a.branches:
        o = ring_attend(qg_BxKxGxDk, cache["kwin"].value[layer], cache["vwin"].value[layer], t_B, a.w)
        outputs["win"] = o.reshape(B, H, Dv).astype(q_BxHxDk.dtype)
    return outputs


def ring_attend(qg_BxKxGxDk, kw_BxRxKxDk, vw_BxRxKxDv, t_B, window: int) -> jax.Array:
    """One decode query per row over a ring of the last R keys (the window branch's, and dense
    attention's): [B, K, G, Dv] fp32. Ring slots hold positions in (t - R, t]; with R <= window
    only never-written slots and those older than the window are masked."""
    wp_BxR = ring_positions(t_B, kw_BxRxKxDk.shape[1])
    vis = ((wp_BxR >= 0) & (wp_BxR > t_B[:, None] - window))[:, None, None, :]
    scale = qg_BxKxGxDk.shape[-1] ** -0.5
    s = jnp.einsum("bkgd,brkd->bkgr", qg_BxKxGxDk, kw_BxRxKxDk, preferred_element_type=jnp.float32) * scale
    return masked_softmax_attend(s, vis, vw_BxRxKxDv, "bkgr,brkd->bkgd")
