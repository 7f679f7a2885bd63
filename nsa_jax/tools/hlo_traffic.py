"""What each launch of a compiled GPU program moves and computes, read from its optimized HLO.

A deviceless first look at where a program's time can go, before a GPU profile (benchmarks/profile_step.py)
says where it went: for every launch of the program (xla_dump.read_launches, loop trip counts included),
* bytes: what the launch reads and writes if it touches each operand and its result once: the operands'
  and the result's arrays, except that an operand a fusion only slices (slice, dynamic-slice, gather)
  counts at the slices' size and an in-place update (a dynamic-update-slice root) writes only its update;
* flops: 2 x the products of the dots inside it (gemm fusions, cuBLAS calls);
* part: the part of the model its op_name names (tools/parts.py).

`by_part` sums them per part and, at a card's memory bandwidth and tensor-core peak, gives each launch's
roofline floor, max(bytes / bandwidth, flops / peak): the time no kernel can beat. A Pallas kernel's bytes
are its operands and result only (a flash kernel reads K/V many times over), so for kernels the floor is
loose; XLA's own fusions stream their operands once, so for them it is close once they are large; small
launches cost their launch latency instead, which the launch counts show. Plain text parsing: no jax.
"""

from __future__ import annotations

import dataclasses
import re

from nsa_jax.tools import xla_dump
from nsa_jax.tools.parts import PARTS, part_of

