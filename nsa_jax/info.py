"""Model facts without training: parameter counts per part and NSA attention cost.

`parameter_counts` reads shapes from `jax.eval_shape` (nothing is allocated);
`keys_per_query` counts, for each query position, the keys each branch reads,
the figure NSA's speed comes from, against dense causal attention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from nsa_jax.config import Config, ModelConfig
from nsa_jax.kernels.xla import num_compressed
from nsa_jax.model import NSALM


def param_shapes(cfg: ModelConfig):
    T = max(cfg.nsa.l, 8)
    return jax.eval_shape(lambda: NSALM(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, T), jnp.int32)))["params"]


def _part(path: tuple[str, ...]) -> str:
    keys = [getattr(p, "key", str(p)) for p in path]
    if keys[0] in ("embed", "lm_head", "final_norm"):
        return keys[0]
    name = keys[2] if len(keys) > 2 else keys[-1]
    if keys[1] == "attn":
        if name.startswith("cmp_"):
            return "attn.compressors"
        if name.startswith("gate_"):
            return "attn.gates"
        return "attn.projections"
    return {"mlp": "mlp", "attn_norm": "norms", "mlp_norm": "norms"}.get(keys[1], keys[1])


def parameter_counts(cfg: ModelConfig) -> dict[str, int]:
    """{'total': N, part: N, ...}; the scanned layer axis is included in each count."""
    counts: dict[str, int] = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(param_shapes(cfg)):
        if not cfg.scan_layers and path[0].key.startswith("layer_"):
            path = (path[0],) + path[1:]
            part = _part(("layers",) + tuple(path[1:]))
        else:
            part = _part(path)
        counts[part] = counts.get(part, 0) + int(np.prod(leaf.shape))
    counts = dict(sorted(counts.items()))
    counts["total"] = sum(counts.values())
    return counts


def keys_per_query(cfg: ModelConfig, T: int) -> dict[str, float]:
    """Mean keys read per query over positions 0..T-1, per branch, and dense causal."""
    a = cfg.nsa
    t = np.arange(T)
    Tc = num_compressed(T, a.l, a.d)
    cmp = np.clip((t - a.l + 1) // a.d + 1, 0, Tc) if Tc else np.zeros(T)
    cur = t // a.lp
    n_sel = np.minimum(a.n, cur + 1)
    # Upper bound of selected tokens: full blocks, minus the unseen tail of the current one.
    slc = n_sel * a.lp - (a.lp - 1 - t % a.lp)
    win = np.minimum(a.w, t + 1)
    out = {"cmp": float(cmp.mean()), "slc": float(slc.mean()), "win": float(win.mean())}
    out = {k: v for k, v in out.items() if k in a.branches or (k == "cmp")}
    out["nsa_total"] = sum(out.values())
    out["dense"] = float((t + 1).mean())
    return out


# The learning options (docs/NSA.md "Learning options"): (section, key).
LEARNING_OPTIONS = (
    ("model.nsa", "gate_bias_init"),
    ("train", "dense_selection_steps"),
    ("train", "scorer_distill"),
    ("train", "scorer_distill_steps"),
)


def learning_options(cfg: Config) -> str:
    """The learning options (docs/NSA.md) that differ from their defaults, as `key=value` pairs."""
    sections = {"model.nsa": (cfg.model.nsa, type(cfg.model.nsa)()), "train": (cfg.train, type(cfg.train)())}
    pairs = []
    for section, name in LEARNING_OPTIONS:
        now, default = (getattr(obj, name) for obj in sections[section])
        if now != default:
            pairs.append(f"{name}={','.join(map(str, now)) if isinstance(now, tuple) else now}")
    return " ".join(pairs)


def _sequence_line(cfg: Config) -> str:
    """The config's own training length and context degree."""
    T, C = cfg.train.seq_len, cfg.parallel.context
    where = f"each sequence split over {C} devices, {-(-T // C):,} tokens each" if C > 1 else "each on one device"
    return f"sequence: T={T:,} (train.seq_len), parallel.context={C} ({where})"


def describe(cfg: Config) -> str:
    """The text `launch.info` prints."""
    m, a = cfg.model, cfg.model.nsa
    counts = parameter_counts(m)
    dense = m.attention == "dense"
    window = f", a sliding window of {m.dense_window:,} keys" if m.dense_window else ""
    lines = [
        f"model: d_model={m.d_model} layers={m.n_layers} heads={m.n_heads} kv_heads={m.n_kv_heads} "
        f"(G={m.n_heads // m.n_kv_heads}) head_dim={m.head_dim}/{m.v_head_dim} d_ff={m.d_ff} vocab={m.vocab_size} "
        f"dtype={m.dtype}",
        *(
            [f"attention: dense (model.attention=dense): causal softmax attention{window}; model.nsa does not apply"]
            if dense
            else [
                f"nsa: l={a.l} d={a.d} lp={a.lp} n={a.n} w={a.w} phi={a.cmp_phi} branches={','.join(a.branches)} "
                f"scorer={a.scorer}{f'/{a.scorer_sub}' if a.scorer_sub else ''} attention_impl={a.attention_impl}",
                f"nsa learning options: {learning_options(cfg) or 'none'}",
            ]
        ),
        _sequence_line(cfg),
        f"parameters: {counts['total']:,} total",
    ]
    for part, n in counts.items():
        if part != "total":
            lines.append(f"  {part:<18} {n:>13,}  ({100.0 * n / counts['total']:5.1f}%)")
    if dense:  # NSA against dense is a question for an NSA config
        return "\n".join(lines)
    lines.append("attention keys read per query (mean over positions), NSA vs dense causal:")
    lines.append(f"  {'T':>7} {'cmp':>8} {'slc':>8} {'win':>8} {'nsa':>8} {'dense':>9} {'ratio':>7}")
    for T in sorted({cfg.train.seq_len, 8192, 16384, 32768, 65536}):
        k = keys_per_query(m, T)
        lines.append(
            f"  {T:>7} {k.get('cmp', 0):>8.1f} {k.get('slc', 0):>8.1f} {k.get('win', 0):>8.1f} "
            f"{k['nsa_total']:>8.1f} {k['dense']:>9.1f} {k['dense'] / k['nsa_total']:>6.2f}x"
        )
    return "\n".join(lines)
