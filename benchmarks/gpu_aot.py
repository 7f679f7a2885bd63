"""The GPU program, compiled on this host for A100 / H100 cards that are not here, side by side.

For each `--target` (nsa_jax/tools/aot.py TARGETS: a100-40, a100-80, h100) it compiles,
with XLA's GPU compiler and the Pallas kernels through Triton and ptxas:

* the train step of `--config` (its parallel.strategy, or `--strategy`) on
  `--devices` cards: memory per device (argument, output, alias, temp, total) and
  whether it fits jax's share of the card (XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75);
* the NSA layer's forward+backward at each `--seq-lens` T: temporaries and total;
  a T whose compile fails (e.g. shared memory over the card's limit) is reported;
* every Pallas kernel of those programs: grid, threads per block, shared memory,
  registers and spill bytes (ptxas -v on its PTX) and blocks per SM they allow;
* the step's launches per optimizer step: each launch site of the thunk sequence
  times the trip counts of the loops around it, split into Pallas kernels, gemm
  fusions, other fusions, copy kernels (dynamic(-update)-slice fusions), copy thunks
  (memcpy / offset copies) and collectives;
* what the layer's launches move and compute, per part of the layer (its named scopes:
  nsa_jax/tools/parts.py), with the roofline floor at the card's bandwidth and bf16
  tensor peak (nsa_jax/tools/hlo_traffic.py): where the time outside the Pallas kernels
  can go, before a profile on the card says where it went.

Nothing runs: no GPU is needed, only jax's CUDA plugin (pip install -e ".[cuda12]").
XLA does not autotune without a GPU, so its gemm tiles are defaults; the Pallas
kernels' tiles are the project's own, so their registers are the real card's.

Usage:
  python -m benchmarks.gpu_aot --target a100-80 [--target h100 ...] [--config a100_pcie]
      [--strategy dp] [--devices 2] [--set KEY=VALUE] [--seq-lens 2k,8k,32k,64k,128k]
      [--skip-step] [--skip-layer] [--dump-dir DIR] [--json out.json]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from benchmarks.common import config_meta, fmt_mib, log, parse_ints, short_error, write_json
from launch.cli import Parser, UsageError
from nsa_jax.config import ConfigError, load_config
from nsa_jax.kernels import cudnn_fits, plan_kernels
from nsa_jax.tools import aot, hlo_traffic, xla_dump

DEFAULT_SEQ_LENS = "2k,8k,32k,64k,128k"


def measure_step(cfg, target: str, n_devices: int, dump_dir: str) -> dict:
    c = aot.compile_train_step(cfg, target, n_devices, dump_dir)
    launches = xla_dump.read_launches(dump_dir)
    usable = aot.get_target(target).usable_bytes()
    return {
        "memory": c.memory,
        "usable_bytes": usable,
        "fits": c.memory["total"] <= usable,
        "compile_s": c.lower_s + c.compile_s,
        "launches": xla_dump.launch_counts(launches),
        "loop_trip_counts": xla_dump.loop_trip_counts(dump_dir),
        "kernels": with_occupancy(xla_dump.pallas_kernels(dump_dir, launches), target),
    }


def measure_layer(cfg, target: str, seq_len: int, dump_dir: str) -> dict:
    try:
        c = aot.compile_layer(cfg, target, seq_len, dump_dir=dump_dir)
    except aot.PluginMissing:
        raise
    except Exception as e:  # a kernel over the card's limits: reported, the other T go on
        return {"seq_len": seq_len, "error": short_error(e)}
    launches = xla_dump.read_launches(dump_dir)
    t = aot.get_target(target)
    traffic = hlo_traffic.launch_traffic(dump_dir, launches)
    return {
        "seq_len": seq_len,
        "memory": c.memory,
        "fits": c.memory["total"] <= t.usable_bytes(),
        "compile_s": c.lower_s + c.compile_s,
        "launches": xla_dump.launch_counts(launches),
        "kernels": with_occupancy(xla_dump.pallas_kernels(dump_dir, launches), target),
        "traffic": hlo_traffic.by_part(traffic, t.memory_bandwidth, t.bf16_tensor_flops),
        "top_launches": hlo_traffic.top_launches(traffic, t.memory_bandwidth, t.bf16_tensor_flops, 8),
    }


def with_occupancy(rows: list[dict], target: str) -> list[dict]:
    """Kernel rows with `blocks_per_sm`: blocks one SM holds at once by registers, threads and shared memory."""
    t = aot.get_target(target)
    for k in rows:
        if "registers" in k and k.get("threads"):
            k["blocks_per_sm"] = xla_dump.occupancy_blocks(k["registers"], k["threads"], k["shared_memory"] or 0, t)
    return rows


def measure(opts, cfg, seq_lens: list[int], dump_root: str) -> dict:
    out = {}
    for name in opts.target:
        t = aot.get_target(name)
        row: dict = {"target": name, "device": t.description, "arch": t.arch, "memory_bytes": t.device_memory_size}
        if not opts.skip_step:
            with aot.heartbeat(log, f"{name}: train step on {opts.devices} device(s)"):
                row["step"] = measure_step(cfg, name, opts.devices, f"{dump_root}/{name}/step")
        row["layer"] = []
        if not opts.skip_layer:
            for T in seq_lens:
                with aot.heartbeat(log, f"{name}: layer fwd+bwd T={T}"):
                    row["layer"].append(measure_layer(cfg, name, T, f"{dump_root}/{name}/layer_{T}"))
        out[name] = row
    return out


def _cells(values: list[str], width: int) -> str:
    return " ".join(f"{v:>{width}}" for v in values)


def kernel_rows(r: dict) -> list[tuple[str, dict]]:
    """(program, kernel row) of every Pallas kernel of one target's programs."""
    rows = [("step", k) for k in r.get("step", {}).get("kernels", [])]
    for layer in r["layer"]:
        rows += [(f"T={layer['seq_len']}", k) for k in layer.get("kernels", [])]
    return rows


