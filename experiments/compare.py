"""Learning experiments: variants side by side, several seeds, mean +- standard error.

Trains every variant (a name and `;key=value` config overrides) for every seed on the
same rows (the data come from the base config with train.seed = the seed, so a
variant's model overrides, a wider window for instance, never change the rows),
evaluates every --eval-every steps on fixed held-out rows, and reports per evaluation
the mean +- standard error over seeds, plus a learning-curve PNG:

    python -m experiments.compare --config cpu_tiny --steps 600 --seeds 1,2,3 \\
        --set data.dataset=kv_recall --set data.kv_format=fused \\
        --variant nsa --variant "no_slc;model.nsa.branches=cmp,win" \\
        --variant "full;model.nsa.branches=win;model.nsa.w=256" --json runs.json --png curves.png

Measured at every evaluation (on the same held-out rows for every variant):
  val_loss    mean loss over the held-out rows (kv_recall: the answers only)
  accuracy    kv_recall: argmax retrieval accuracy on the answers
  sel_recall  kv_recall with a selection branch: share of (answer, layer, KV group) whose
              selected blocks hold the queried pair (its value token for the split format),
              seen from the query key that predicts the answer
  gates       gate mean per branch [cmp, slc, win] over all layers, heads and tokens

--json accumulates: runs (variant, seed) already in the file are skipped, so variants can
be run one process at a time and summarised together (each run records its package
versions; the summary warns when a file mixes environments, whose numerics differ: the
same seed need not give the same curve after a reinstall); --report-only prints the table and
draws the PNG from the file without training. --paired NAME adds each variant's difference
from NAME taken seed by seed at the last common evaluation (mean +- s.e. of the differences).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from matplotlib.figure import Figure

from benchmarks.common import add_config_args
from nsa_jax.config import ConfigError, load_config
from nsa_jax.data import make_dataset
from nsa_jax.data.kv_recall import retrieval_counts, vocab_layout
from nsa_jax.data.targets import row_targets
from nsa_jax.mesh import make_mesh, put_batch
from nsa_jax.model import NSALM, cross_entropy, per_layer
from nsa_jax.step import step as S


def parse_variant(spec: str) -> tuple[str, list[str]]:
    name, *overrides = [p.strip() for p in spec.split(";") if p.strip()]
    return name, overrides


def pair_positions(tokens_BxT1: np.ndarray, vocab_size: int, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """(query key positions [B, Q], position of the token to retrieve [B, Q]) recovered from kv_recall rows.

    Keys [0, n) occur only in the pairs and after QUERY markers; the fused pair token of
    key k lies in [2n + k n, 2n + (k + 1) n). Split: the value after the key is retrieved.
    """
    n, _, query_id = vocab_layout(vocab_size, fmt)
    qpos_list, tpos_list = [], []
    for row in tokens_BxT1:
        markers = np.flatnonzero(row[:-1] == query_id)
        qpos = markers + 1
        tpos = []
        for p in qpos:
            k = row[p]
            first_q = markers[0]
            if fmt == "split":
                hits = np.flatnonzero(row[:first_q] == k)
                tpos.append(hits[0] + 1 if len(hits) else -1)
            else:
                lo = 2 * n + k * n
                hits = np.flatnonzero((row[:first_q] >= lo) & (row[:first_q] < lo + n))
                tpos.append(hits[0] if len(hits) else -1)
        qpos_list.append(qpos)
        tpos_list.append(np.asarray(tpos))
    return np.stack(qpos_list), np.stack(tpos_list)


def make_evaluator(cfg, val_batches: list[np.ndarray]):
    """(params, step) -> dict of the held-out measurements (module docstring)."""
    model = NSALM(cfg.model)
    kv = cfg.data.dataset == "kv_recall"
    slc = "slc" in cfg.model.nsa.branches

    @jax.jit
    def forward(params, tokens_BxT1):
        logits, inter = model.apply({"params": params}, tokens_BxT1[:, :-1], mutable=["intermediates"])
        gates = jnp.mean(per_layer(inter, "intermediates", "gates", cfg.model), axis=(0, 1, 2, 3))
        idx = per_layer(inter, "intermediates", "block_idx", cfg.model) if slc else None  # [L, B, T, K, n]
        loss = cross_entropy(logits, tokens_BxT1[:, 1:], row_targets(tokens_BxT1, cfg)[1])
        return logits.argmax(-1), loss, gates, idx

    if kv:
        positions = [pair_positions(b, cfg.model.vocab_size, cfg.data.kv_format) for b in val_batches]

    def evaluate(params, step: int) -> dict:
        hits = total = 0
        losses, gates, rec_hits, rec_total = [], [], 0, 0
        for i, tokens in enumerate(val_batches):
            preds, loss, g, idx = forward(params, tokens)
            losses.append(float(loss))
            gates.append(np.asarray(g))
            if kv:
                h, n = retrieval_counts(np.asarray(preds), tokens, cfg.model.vocab_size)
                hits, total = hits + h, total + n
                if idx is not None:
                    qpos, tpos = positions[i]
                    idx = np.asarray(idx)  # [L, B, T, K, n]
                    b = np.arange(qpos.shape[0])[:, None]
                    sel_LxBxQxKxN = idx[:, b, qpos]
                    want_BxQ = tpos // cfg.model.nsa.lp
                    found = np.any(sel_LxBxQxKxN == want_BxQ[None, :, :, None, None], axis=-1)
                    valid = (tpos >= 0)[None, :, :, None]
                    rec_hits += int(np.sum(found & valid))
                    rec_total += int(np.sum(np.broadcast_to(valid, found.shape)))
        out = {"step": step, "val_loss": float(np.mean(losses)), "gates": np.mean(gates, axis=0).tolist()}
        if kv:
            out["accuracy"] = hits / max(total, 1)
            out["sel_recall"] = rec_hits / rec_total if rec_total else None
        return out

    return evaluate


def run_one(base_name: str, base_overrides: list[str], variant: str, seed: int, args) -> dict:
    name, extra = parse_variant(variant)
    common = [*base_overrides, f"train.steps={args.steps}", f"train.seed={seed}"]
    cfg = load_config(base_name, [*common, *extra])
    data_cfg = load_config(base_name, common)  # the rows: independent of the variant
    mesh = make_mesh(cfg)
    plan = S.make_plan(cfg, mesh)
    state, train_step = S.create_state(plan), S.make_train_step(plan)
    ds = make_dataset(data_cfg, "train")
    val = make_dataset(data_cfg, "val")
    val_batches = [np.asarray(next(val)) for _ in range(args.eval_batches)]
    evaluate = make_evaluator(cfg, val_batches)
    t0 = time.time()
    curve, losses = [evaluate(state.params, 0)], []
    for step in range(1, cfg.train.steps + 1):
        tokens = np.stack([next(ds) for _ in range(cfg.train.accumulate)])
        state, metrics = train_step(state, put_batch(tokens, mesh))
        losses.append(float(metrics["loss"]))
        if step % args.eval_every == 0 or step == cfg.train.steps:
            ev = evaluate(state.params, step)
            ev["train_loss"] = float(np.mean(losses[-args.eval_every :]))
            curve.append(ev)
            extra_txt = ""
            if "accuracy" in ev:
                rec = ev["sel_recall"]
                extra_txt = f" acc {ev['accuracy']:.3f} recall {'-' if rec is None else f'{rec:.3f}'}"
            gates = " ".join(f"{g:.2f}" for g in ev["gates"])
            print(
                f"  [{name} seed {seed}] step {step:5d} train {ev['train_loss']:.3f} val {ev['val_loss']:.4f}"
                f"{extra_txt} gates {gates} ({time.time() - t0:.0f}s)",
                flush=True,
            )
    return {
        "variant": name,
        "overrides": extra,
        "seed": seed,
        "curve": curve,
        "train_s": time.time() - t0,
        "answers": int(sum(b.shape[0] for b in val_batches) * cfg.data.kv_queries) if "accuracy" in curve[0] else 0,
    }


def mean_se(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if x is not None]
    if not xs:
        return float("nan"), float("nan")
    m = float(np.mean(xs))
    se = float(np.std(xs, ddof=1) / math.sqrt(len(xs))) if len(xs) > 1 else float("nan")
    return m, se


def summarise(runs: list[dict], metric: str) -> dict[str, list[tuple[int, float, float, int]]]:
    """variant -> [(step, mean, s.e., seeds)] over the steps every seed of the variant evaluated."""
    out = {}
    for name in dict.fromkeys(r["variant"] for r in runs):
        rs = [r for r in runs if r["variant"] == name]
        steps = sorted(set.intersection(*(set(e["step"] for e in r["curve"]) for r in rs)))
        rows = []
        for s in steps:
            vals = [next(e for e in r["curve"] if e["step"] == s).get(metric) for r in rs]
            m, se = mean_se(vals)
            rows.append((s, m, se, len([v for v in vals if v is not None])))
        out[name] = rows
    return out


def print_table(runs: list[dict], metric: str) -> None:
    summ = summarise(runs, metric)
    if all(math.isnan(m) for rows in summ.values() for _, m, _, _ in rows):
        return
    steps = sorted({s for rows in summ.values() for s, *_ in rows})
    print(f"\n{metric} (mean +- s.e. over seeds)")
    print("| variant | seeds | " + " | ".join(str(s) for s in steps) + " |")
    print("| --- | ---: | " + " | ".join("---:" for _ in steps) + " |")
    for name, rows in summ.items():
        by = {s: (m, se) for s, m, se, _ in rows}
        cells = []
        for s in steps:
            if s not in by or math.isnan(by[s][0]):
                cells.append("-")
            else:
                m, se = by[s]
                cells.append(f"{m:.3f}" if math.isnan(se) else f"{m:.3f} +- {se:.3f}")
        n_seeds = max((n for *_, n in rows), default=0)
        if n_seeds == 0:  # the metric does not apply to this variant (no selection branch)
            continue
        print(f"| {name} | {n_seeds} | " + " | ".join(cells) + " |")


def paired(runs: list[dict], ref: str, metric: str) -> list[tuple[str, int, list[tuple[int, float]], float, float]]:
    """[(variant, step, [(seed, variant - ref)], mean, s.e.)] at the last step both evaluated, per variant.

    Differences are taken seed by seed (the same rows and init seed for both), so the
    spread between seeds that both variants share drops out of the standard error.
    """
    by = {(r["variant"], r["seed"]): {e["step"]: e.get(metric) for e in r["curve"]} for r in runs}
    out = []
    for name in dict.fromkeys(r["variant"] for r in runs):
        seeds = sorted(s for v, s in by if v == name and (ref, s) in by)
        if name == ref or not seeds:
            continue
        steps = set.intersection(*(set(by[name, s]) & set(by[ref, s]) for s in seeds))
        if not steps:
            continue
        step = max(steps)
        diffs = [
            (s, by[name, s][step] - by[ref, s][step])
            for s in seeds
            if by[name, s][step] is not None and by[ref, s][step] is not None
        ]
        if diffs:
            m, se = mean_se([d for _, d in diffs])
            out.append((name, step, diffs, m, se))
    return out


def print_paired(runs: list[dict], ref: str) -> None:
    if not any(r["variant"] == ref for r in runs):
        print(f"\n--paired {ref}: no run of that variant in the results")
        return
    print(f"\npaired differences, variant - {ref}, seed by seed at the last step both evaluated")
    print("| variant | metric | step | per seed | mean +- s.e. |")
    print("| --- | --- | ---: | --- | ---: |")
    for metric in ("accuracy", "val_loss"):
        for name, step, diffs, m, se in paired(runs, ref, metric):
            per_seed = ", ".join(f"{d:+.3f}" for _, d in diffs)
            spread = f"{m:+.3f}" if math.isnan(se) else f"{m:+.3f} +- {se:.3f}"
            print(f"| {name} | {metric} | {step} | {per_seed} | {spread} |")


def plot(runs: list[dict], metrics: list[str], path: str) -> None:
    metrics = [m for m in metrics if any(e.get(m) is not None for r in runs for e in r["curve"])]
    fig = Figure(figsize=(5 * len(metrics), 3.8))  # no pyplot: nothing global, no display needed
    axes = fig.subplots(1, len(metrics), squeeze=False)
    names = list(dict.fromkeys(r["variant"] for r in runs))
    colors = {n: f"C{i % 10}" for i, n in enumerate(names)}  # one colour per variant in every panel
    for ax, metric in zip(axes[0], metrics):
        for name, rows in summarise(runs, metric).items():
            # Step 0 (the untrained model) would squash the loss axis.
            rows = [r for r in rows if not math.isnan(r[1]) and (r[0] > 0 or metric != "val_loss")]
            if not rows:
                continue
            s = np.array([r[0] for r in rows])
            m = np.array([r[1] for r in rows])
            se = np.nan_to_num(np.array([r[2] for r in rows]))
            ax.plot(s, m, color=colors[name], label=f"{name} (n={rows[-1][3]})")
            ax.fill_between(s, m - se, m + se, color=colors[name], alpha=0.2)
        ax.set_xlabel("step")
        ax.set_title(f"{metric} (mean +- s.e.)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


SOFTWARE = ("jax", "jaxlib", "flax", "optax", "numpy")


def software() -> dict[str, str]:
    """The package versions that decide a run's numerics (stored with every run)."""
    out = {"python": sys.version.split()[0]}
    for name in SOFTWARE:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "absent"
    return out


