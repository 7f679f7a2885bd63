"""`python -m launch.info --config NAME|FOLDER [--set key=value ...] [--target a100-40|v5e-8 [--devices N]]`.

Parameter counts and NSA cost; with `--target`, whether the config's train step fits
that card or TPU slice (compiled on this host for it: no GPU or TPU needed, only jax's CUDA
plugin or libtpu; a slice's chips are its devices unless --devices says fewer) and
the largest micro-batch per device that does; with parallel.context > 1 (each sequence
over several cards) the longest train.seq_len that does instead. `--devices`: the
cards in all (data x seq). FOLDER: a model folder (its config.yaml); a dense model's lines
say it is dense, without the NSA settings and the NSA-vs-dense table.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

from launch.cli import add_overrides
from nsa_jax.config import ConfigError, load_config
from nsa_jax.info import describe
from nsa_jax.runbook_env import config_from_env
from nsa_jax.rundir.files import MODEL_CONFIG_FILE
from nsa_jax.tools import aot
from nsa_jax.words import count


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def describe_fit(r: dict, cfg, description: str) -> str:
    """The fit-check lines `launch.info --target` prints."""
    n, t, C = r["n_devices"], cfg.train, cfg.parallel.context
    m = r["configured"]
    layout = f" (data {n // C} x seq {C}: each sequence over {C} cards)" if C > 1 else ""
    lines = [
        f"fit on {r['target']} ({description}), {count(n, 'device')}{layout}, strategy {cfg.parallel.strategy}, "
        f"T={t.seq_len}, accumulate {t.accumulate}; jax may use {r['usable_bytes'] / aot.MiB:,.0f} MiB of each "
        + (
            "chip (its HBM)"
            if isinstance(aot.get_target(r["target"]), aot.TpuTarget)
            else "card (XLA_PYTHON_CLIENT_MEM_FRACTION, default 0.75)"
        ),
        f"  as configured: {count(r['configured_rows'], 'row')} per device (train.global_batch={t.global_batch}): "
        f"{m['total'] / aot.MiB:,.0f} MiB per device (arguments {m['argument'] / aot.MiB:,.0f}, temporaries "
        f"{m['temp'] / aot.MiB:,.0f}, outputs not aliased {(m['output'] - m['alias']) / aot.MiB:,.0f}) -> "
        + ("fits" if r["configured_fits"] else "does NOT fit"),
    ]
    if "largest_seq_len" in r:
        T = r["largest_seq_len"]
        if T:
            lines.append(
                f"  longest sequence that fits at this batch: T={T:,} (train.seq_len; within 1/16): "
                f"{r['largest']['total'] / aot.MiB:,.0f} MiB per device"
            )
        else:
            lines.append("  no sequence length fits at this batch: set model.remat=full or use more cards")
        lines.append(
            "  compiled: " + ", ".join(f"T={k:,} -> {v / aot.MiB:,.0f} MiB" for k, v in r["seq_probes"].items())
        )
        return "\n".join(lines)
    b = r["largest_rows"]
    if b:
        lines.append(
            f"  largest micro-batch that fits: {count(b, 'row')} per device (train.global_batch={b * n}): "
            f"{r['largest']['total'] / aot.MiB:,.0f} MiB per device"
        )
    else:
        lines.append("  not even 1 row per device fits: shorten train.seq_len, set model.remat=full, or shard (fsdp)")
    lines.append("  compiled: " + ", ".join(f"{k} -> {v / aot.MiB:,.0f} MiB" for k, v in r["probes"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.info", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config", default=None, help="config name in configs/ or a YAML path (default: $CONFIG, else a100_pcie)"
    )
    add_overrides(parser)
    parser.add_argument(
        "--target",
        default=None,
        help=f"GPU card ({', '.join(aot.TARGETS)}) or TPU slice ({', '.join(aot.TPU_TARGETS)}) to check the step on",
    )
    parser.add_argument(
        "--devices",
        type=int,
        default=None,
        help="cards in all, data x seq (default parallel.num_devices, else parallel.context)",
    )
    args = parser.parse_args(argv)
    if args.target is not None:
        # Compiling for a card runs on this host's CPU: set before jax starts (a GPU-less host's CUDA check fails).
        aot.compile_on_host()
    try:
        name = args.config or config_from_env(os.environ) or "a100_pcie"
        folder = pathlib.Path(name) / MODEL_CONFIG_FILE
        if folder.is_file():  # a model folder (launch.convert's) or any folder holding a saved config.yaml
            cfg = load_config(str(folder), args.overrides, saved=True)
        else:
            cfg = load_config(name, args.overrides)
        if args.target is not None:
            target = aot.get_target(args.target)
            C = cfg.parallel.context
            n = args.devices if args.devices is not None else (cfg.parallel.num_devices or C)
            if isinstance(target, aot.TpuTarget) and args.devices is None:
                n = target.chips  # a slice is checked whole
            if n < 1:
                raise ValueError(f"--devices {n} must be >= 1")
            if isinstance(target, aot.TpuTarget) and n > target.chips:
                raise ValueError(f"--devices {n}: {target.name} has {target.chips} chips")
            if n % C:
                raise ValueError(f"--devices {n} must be a multiple of parallel.context={C} (data x seq)")
            missing = aot.plugin_missing(target.name)
            if missing:
                raise aot.PluginMissing(missing)
    except (ConfigError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(describe(cfg), flush=True)
    if args.target is None:
        return 0

    try:
        on = f"{target.name} on this host ({count(n, 'device')}"
        log(f"compiling the train step for {on}; a minute or more per compile)")
        r = aot.fit_check(cfg, target.name, n, log=log)
    except (aot.PluginMissing, ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(describe_fit(r, cfg, target.description))
    return 0 if r["configured_fits"] else 1


if __name__ == "__main__":
    sys.exit(main())