def worst(r: dict) -> dict:
    """The kernel with the most registers and the one with the most spill bytes over a target's programs."""
    rows = kernel_rows(r)
    if not rows:
        return {}
    regs = max(rows, key=lambda pk: pk[1].get("registers", 0))
    spill = max(rows, key=lambda pk: pk[1].get("spill_stores", 0) + pk[1].get("spill_loads", 0))
    return {
        "registers": regs[1].get("registers"),
        "registers_kernel": f"{regs[1]['name']} ({regs[0]})",
        "spill_stores": spill[1].get("spill_stores", 0),
        "spill_loads": spill[1].get("spill_loads", 0),
        "spill_kernel": f"{spill[1]['name']} ({spill[0]})",
        "kernels_spilling": sorted({f"{k['name']} ({p})" for p, k in rows if k.get("spill_stores")}),
    }


def print_report(results: dict, meta: dict) -> None:
    names = list(results)
    w = max(16, *(len(n) for n in names))
    print(
        f"config {meta['config']} ({meta['strategy']}, {meta['devices']} device(s), T={meta['seq_len']}, "
        f"micro-batch {meta['global_batch']} x accumulate {meta['accumulate']}), {meta['dtype']}, "
        "kernels cmp/slc/win " + "/".join(meta["kernels"][b] for b in ("cmp", "slc", "win"))
    )
    print(f"{'':<26}" + _cells(names, w))
    print(f"{'card':<26}" + _cells([results[n]["device"][:w] for n in names], w))
    print(f"{'arch':<26}" + _cells([results[n]["arch"] for n in names], w))

    if any("step" in results[n] for n in names):
        print("\ntrain step, memory per device (MiB):")
        for key in ("argument", "output", "alias", "temp", "total"):
            print(f"  {key:<24}" + _cells([fmt_mib(results[n]["step"]["memory"][key], w) for n in names], w))
        print(
            f"  {'jax usable (MiB)':<24}" + _cells([fmt_mib(results[n]["step"]["usable_bytes"], w) for n in names], w)
        )
        print(f"  {'fits':<24}" + _cells(["yes" if results[n]["step"]["fits"] else "NO" for n in names], w))
        print("\nlaunches per optimizer step (static count x loop trip counts):")
        for key in (*xla_dump.CATEGORIES, "kernels", "total"):
            print(f"  {key:<24}" + _cells([str(results[n]["step"]["launches"][key]) for n in names], w))
        trips = results[names[0]]["step"]["loop_trip_counts"]
        print(f"  loops (trip counts, {names[0]}): " + ", ".join(f"{k} x{v}" for k, v in sorted(trips.items())))

    if any(results[n]["layer"] for n in names):
        print("\nNSA layer forward+backward (B=1), temporaries / total MiB:")
        for i, first in enumerate(results[names[0]]["layer"]):
            cells = []
            for n in names:
                layer = results[n]["layer"][i]
                if "error" in layer:
                    cells.append("error")
                else:
                    m = layer["memory"]
                    cells.append(f"{m['temp'] / aot.MiB:.0f} / {m['total'] / aot.MiB:.0f}")
            print(f"  T={first['seq_len']:<22}" + _cells(cells, w))
        for n in names:
            for layer in results[n]["layer"]:
                if "error" in layer:
                    print(f"  {n} T={layer['seq_len']}: {layer['error']}")

    print_traffic(results)

    print(
        "\nPallas kernels: grid and threads per block (first card); per card: registers, spill bytes (stores + "
        "loads), shared memory per block (KiB), blocks per SM (by registers, threads and shared memory)"
    )
    rows0 = kernel_rows(results[names[0]])
    by_key = {n: {(p, k["name"]): k for p, k in kernel_rows(results[n])} for n in names}
    print(f"  {'program':<8} {'kernel':<28} {'grid':>14} {'thr':>4} " + _cells(names, w))
    print(f"  {'':<8} {'':<28} {'':>14} {'':>4} " + _cells([f"{'reg':>3} {'spill':>5} {'smem':>4} b"] * len(names), w))
    for program, k in rows0:
        cells = []
        for n in names:
            o = by_key[n].get((program, k["name"]))
            if o is None or "registers" not in o:
                cells.append("-")
            else:
                spill = o.get("spill_stores", 0) + o.get("spill_loads", 0)
                smem = f"{(o['shared_memory'] or 0) / 1024:.0f}K"
                cells.append(f"{o['registers']:>3} {spill:>5} {smem:>4} {o.get('blocks_per_sm', '-')}")
        grid = "x".join(map(str, k["grid"]))
        print(f"  {program:<8} {k['name']:<28} {grid:>14} {k['threads']:>4} " + _cells(cells, w))
    print()
    for n in names:
        wst = results[n].get("worst") or {}
        if wst:
            print(
                f"{n}: most registers {wst['registers']} ({wst['registers_kernel']}); most spills "
                f"{wst['spill_stores']} B stores / {wst['spill_loads']} B loads ({wst['spill_kernel']}); "
                f"kernels that spill: {', '.join(wst['kernels_spilling']) or 'none'}"
            )


