"""What the NSA layer's forward+backward holds once lowered for CUDA, read from its StableHLO.

Exports `NSAAttention` (the model's layer: projections, compression MLPs, the three
branches, gates) forward+backward w.r.t. parameters and input with
`jax.export(..., platforms=["cuda"])` (no GPU needed: shapes only, nothing runs)
and reads the module text:

* the largest tensor type anywhere in the module (shape, dtype, bytes) and the
  next largest distinct ones (`--top`);
* the per-query score tensors: any tensor with an axis of T and an axis of
  ceil(T/lp) (block scores) or of T_cmp (compressed-attention probabilities);
* the number of kernel custom calls (Pallas/Triton kernels) and of any other
  custom call, by target;
* a fingerprint of the whole program, Triton kernels included: a kernel refactor
  that leaves it unchanged compiles to the same GPU program.

Usage:
  python -m benchmarks.export_report [--seq-len 65536] [--config a100_pcie]
      [--impl pallas|xla|auto] [--dtype bfloat16|float32] [--batch 1] [--set KEY=VALUE]
      [--top 5] [--json out.json] [--max-tensor-mib MiB]

Defaults: the production shape (a100_pcie: B=1, 12 query heads, 2 KV heads, head
dim 64, l=32, d=16, lp=64, n=16, w=512) at T=65536, bf16, attention_impl=pallas.
With `--max-tensor-mib` the exit status is 1 when the largest tensor is above it.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from collections import Counter
from pathlib import Path

import jax

from benchmarks.common import add_config_args
from launch.cli import Parser, UsageError
from nsa_jax.config import ConfigError, load_config
from nsa_jax.kernels.xla import num_compressed
from nsa_jax.tools.aot import TRITON_TARGET, export_for_cuda, layer_forward_backward

MiB = 1024 * 1024
# Element widths of the StableHLO types a layer uses (a predicate is stored as a byte).
_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "i64": 8, "ui64": 8, "i32": 4, "ui32": 4}
_BYTES.update({"i16": 2, "ui16": 2, "i8": 1, "ui8": 1, "i1": 1})
_TENSOR = re.compile(r"tensor<((?:\d+x)*)([a-z]+\d+)>")
_CUSTOM_CALL = re.compile(r"stablehlo\.custom_call @([\w$.\-]+)")


def tensor_types(text: str) -> list[dict]:
    """Distinct tensor types of a StableHLO module text, largest first: shape, dtype, elements, bytes."""
    seen = {}
    for dims, dtype in _TENSOR.findall(text):
        if dtype not in _BYTES:
            continue
        shape = tuple(int(x) for x in dims.split("x") if x)
        elements = 1
        for x in shape:
            elements *= x
        seen[(shape, dtype)] = {
            "shape": list(shape),
            "dtype": dtype,
            "elements": elements,
            "bytes": elements * _BYTES[dtype],
        }
    return sorted(seen.values(), key=lambda r: (-r["bytes"], -r["elements"], r["dtype"]))


def custom_calls(text: str) -> Counter:
    """Custom-call targets of the module text and how often each is called."""
    return Counter(_CUSTOM_CALL.findall(text))


def fingerprint(text: str) -> str:
    """sha256 (16 hex digits) of a module text without its source locations.

    The Triton kernels travel inside the module (their IR in each custom call's
    backend_config), so two exports with the same fingerprint are the same GPU
    program: a refactor that keeps it has changed nothing a GPU could time.
    """
    lines = [re.sub(r"loc\([^\n]*?\)", "", line) for line in text.splitlines() if not line.startswith("#loc")]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def export_layer_text(cfg, seq_len: int, batch: int) -> str:
    """StableHLO text of the layer's forward+backward exported for CUDA (kernels compiled, not interpreted).

    Tracebacks are kept out of the locations, so the text does not depend on line numbers.
    """
    forward_backward, args = layer_forward_backward(cfg, seq_len, batch)

    limit = jax.config.jax_traceback_in_locations_limit
    jax.config.update("jax_traceback_in_locations_limit", 0)
    try:
        exported = export_for_cuda(forward_backward, *args)
    finally:
        jax.config.update("jax_traceback_in_locations_limit", limit)
    return exported.mlir_module()


def fmt_tensor(r: dict) -> str:
    return f"{'x'.join(map(str, r['shape']))}x{r['dtype']} ({r['bytes'] / MiB:.1f} MiB, {r['bytes']} bytes)"


def report(opts) -> dict:
    overrides = [f"model.dtype={opts.dtype}", f"model.nsa.attention_impl={opts.impl}", *opts.set]
    cfg = load_config(opts.config, overrides).model
    a = cfg.nsa
    if opts.seq_len < max(a.l, a.lp):
        raise UsageError(f"--seq-len {opts.seq_len} must be at least l={a.l} and lp={a.lp}")
    if opts.batch < 1:
        raise UsageError(f"--batch {opts.batch} must be >= 1")
    text = export_layer_text(cfg, opts.seq_len, opts.batch)
    tensors = tensor_types(text)
    calls = custom_calls(text)
    per_query = {-(-opts.seq_len // a.lp), num_compressed(opts.seq_len, a.l, a.d)}
    scores = [r for r in tensors if opts.seq_len in r["shape"] and per_query & set(r["shape"]) - {opts.seq_len}]
    return {
        "config": opts.config,
        "overrides": overrides,
        "seq_len": opts.seq_len,
        "batch": opts.batch,
        "shape": dict(
            n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, l=a.l, d=a.d, lp=a.lp, n=a.n, w=a.w
        ),
        "largest": tensors[0] if tensors else None,
        "top": tensors[: opts.top],
        "score_tensors": scores,
        "kernel_custom_calls": calls.get(TRITON_TARGET, 0),
        "other_custom_calls": {k: v for k, v in calls.items() if k != TRITON_TARGET},
        "module_chars": len(text),
        "fingerprint": fingerprint(text),
    }


def print_report(r: dict) -> None:
    s = r["shape"]
    print(
        f"NSA layer forward+backward exported for cuda: config {r['config']}, T={r['seq_len']}, B={r['batch']}, "
        f"H={s['n_heads']} K={s['n_kv_heads']} D={s['head_dim']} l={s['l']} d={s['d']} lp={s['lp']} n={s['n']} "
        f"w={s['w']} ({', '.join(r['overrides'])})"
    )
    print(f"largest tensor: {fmt_tensor(r['largest']) if r['largest'] else '-'}")
    print(f"kernel custom calls ({TRITON_TARGET}): {r['kernel_custom_calls']}")
    print(f"fingerprint (the GPU program, kernels included; equal = nothing changed): {r['fingerprint']}")
    others = ", ".join(f"{k} x{v}" for k, v in sorted(r["other_custom_calls"].items())) or "none"
    print(f"other custom calls: {others}")
    print(f"score tensors (an axis of T and one of ceil(T/lp) or T_cmp): {len(r['score_tensors'])}")
    for t in r["score_tensors"]:
        print(f"  {fmt_tensor(t)}")
    print(f"largest {len(r['top'])} distinct tensor types:")
    for t in r["top"]:
        print(f"  {fmt_tensor(t)}")


def main(argv=None) -> int:
    parser = Parser(description=__doc__.splitlines()[0], in_process=argv is not None)
    add_config_args(parser, "a100_pcie", json=False)
    parser.add_argument("--seq-len", type=int, default=65536)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--impl", default="pallas", choices=("pallas", "xla", "auto"), help="model.nsa.attention_impl")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--top", type=int, default=5, help="how many of the largest tensor types to list")
    parser.add_argument("--json", default=None, help="write the report to this JSON file")
    parser.add_argument("--max-tensor-mib", type=float, default=None, help="exit 1 when the largest tensor is above")
    try:
        opts = parser.parse_args(argv)
        r = report(opts)
    except (UsageError, ConfigError, ValueError) as e:  # flags, config, a shape the kernels refuse
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_report(r)
    if opts.json:
        Path(opts.json).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.json).write_text(json.dumps(r, indent=2))
        print(f"wrote {opts.json}")
    if opts.max_tensor_mib is not None and r["largest"] and r["largest"]["bytes"] > opts.max_tensor_mib * MiB:
        print(f"largest tensor above --max-tensor-mib {opts.max_tensor_mib:g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
