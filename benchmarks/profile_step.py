"""Where the time goes: a jax.profiler trace of a train step or of one NSA layer, summed per op.

Traces `--steps` calls of a compiled program with jax.profiler (the trace stays
under --trace-dir for TensorBoard's profile plugin or Perfetto), reads back the
Perfetto JSON it writes, and adds up the time of every XLA instruction (fusion,
dot, gather, ...) that ran. Each instruction is named with the JAX operation that
emitted it (the HLO `op_name` metadata, Flax module path included), and the
instructions are also summed per part of the model (nsa_jax/tools/parts.py: the NSA layer's
named scopes, selection, compression, window, projections, gates, ...; MLP, embedding/head, optimizer):

    python -m benchmarks.profile_step --config cpu_tiny --steps 3
    python -m benchmarks.profile_step --layer --config a100_pcie --seq-len 32768 --steps 1
    python -m benchmarks.profile_step --layer --backward --seq-len 8192 --top 15 --json prof.json

On a GPU the time is the kernels' on the device tracks, each attributed to the
instruction its `hlo_op` trace argument names (Pallas kernels to their custom-call),
so "op ms" is device time, comparable with the wall time per step; the gap is time
the device sat idle (launch and host overhead). On the CPU backend the
instructions of one step run one after another on the calling thread or fan out
over the intra-op pool; "op ms" is their summed duration per step, so it can
exceed the step's wall time when work runs in parallel. The share column is of the summed op time.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import re
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import add_config_args, print_header, write_json
from nsa_jax.config import load_config
from nsa_jax.mesh import make_mesh, put_batch
from nsa_jax.nsa.layer import NSAAttention
from nsa_jax.report.traces import device_tracks, find_trace, read_trace
from nsa_jax.step.step import create_state, make_train_step
from nsa_jax.step.strategies import make_plan
from nsa_jax.tools.hlo_traffic import parse_module
from nsa_jax.tools.parts import part_of

# Instructions that only contain others: their time is their children's.
CONTAINERS = ("while", "conditional", "call")
# What an instruction does, from the opcodes inside it (first match wins).
KINDS = (
    ("matmul", ("dot", "convolution", "custom-call")),
    ("gather/scatter", ("gather", "scatter")),
    ("transpose/copy", ("transpose", "copy")),
    ("reduce", ("reduce", "reduce-window")),
    ("update slice", ("dynamic-update-slice",)),
)


def instruction_sources(hlo_text: str) -> dict[str, dict[str, str]]:
    """HLO instruction name -> {op_name, source 'file:line', opcode, kind} from the compiled module."""
    comps = parse_module(hlo_text)
    opcodes = {comp: {i.opcode for i in body.values()} for comp, body in comps.items()}
    instrs = {}
    for body in comps.values():
        for ins in body.values():
            inside = {ins.opcode} | (opcodes.get(ins.calls, set()) if ins.opcode == "fusion" else set())
            if ins.opcode == "fusion" and "ynn" in "".join(inside):
                inside.add("dot")
            kind = next((k for k, ops in KINDS if inside & set(ops)), "elementwise")
            instrs[ins.name] = {"op_name": ins.op_name, "source": ins.source, "opcode": ins.opcode, "kind": kind}
    return instrs


def cudnn_part(hlo_text: str) -> str | None:
    """The part of the model (tools/parts.py) that every cuDNN custom call of the module sits in, or None
    (none, or several parts). Inside a CUDA graph a cuDNN kernel names no instruction, and its CUDA name
    ('cudnn_generated_fort_native_sdpa_...') no scope; in the NSA layer only the compressed branch calls
    cuDNN (kernels/cudnn.py), so a layer's trace can put those kernels where they belong."""
    found = {
        part_of(ins.op_name)
        for body in parse_module(hlo_text).values()
        for ins in body.values()
        if ins.opcode == "custom-call" and "cudnn" in ins.target.lower()
    }
    return found.pop() if len(found) == 1 else None


def trace_events(trace_dir: pathlib.Path) -> list[dict]:
    """The events of the newest trace under `trace_dir` (report/traces.py reads it)."""
    path = find_trace(trace_dir)
    if path is None:
        raise SystemExit(f"error: no perfetto_trace.json.gz under {trace_dir}; the profiler wrote nothing")
    return read_trace(path)


def kernel_info(kernel: str) -> dict[str, str]:
    """What a device kernel no instruction claims is, from its CUDA name alone."""
    name = kernel.lower()
    if name.startswith("nsa_"):
        kind = "pallas"
    elif any(k in name for k in ("gemm", "nvjet", "cutlass", "xmma", "cublas")):
        kind = "matmul"
    elif any(k in name for k in ("scatter", "gather")):
        kind = "gather/scatter"
    elif any(k in name for k in ("memcpy", "memset", "concatenate", "transpose", "copy")):
        kind = "transpose/copy"
    elif "reduce" in name:
        kind = "reduce"
    elif "fusion" in name:
        kind = "elementwise"
    else:
        kind = "kernel"
    return {"op_name": "", "source": "", "opcode": "kernel", "kind": kind}