def print_traffic(results: dict) -> None:
    """Per card, the layer at its longest compiled T: what each part moves and its roofline floor."""
    for name, r in results.items():
        layers = [x for x in r["layer"] if "traffic" in x]
        if not layers:
            continue
        layer = layers[-1]
        t = aot.get_target(name)
        print(
            f"\n{name}: the layer's fwd+bwd at T={layer['seq_len']}, per part: launches, MiB read + written, GFLOP, "
            f"floor ms = max(bytes / {t.memory_bandwidth / 1e12:.2f} TB/s, flops / {t.bf16_tensor_flops / 1e12:.0f} "
            "TFLOP/s) per launch (hlo_traffic.py: a Pallas kernel's bytes are its operands and result only)"
        )
        print(f"  {'part':<26} {'runs as':<8} {'launches':>8} {'MiB':>9} {'GFLOP':>8} {'floor ms':>9}")
        totals = {False: 0.0, True: 0.0}
        for row in layer["traffic"]:
            totals[row["pallas"]] += row["floor_ms"]
            print(
                f"  {row['part']:<26} {'Pallas' if row['pallas'] else 'XLA':<8} {row['launches']:>8} "
                f"{row['bytes'] / aot.MiB:>9.0f} {row['flops'] / 1e9:>8.1f} {row['floor_ms']:>9.3f}"
            )
        print(f"  floor: XLA's launches {totals[False]:.2f} ms, the Pallas kernels' operands {totals[True]:.2f} ms")
        print("  the XLA launches with the largest floors (ms, runs, MiB, part, instruction):")
        for x in layer["top_launches"][:5]:
            print(
                f"    {x['floor_ms']:.3f} ms  x{x['count']:<4} {x['bytes'] / aot.MiB:>7.0f} MiB  {x['part']:<24} "
                f"{x['hlo']}"
            )