_HEADER = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s+\((.*)\)\s+->\s+.*\{\s*$")
_DEF = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*(.+?)\s([a-z][\w\-]*)\((.*)$")
_OPERAND = re.compile(r"%([\w.\-]+)")
_CALLS = re.compile(r"calls=\{?%([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_SOURCE = re.compile(r'source_file="([^"]*)"\s+source_line=(\d+)')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_CONTRACT = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_DIMS = re.compile(r"\[([\d,]*)\]")
# Ops that read only part of an operand: inside a fusion, such an operand counts at what they read.
_PARTIAL_READS = {"slice", "dynamic-slice", "gather"}


@dataclasses.dataclass
class Instr:
    name: str
    shape: str  # result shape text (a tuple lists several arrays)
    opcode: str
    operands: list[str]
    calls: str
    op_name: str
    root: bool
    contracting: list[int]
    source: str  # 'file.py:line' where the module names it inline, else ''
    target: str = ""  # a custom-call's custom_call_target (cuDNN's, a Pallas kernel's), else ''


def _split_call(rest: str) -> tuple[str, str]:
    """(the operand list, the attributes after it) of `rest` = the text after `opcode(`."""
    depth = 1
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return rest[:i], rest[i + 1 :]
    return rest, ""


def parse_module(hlo_text: str) -> dict[str, dict[str, Instr]]:
    """{computation: {instruction: Instr}} of an HLO module's text (operands by name)."""
    comps: dict[str, dict[str, Instr]] = {}
    current: dict[str, Instr] | None = None
    for line in hlo_text.splitlines():
        h = _HEADER.match(line)
        if h:
            current = comps.setdefault(h.group(1), {})
            continue
        m = _DEF.match(line)
        if not m or current is None:
            continue
        root, name, shape, opcode, rest = m.groups()
        args, attrs = _split_call(rest)
        calls = _CALLS.search(attrs)
        op = _OP_NAME.search(attrs)
        contract = _CONTRACT.search(attrs)
        src = _SOURCE.search(attrs)
        target = _TARGET.search(attrs)
        current[name] = Instr(
            name,
            shape,
            opcode,
            _OPERAND.findall(args),
            calls.group(1) if calls else "",
            op.group(1) if op else "",
            bool(root),
            [int(d) for d in contract.group(1).split(",") if d] if contract else [],
            f"{src.group(1).rsplit('/', 1)[-1]}:{src.group(2)}" if src else "",
            target.group(1) if target else "",
        )
    return comps


def _bytes(shape: str) -> int:
    return sum(xla_dump.array_bytes(shape))


def _dims(shape: str) -> list[int]:
    m = _DIMS.search(shape)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def _flops_of(ins: Instr, shapes: dict[str, str]) -> int:
    """2 x M x N x K of one dot (0 for any other op)."""
    if ins.opcode != "dot" or not ins.operands:
        return 0
    out = 1
    for d in _dims(ins.shape):
        out *= d
    lhs = _dims(shapes.get(ins.operands[0], ""))
    k = 1
    for d in ins.contracting:
        k *= lhs[d] if d < len(lhs) else 1
    return 2 * out * k


def _dot_flops(comps: dict[str, dict[str, Instr]], comp: str, shapes: dict[str, str], seen: set[str]) -> int:
    """The flops of the dots in `comp` and the computations it calls."""
    if comp in seen or comp not in comps:
        return 0
    seen.add(comp)
    return sum(
        _flops_of(ins, shapes) + (_dot_flops(comps, ins.calls, shapes, seen) if ins.calls else 0)
        for ins in comps[comp].values()
    )


def _fusion_bytes(comps: dict[str, dict[str, Instr]], ins: Instr, shapes: dict[str, str]) -> int:
    """Bytes a fusion reads and writes (see the module docstring)."""
    body = comps.get(ins.calls, {})
    params = {i.name: i for i in body.values() if i.opcode == "parameter"}
    users: dict[str, list[Instr]] = {p: [] for p in params}
    for i in body.values():
        for o in i.operands:
            if o in users:
                users[o].append(i)
    read = 0
    root = next((i for i in body.values() if i.root), None)
    in_place = root is not None and root.opcode == "dynamic-update-slice" and root.operands
    for name, p in params.items():
        if in_place and root.operands[0] == name:
            continue  # the buffer updated in place: neither read nor rewritten whole
        used = users[name]
        if used and all(u.opcode in _PARTIAL_READS and u.operands[0] == name for u in used):
            read += sum(_bytes(u.shape) for u in used)
        else:
            read += _bytes(p.shape)
    if in_place:
        written = _bytes(shapes.get(root.operands[1], body.get(root.operands[1], root).shape))
    else:
        written = _bytes(ins.shape)
    return read + written


@dataclasses.dataclass
class Traffic:
    """One launch site: executions per call, bytes and flops per execution, its part of the model."""

    launch: xla_dump.Launch
    bytes: int
    flops: int
    part: str
    op_name: str


def launch_traffic(dump_dir: str, launches: list[xla_dump.Launch] | None = None) -> list[Traffic]:
    """Bytes, flops and part of every launch of the program(s) dumped in `dump_dir`."""
    launches = xla_dump.read_launches(dump_dir) if launches is None else launches
    comps: dict[str, dict[str, Instr]] = {}
    for prefix in xla_dump.module_prefixes(dump_dir):
        comps.update(parse_module(xla_dump.hlo_text(prefix)))
    instrs = {name: ins for body in comps.values() for name, ins in body.items()}
    shapes = {name: ins.shape for name, ins in instrs.items()}
    out = []
    for launch in launches:
        ins = instrs.get(launch.hlo)
        if ins is None:
            out.append(Traffic(launch, 0, 0, part_of(f"kernel:{launch.kernel}"), ""))
            continue
        if ins.opcode == "fusion":
            nbytes = _fusion_bytes(comps, ins, shapes)
        else:
            nbytes = sum(_bytes(shapes.get(o, "")) for o in ins.operands) + _bytes(ins.shape)
        flops = _flops_of(ins, shapes) + (_dot_flops(comps, ins.calls, shapes, set()) if ins.calls else 0)
        # A launch without an op_name, or a Pallas kernel whose caller names no part, goes by its kernel's name.
        part = part_of(ins.op_name) if ins.op_name else "other"
        if part == "other" and (launch.category == "pallas" or not ins.op_name):
            part = part_of(f"kernel:{launch.kernel}")
        out.append(Traffic(launch, nbytes, flops, part, ins.op_name))
    return out


def by_part(traffic: list[Traffic], bandwidth: float, peak_flops: float) -> list[dict]:
    """Per part of the model (PARTS order; Pallas kernels apart from XLA's launches): launches, bytes,
    flops and the summed roofline floor (ms) at `bandwidth` bytes/s and `peak_flops` flop/s."""
    rows: dict[tuple[str, bool], dict] = {}
    for t in traffic:
        pallas = t.launch.category == "pallas"
        row = rows.setdefault(
            (t.part, pallas), {"part": t.part, "pallas": pallas, "launches": 0, "bytes": 0, "flops": 0, "floor_ms": 0.0}
        )
        n = t.launch.count
        row["launches"] += n
        row["bytes"] += n * t.bytes
        row["flops"] += n * t.flops
        row["floor_ms"] += n * max(t.bytes / bandwidth, t.flops / peak_flops) * 1e3
    order = {p: i for i, p in enumerate(PARTS)}
    return sorted(rows.values(), key=lambda r: (r["pallas"], order.get(r["part"], len(order))))


def top_launches(traffic: list[Traffic], bandwidth: float, peak_flops: float, n: int = 10) -> list[dict]:
    """The `n` non-Pallas launch sites with the largest floors (ms per call of the program)."""
    rows = []
    for t in traffic:
        if t.launch.category == "pallas":
            continue
        floor = t.launch.count * max(t.bytes / bandwidth, t.flops / peak_flops) * 1e3
        rows.append(
            {
                "hlo": t.launch.hlo,
                "category": t.launch.category,
                "part": t.part,
                "count": t.launch.count,
                "bytes": t.launch.count * t.bytes,
                "flops": t.launch.count * t.flops,
                "floor_ms": floor,
                "op_name": t.op_name,
            }
        )
    return sorted(rows, key=lambda r: -r["floor_ms"])[:n]