def instruction_times(events: list[dict], sources: dict) -> tuple[collections.Counter, collections.Counter, str]:
    """(ms per HLO instruction, calls per instruction, where the time was read) from trace events.

    On a GPU the time that counts is the kernels' on the device tracks; a kernel's
    event is named after the CUDA/Triton kernel, and its `hlo_op` argument names the
    instruction that launched it (several kernels may share one). The host tracks
    then carry only the launch of each thunk, so they are ignored. Where XLA replays
    a stretch of the program as one CUDA graph (a command buffer, the default from
    jax 0.11) every kernel in it carries the command buffer as its `hlo_op`; such a
    kernel is matched to the fusion it is named after (XLA names a fusion's kernel
    after the instruction, '.' -> '_'), and where none matches (cuBLAS, Pallas) it is
    counted under its own name as `kernel:<name>`. On the CPU the instruction events
    themselves, named after the instruction, are the work.
    """
    per_instr, calls = collections.Counter(), collections.Counter()
    devices = device_tracks(events)
    by_kernel_name = {re.sub(r"[.\-]", "_", n): n for n in sources}
    for e in events:
        if e.get("ph") != "X":
            continue
        kernel = e.get("name")
        if devices:
            if e.get("pid") not in devices:
                continue
            hlo_op = (e.get("args") or {}).get("hlo_op")
            if hlo_op is None:  # no instruction launched it (a driver copy, say)
                continue
            if hlo_op in sources:
                name = hlo_op
            elif kernel in sources or by_kernel_name.get(kernel) in sources:
                name = kernel if kernel in sources else by_kernel_name[kernel]
            else:
                name = f"kernel:{kernel}"
        else:
            name = kernel
        if name.startswith("kernel:") or (name in sources and sources[name]["opcode"] not in CONTAINERS):
            per_instr[name] += float(e.get("dur", 0.0)) / 1e3  # us -> ms
            calls[name] += 1
    return per_instr, calls, "device kernels" if devices else "host instruction events"


def profile(run_once, compiled_text: str, steps: int, trace_dir: pathlib.Path) -> dict:
    """Traces `steps` calls of run_once (which blocks); returns per-instruction totals per step."""
    sources = instruction_sources(compiled_text)
    t0 = time.perf_counter()
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        for _ in range(steps):
            run_once()
    wall_s = (time.perf_counter() - t0) / steps
    return summarise(trace_events(trace_dir), sources, steps, wall_s, cudnn_part(compiled_text))


def summarise(events: list[dict], sources: dict, steps: int, wall_s: float | None, cudnn: str | None = None) -> dict:
    """Per-instruction (or per-kernel) totals per step, by part and by kind, from trace events; `cudnn`:
    the part that kernels named cudnn* without an instruction belong to (cudnn_part)."""
    per_instr, calls, read_from = instruction_times(events, sources)
    if not per_instr:
        raise SystemExit("error: the trace has no XLA instruction events; this jax/XLA build does not emit them")
    total = sum(per_instr.values())
    rows = []
    for name, ms in per_instr.most_common():
        info = sources.get(name) or kernel_info(name.removeprefix("kernel:"))
        rows.append(
            {
                "instruction": name,
                "ms_per_step": ms / steps,
                "share": ms / total,
                "calls_per_step": calls[name] / steps,
                "op_name": info["op_name"],
                "source": info["source"],
                "kind": info["kind"],
                "part": cudnn
                if cudnn and not info["op_name"] and "cudnn" in name.lower()
                else part_of(info["op_name"] or name),
            }
        )
    per_step = total / steps

    def summed(key):
        acc = collections.Counter()
        for r in rows:
            acc[r[key]] += r["ms_per_step"]
        return [{key: k, "ms_per_step": ms, "share": ms / per_step} for k, ms in acc.most_common()]

    return {
        "read_from": read_from,
        "wall_ms_per_step": None if wall_s is None else 1e3 * wall_s,
        "op_ms_per_step": per_step,
        "rows": rows,
        "parts": summed("part"),
        "kinds": summed("kind"),
    }


def short_op(op_name: str, width: int = 90) -> str:
    # Drop the jit(...)/ wrappers that every op shares; keep the informative tail.
    parts = [p for p in op_name.split("/") if not p.startswith("jit(")]
    text = "/".join(parts)
    return text if len(text) <= width else "..." + text[-(width - 3) :]


def train_step_program(cfg):
    mesh = make_mesh(cfg)
    plan = make_plan(cfg, mesh)
    state = create_state(plan)
    train_step = make_train_step(plan)
    A, B, T = cfg.train.accumulate, cfg.train.global_batch, cfg.train.seq_len
    rng = np.random.default_rng(0)
    tokens = put_batch(rng.integers(0, cfg.model.vocab_size, (A, B, T + 1), dtype=np.int32), mesh)
    compiled = train_step.lower(state, tokens).compile()
    box = {"state": state}

    def run_once():
        box["state"], metrics = compiled(box["state"], tokens)
        jax.block_until_ready(metrics["loss"])

    return compiled, run_once, f"train step: {A}x{B} rows of {T} tokens"