def main(argv=None) -> int:
    aot.compile_on_host()  # before jax starts: a GPU-less host's CUDA plugin fails its check otherwise
    parser = Parser(description=__doc__.splitlines()[0], in_process=argv is not None)
    parser.add_argument("--target", action="append", default=None, choices=list(aot.TARGETS), help="repeatable")
    parser.add_argument("--config", default="a100_pcie", help="config name or YAML path")
    parser.add_argument("--strategy", default=None, help="parallel.strategy (default: the config's)")
    parser.add_argument("--devices", type=int, default=2, help="cards on the data mesh for the train step")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--seq-lens", default=DEFAULT_SEQ_LENS, help="layer T list, e.g. 2k,8k,64k")
    parser.add_argument("--skip-step", action="store_true", help="no train step")
    parser.add_argument("--skip-layer", action="store_true", help="no layer compiles")
    parser.add_argument("--dump-dir", default=None, help="keep the XLA dumps here (default: a temporary folder)")
    parser.add_argument("--json", default=None, help="write {meta, rows} to this JSON file")
    try:
        opts = parser.parse_args(argv)
        opts.target = opts.target or ["a100-80"]
        overrides = list(opts.set) + ([f"parallel.strategy={opts.strategy}"] if opts.strategy else [])
        cfg = load_config(opts.config, overrides)
        seq_lens = parse_ints(opts.seq_lens)
        if opts.devices < 1:
            raise UsageError(f"--devices {opts.devices} must be >= 1")
        with tempfile.TemporaryDirectory(prefix="gpu_aot_") as tmp:
            results = measure(opts, cfg, seq_lens, opts.dump_dir or tmp)
    except aot.PluginMissing as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (UsageError, ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for r in results.values():
        r["worst"] = worst(r)
    meta = dict(
        **config_meta(opts.config, overrides, cfg.train),
        strategy=cfg.parallel.strategy,
        devices=opts.devices,
        dtype=cfg.model.dtype,
        seq_lens=seq_lens,
        # What each branch runs on the cards (the GPU plan at the step's T; the selection kernel follows T).
        kernels=plan_kernels(cfg.model.nsa, cfg.train.seq_len, "gpu", cudnn_ok=cudnn_fits(cfg.model)).describe(),
        note="memory from memory_analysis() per device; total = argument + output + temp - alias; "
        "launches = static thunks x known_trip_count of enclosing loops; kernels = pallas + gemm + fusions + copies",
    )
    print_report(results, meta)
    if opts.json:
        Path(opts.json).parent.mkdir(parents=True, exist_ok=True)
        write_json(opts.json, meta, list(results.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
