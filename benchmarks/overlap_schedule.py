"""Where the compiled step's gradient reductions sit in the schedule: one reduction after the backward
(parallel.overlap_reduce false) against each layer's reduction inside it (true), side by side: dp's
all-reduces, or zero1's reduce-scatters (`--set parallel.strategy=zero1`).

Compiles the config's train step for N cards of a target on this host (nsa_jax/tools/aot.py; jax's CUDA
plugin, the `cuda12` extra) and reads the thunk sequence XLA scheduled: for each all-reduce or
reduce-scatter, its bytes and how many of the backward's compute launches (ops under
`transpose(jvp(...))`, matmuls and fusions) the schedule still runs after it. A reduction with backward
work after it can overlap that work; one after the last backward launch is exposed. Also the compiled
per-device memory of both.

    python -m benchmarks.overlap_schedule [--config a100_pcie] [--target a100-40] [--devices 2] [--json OUT]

Only the schedule is shown here: the exposed time itself needs the cards (benchmarks/gpu_validate.sh).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

from nsa_jax.config import load_config
from nsa_jax.tools import aot, hlo_traffic, xla_dump

COMPUTE = ("gemm", "fusions", "pallas")


def schedule(dump_dir: str) -> dict:
    """The gradient reductions in launch order: [{index, kind, bytes, backward_after}] and the launch count."""
    traffic = hlo_traffic.launch_traffic(dump_dir, xla_dump.read_launches(dump_dir))
    backward = [i for i, t in enumerate(traffic) if t.launch.category in COMPUTE and "transpose(" in (t.op_name or "")]
    rows = []
    for i, t in enumerate(traffic):
        kind = t.launch.kind.lower().replace("-", "").replace("_", "")
        op = next((op for op in ("allreduce", "reducescatter") if op in kind), None)
        if op and "done" not in kind:
            after = sum(b > i for b in backward)
            rows.append({"index": i, "kind": op, "hlo": t.launch.hlo, "bytes": t.bytes, "backward_after": after})
    return {"launches": len(traffic), "backward_launches": len(backward), "all_reduces": rows}


def measure(config: str, target: str, devices: int, sets: list[str]) -> dict:
    out = {}
    for overlap in (False, True):
        cfg = load_config(config, [*sets, f"parallel.overlap_reduce={str(overlap).lower()}"])
        with tempfile.TemporaryDirectory() as dump:
            c = aot.compile_train_step(cfg, target, devices, dump)
            out["overlap" if overlap else "one reduction"] = {"memory": c.memory, **schedule(dump)}
    return out


def print_report(res: dict, meta: dict) -> None:
    print(f"{meta['config']} train step, {meta['devices']} x {meta['target']} (compiled on this host)")
    for name, r in res.items():
        ars = r["all_reduces"]
        exposed = sum(a["bytes"] for a in ars if a["backward_after"] == 0)
        total, kinds = sum(a["bytes"] for a in ars), "/".join(sorted({a["kind"] for a in ars}))
        print(
            f"  {name:>13}: {len(ars)} {kinds} launches, {total / 2**20:,.1f} MiB; {exposed / 2**20:,.1f} MiB "
            f"after the last of {r['backward_launches']} backward launches; per device "
            f"{r['memory']['total'] / 2**20:,.0f} MiB (temporaries {r['memory']['temp'] / 2**20:,.0f})"
        )
        print("      order (launch index: MiB, backward launches still to run): " + ", ".join(
            f"{a['index']}: {a['bytes'] / 2**20:.1f}, {a['backward_after']}" for a in ars[:16]
        ) + (" ..." if len(ars) > 16 else ""))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="a100_pcie")
    p.add_argument("--target", default="a100-40")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not aot.cuda_plugin_available():
        print(f"error: compiling for {args.target} needs jax's CUDA plugin: {aot.INSTALL_HINT}", file=sys.stderr)
        return 2
    aot.compile_on_host()
    res = measure(args.config, args.target, args.devices, args.set)
    meta = {"config": args.config, "target": args.target, "devices": args.devices, "set": args.set}
    print_report(res, meta)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