def environments_warning(runs: list[dict]) -> str | None:
    """A warning naming each environment's runs when `runs` come from more than one, else None."""
    groups: dict[str, list[str]] = {}
    for r in runs:
        sw = r.get("software")
        key = " ".join(f"{k} {sw[k]}" for k in sorted(sw)) if sw else "versions not recorded"
        groups.setdefault(key, []).append(f"{r['variant']}/{r['seed']}")
    if len(groups) < 2:
        return None
    lines = [f"warning: these runs come from {len(groups)} software environments; compare runs within one:"]
    lines += [f"  {key}: {', '.join(names)}" for key, names in groups.items()]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(ap, "cpu_tiny", dest="overrides", json=False)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--seeds", default="1,2,3", help="comma-separated train.seed values")
    ap.add_argument("--variant", action="append", default=[], help="NAME;key=value;... (repeatable)")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--json", help="accumulate runs here (runs already in it are skipped)")
    ap.add_argument("--png", help="learning-curve plot")
    ap.add_argument("--report-only", action="store_true", help="summarise --json without training")
    ap.add_argument(
        "--paired", action="append", default=[], help="also print every variant minus this one, seed by seed"
    )
    args = ap.parse_args()

    runs: list[dict] = []
    if args.json and os.path.exists(args.json):
        with open(args.json) as f:
            runs = json.load(f)["runs"]
    if not args.report_only:
        try:
            seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        except ValueError:
            sys.exit(f"error: --seeds must be comma-separated integers, got {args.seeds!r}")
        variants = args.variant or ["nsa"]
        try:
            for v in variants:  # validate every variant before the first run
                load_config(args.config, [*args.overrides, *parse_variant(v)[1]])
        except ConfigError as e:
            sys.exit(f"error: {e}")
        for seed in seeds:
            for v in variants:
                name = parse_variant(v)[0]
                if any(r["variant"] == name and r["seed"] == seed and r.get("steps") == args.steps for r in runs):
                    print(f"skip {name} seed {seed}: in {args.json}")
                    continue
                run = run_one(args.config, args.overrides, v, seed, args)
                run.update(steps=args.steps, config=args.config, base_overrides=args.overrides, software=software())
                runs.append(run)
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump({"runs": runs}, f, indent=1)
    if warning := environments_warning(runs):
        print(warning)
    for metric in ("accuracy", "sel_recall", "val_loss"):
        print_table(runs, metric)
    for ref in args.paired:
        print_paired(runs, ref)
    if args.png and runs:
        plot(runs, ["accuracy", "sel_recall", "val_loss"], args.png)


if __name__ == "__main__":
    main()