def layer_program(cfg, seq_len: int, backward: bool):
    m = cfg.model
    module = NSAAttention(m)
    dtype = jnp.dtype(m.dtype)
    x_BxTxD = (0.5 * jax.random.normal(jax.random.key(0), (1, seq_len, m.d_model))).astype(dtype)
    params = module.init(jax.random.key(1), x_BxTxD[:, :256])["params"]

    def forward(p, x):
        return module.apply({"params": p}, x)

    if backward:

        def fn(p, x):
            out, vjp = jax.vjp(forward, p, x)
            return vjp(jnp.ones_like(out))
    else:
        fn = forward
    compiled = jax.jit(fn).lower(params, x_BxTxD).compile()

    def run_once():
        jax.block_until_ready(compiled(params, x_BxTxD))

    what = "forward+backward" if backward else "forward"
    return compiled, run_once, f"one NSA layer, {what}, T={seq_len}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(ap, "cpu_tiny")
    ap.add_argument("--layer", action="store_true", help="profile one NSA attention layer instead of a train step")
    ap.add_argument("--seq-len", type=int, default=None, help="--layer: sequence length (default train.seq_len)")
    ap.add_argument("--backward", action="store_true", help="--layer: forward+backward")
    ap.add_argument("--steps", type=int, default=3, help="traced calls (after one untimed call)")
    ap.add_argument("--top", type=int, default=12, help="instructions to list")
    ap.add_argument("--trace-dir", default=None, help="where the trace goes (default: a temporary folder)")
    ap.add_argument(
        "--read-trace",
        default=None,
        metavar="DIR",
        help="summarise the device kernels of a trace written earlier (by this script's --trace-dir, on any "
        "machine) by kernel name, without compiling or running anything; --steps = the calls it traced",
    )
    opts = ap.parse_args(argv)
    if opts.steps < 1:
        ap.error("--steps must be >= 1")

    env = print_header("profile: time per XLA instruction from a jax.profiler trace")
    if opts.read_trace:
        trace_dir = pathlib.Path(opts.read_trace)
        if not trace_dir.is_dir():
            raise SystemExit(f"error: --read-trace {trace_dir}: no such folder; give the --trace-dir of a profile run")
        res = summarise(trace_events(trace_dir), {}, opts.steps, None)
        source, what, impl = "trace", f"the kernels under {trace_dir}", "as traced"
    else:
        cfg = load_config(opts.config, opts.set)
        if opts.layer:
            compiled, run_once, what = layer_program(cfg, opts.seq_len or cfg.train.seq_len, opts.backward)
        else:
            compiled, run_once, what = train_step_program(cfg)
        run_once()  # warm: first-call allocations stay out of the trace
        trace_dir = pathlib.Path(opts.trace_dir or tempfile.mkdtemp(prefix="nsa_profile_"))
        res = profile(run_once, compiled.as_text(), opts.steps, trace_dir)
        source, impl = opts.config, cfg.model.nsa.attention_impl

    wall = "-" if res["wall_ms_per_step"] is None else f"{res['wall_ms_per_step']:.1f}"
    print(f"{source}, {what}, attention_impl {impl}, {opts.steps} traced calls")
    print(f"wall {wall} ms per call (traced); summed op time {res['op_ms_per_step']:.1f} ms ({res['read_from']})")
    for key in ("part", "kind"):
        print(f"\n{'by ' + key:<16} {'op ms':>9} {'share':>6}")
        for p in res[key + "s"]:
            print(f"{p[key]:<16} {p['ms_per_step']:>9.1f} {100 * p['share']:>5.1f}%")
    print(f"\n{'op ms':>9} {'share':>6} {'calls':>6}  {'instruction':<40} {'kind':<14} {'part':<12} source / JAX op")
    for r in res["rows"][: opts.top]:
        print(
            f"{r['ms_per_step']:>9.1f} {100 * r['share']:>5.1f}% {r['calls_per_step']:>6.0f}  "
            f"{r['instruction'][:40]:<40} {r['kind']:<14} {r['part']:<12} {r['source']}  "
            f"{short_op(r['op_name'], 70)}"
        )
    print(f"\ntrace: {trace_dir}")
    meta = dict(
        env,
        config=opts.config,
        overrides=opts.set,
        what=what,
        steps=opts.steps,
        trace_dir=str(trace_dir),
        wall_ms_per_step=res["wall_ms_per_step"],
        op_ms_per_step=res["op_ms_per_step"],
        read_from=res["read_from"],
        parts=res["parts"],
        kinds=res["kinds"],
    )
    write_json(opts.json, meta, res["rows"])


if __name__ == "__main__":
    main()
