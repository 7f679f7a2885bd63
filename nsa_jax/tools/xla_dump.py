"""A compiled GPU program read back from its XLA dump: launches, loop trip counts, Pallas kernels.

aot.py compiles for a card without one (`compile_for(..., dump_dir=...)`); this module
reads what that dump holds:

* `read_launches(dump)`: every launch of the compiled program from the dump's thunk
  sequence, multiplied by the trip counts of the while loops it sits in, in
  categories (Pallas kernels, gemm fusions, other fusions, copy kernels, then copy
  thunks and collectives); `launch_counts` sums them, `loop_trip_counts` names the loops;
* `pallas_kernels(dump)`: each Pallas kernel's grid, threads, shared memory and, from
  `ptxas -v` on its PTX, registers and spill bytes;
* `occupancy_blocks`: the blocks per SM those allow on a card (aot.py `GpuTarget`);
* `hlo_collectives(text)`: the collectives of any compiled program's HLO text (a TPU's too, whose
  compile leaves no thunk sequence), multiplied by the trip counts of the loops they sit in.

Plain text parsing and one ptxas run per kernel: no jax.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from nsa_jax.tools.aot import INSTALL_HINT, GpuTarget, PluginMissing

_THUNK = re.compile(r"^(\s*)(\d+): (k\w+)\s+\[[^\]]*\]\s*(.*)$")
_KERNEL = re.compile(
    r"(\S+) grid: \[(\d+), (\d+), (\d+)\] threads: \[(\d+), (\d+), (\d+)\]\s+shared_memory: (\d+) bytes"
)
_TRIP = re.compile(r'%([\w.\-]+) = .*"known_trip_count":\{"n":"(\d+)"\}')
_TRITON_CALL = re.compile(r'%([\w.\-]+) = .*custom_call_target="__gpu\$xla\.gpu\.triton"')
_META = re.compile(r'profile_annotation: "([^"]*)"\s*thunk_id: (\d+)')
# Thunks that only order or group others.
_STRUCTURAL = {"kWhile", "kSequential", "kConditional", "kCommandBuffer"}
# Kernels (what XLA launches as kernels) by category, then the thunks that copy buffers without a kernel
# of their own (memcpy, or a fusion addressed at a dynamic offset), then collectives.
KERNEL_CATEGORIES = ("pallas", "gemm", "fusions", "copies")
CATEGORIES = KERNEL_CATEGORIES + ("copy_thunks", "collectives")


@dataclasses.dataclass
class Launch:
    """One launch site of the compiled program and how often one call of it runs there."""

    thunk_id: int
    kind: str  # XLA thunk kind: kCustomKernel (a kernel), kCopy, kDynamicSliceFusion, kAllReduce, ...
    hlo: str  # the HLO instruction (thunk metadata)
    kernel: str  # the kernel's name, or the HLO name for thunks that launch no named kernel
    category: str  # one of CATEGORIES
    count: int  # static 1 x the trip counts of the enclosing loops (a condition runs trips + 1 times)
    loops: tuple[str, ...]  # enclosing while loops, outermost first
    grid: tuple[int, int, int] | None = None
    threads: tuple[int, int, int] | None = None
    shared_memory: int | None = None


def module_prefixes(dump_dir: str) -> list[str]:
    return sorted(p[: -len(".thunk_sequence.txt")] for p in glob.glob(os.path.join(dump_dir, "*.thunk_sequence.txt")))


def hlo_text(prefix: str) -> str:
    files = glob.glob(prefix + ".sm_*_gpu_after_optimizations.txt")
    return Path(files[0]).read_text() if files else ""


def _category(kind: str, hlo: str, kernel: str, triton: set[str]) -> str:
    if kind.startswith(("kAll", "kReduceScatter", "kCollective", "kNccl", "kSend", "kRecv")):
        return "collectives"
    if hlo in triton:
        return "pallas"
    if kind in ("kGemm", "kCublasLtMatmul", "kCuDnn") or kernel.startswith(("gemm_fusion", "cublas")):
        return "gemm"
    if kind in ("kCopy", "kMemcpy", "kDeviceToDevice", "kDynamicSliceFusion"):
        return "copy_thunks"
    if "dynamic_update_slice" in hlo or "dynamic_slice" in hlo:
        return "copies"
    if hlo.startswith("copy") or kernel.startswith(("wrapped_copy", "copy")):
        return "copies"
    return "fusions"


def read_launches(dump_dir: str) -> list[Launch]:
    """Every launch site of the program(s) dumped in `dump_dir`, with executions per call.

    From `*.thunk_sequence.txt` (launches in order, while loops nested), the thunk
    metadata (thunk id -> HLO instruction) and the optimized HLO (`known_trip_count`
    of each loop, custom calls to Triton = the Pallas kernels). A loop whose trip
    count XLA does not know counts once.
    """
    out = []
    for prefix in module_prefixes(dump_dir):
        text = hlo_text(prefix)
        trips = {m.group(1): int(m.group(2)) for m in _TRIP.finditer(text)}
        triton = set(_TRITON_CALL.findall(text))
        meta_path = Path(prefix + ".thunk_metadata.txt")
        meta = {}
        if meta_path.exists():
            meta = {int(i): name for name, i in _META.findall(meta_path.read_text())}
        stack: list[list] = []  # [indent, loop hlo, trips, section]
        for line in Path(prefix + ".thunk_sequence.txt").read_text().splitlines():
            stripped = line.strip()
            if stripped in ("condition:", "body:"):
                if stack:
                    stack[-1][3] = stripped[:-1]
                continue
            m = _THUNK.match(line)
            if not m:
                continue
            indent, thunk_id, kind, rest = len(m.group(1)), int(m.group(2)), m.group(3), m.group(4)
            while stack and indent <= stack[-1][0]:
                stack.pop()
            hlo = meta.get(thunk_id, "")
            if kind == "kWhile":
                stack.append([indent, hlo, trips.get(hlo, 1), "body"])
                continue
            if kind in _STRUCTURAL:
                continue
            count = 1
            for _, _, n, section in stack:
                count *= n + 1 if section == "condition" else n
            k = _KERNEL.search(rest)
            kernel = k.group(1) if k else (hlo or kind)
            launch = Launch(
                thunk_id, kind, hlo, kernel, _category(kind, hlo, kernel, triton), count, tuple(s[1] for s in stack)
            )
            if k:
                launch.grid = tuple(int(x) for x in k.group(2, 3, 4))
                launch.threads = tuple(int(x) for x in k.group(5, 6, 7))
                launch.shared_memory = int(k.group(8))
            out.append(launch)
    return out


def launch_counts(launches: list[Launch]) -> dict[str, int]:
    """Executions per call by category; `kernels`: the kernel launches (KERNEL_CATEGORIES); `total`: every thunk."""
    counts = {c: 0 for c in CATEGORIES}
    for launch in launches:
        counts[launch.category] += launch.count
    counts["kernels"] = sum(counts[c] for c in KERNEL_CATEGORIES)
    counts["total"] = sum(counts[c] for c in CATEGORIES)
    return counts


# replica_groups in the three forms XLA prints: explicit groups `{{0,1},{2,3}}`, an iota list
# `[2,2]<=[4]` (groups x group size), or named mesh axes `mesh['axis_0'=2,'axis_1'=4] {'axis_1'}`
# (the SPMD partitioner's collectives: a group spans the listed axes).
_COLLECTIVE = re.compile(
    r"%([\w.\-]+) = (.+?) (all-gather-start|all-gather|reduce-scatter|all-reduce-start|all-reduce|"
    r"collective-permute-start|collective-permute|all-to-all)\(.*?replica_groups="
    r"(\{\{[^=]*?\}\}|\[[\d,]+\]<=\[[\d,]+\]|mesh\[[^\]]*\]\s*\{[^}]*\})"
)
_MESH_AXIS = re.compile(r"'([\w]+)'=(\d+)")


def group_size(groups: str) -> int:
    """Devices per replica group, from replica_groups' text in any of _COLLECTIVE's forms."""
    if groups.startswith("{{"):
        return len(groups.split("},{")[0].strip("{}").split(","))
    if groups.startswith("["):
        return int(groups[1:].split("]")[0].split(",")[-1])
    sizes = dict((a, int(n)) for a, n in _MESH_AXIS.findall(groups.split("]")[0]))
    size = 1
    for axis in re.findall(r"'([\w]+)'", groups.split("]", 1)[1]):
        size *= sizes.get(axis, 1)
    return size


_ARRAY = re.compile(r"\b(pred|[sfu]\d+|bf16)\[([\d,]*)\]")
_ITEM_BYTES = {"pred": 1, "bf16": 2}


def array_bytes(shape_text: str) -> list[int]:
    """Bytes of every array in an HLO shape (a tuple lists several)."""
    out = []
    for dtype, dims in _ARRAY.findall(shape_text):
        n = 1
        for d in dims.split(","):
            n *= int(d) if d else 1
        out.append(n * _ITEM_BYTES.get(dtype, int(dtype[1:]) // 8 if dtype[1:].isdigit() else 4))
    return out


def collective_traffic(dump_dir: str) -> dict[str, dict[str, int]]:
    """Per collective kind: executions per call, payload bytes and bytes each device sends, per call.

    Payload: what the collective produces on each device (an all-gather's gathered array, a
    reduce-scatter's shard, an all-reduce's sum). Sent per device, the ring algorithms' count
    over a group of g devices: all-gather payload (g-1)/g, reduce-scatter payload (g-1),
    all-reduce 2 payload (g-1)/g, a permute its payload. `largest` is the largest single
    payload (bytes) of the kind. Loops count by their trip counts (read_launches).
    """
    counts: dict[str, int] = {}
    for launch in read_launches(dump_dir):
        if launch.category == "collectives":
            counts[launch.hlo] = counts.get(launch.hlo, 0) + launch.count
    out: dict[str, dict[str, int]] = {}
    for prefix in module_prefixes(dump_dir):
        for name, shape, op, groups in _COLLECTIVE.findall(hlo_text(prefix)):
            if name not in counts:
                continue  # a collective that is not launched on its own (inside a fusion or a start/done pair)
            kind = op.removesuffix("-start")
            arrays = array_bytes(shape)
            if kind == "all-gather" and op.endswith("-start"):
                arrays = arrays[len(arrays) // 2 :]  # ((inputs), (outputs))
            elif kind == "collective-permute" and op.endswith("-start"):
                arrays = arrays[:1]
            payload = sum(arrays)
            g = group_size(groups)
            sent = {
                "all-gather": payload * (g - 1) // g,
                "reduce-scatter": payload * (g - 1),
                "all-reduce": 2 * payload * (g - 1) // g,
            }.get(kind, payload)
            row = out.setdefault(kind, {"count": 0, "payload_bytes": 0, "sent_bytes": 0, "largest": 0})
            n = counts[name]
            row["count"] += n
            row["payload_bytes"] += n * payload
            row["sent_bytes"] += n * sent
            row["largest"] = max(row["largest"], payload)
    return out


_COMPUTATION = re.compile(r"^(ENTRY )?%([\w.\-]+) .*\{\s*$")
_CALLEE = re.compile(r"\b(calls|to_apply|body|condition)=%([\w.\-]+)")
_CALLEES = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_COUNTER_BOUND = re.compile(r"s32\[\]\S* constant\((\d+)\)")
_COLLECTIVE_OP = re.compile(
    r"= (.+?) (all-gather|reduce-scatter|all-reduce|collective-permute|all-to-all)(?:-start)?\("
)


def hlo_collectives(text: str) -> dict[str, dict[str, int]]:
    """Per collective kind in a compiled program's HLO text: executions and payload bytes per call.

    Each computation counts as often as it runs: a while body times its trip count, read from its
    condition's one s32 constant (the counter's bound: scan and fori_loop lower so; a condition with
    none or several counts once), every other callee (fusions, async wrappers, reductions, both
    branches of a conditional) as often as its caller. Payload: what the collective produces on each
    device (all its outputs), as collective_traffic's.
    """
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in text.splitlines():
        m = _COMPUTATION.match(line)
        if m and not line.startswith(" "):
            current = m.group(2)
            comps[current] = []
            entry = current if m.group(1) else entry
        elif current is not None:
            comps[current].append(line)

    def trips(condition: str) -> int:
        bounds = _COUNTER_BOUND.findall("\n".join(comps.get(condition, [])))
        return int(bounds[0]) if len(bounds) == 1 else 1

    runs: dict[str, int] = {}

    def visit(name: str, times: int) -> None:
        runs[name] = runs.get(name, 0) + times
        for line in comps.get(name, []):
            callees = _CALLEE.findall(line)
            condition = next((n for k, n in callees if k == "condition"), None)
            for kind, callee in callees:
                visit(callee, times * (trips(condition) if kind == "body" and condition else 1))
            for group in _CALLEES.findall(line):
                for callee in re.findall(r"%([\w.\-]+)", group):
                    visit(callee, times)

    if entry is not None:
        visit(entry, 1)
    out: dict[str, dict[str, int]] = {}
    for name, lines in comps.items():
        for line in lines if runs.get(name) else ():
            m = _COLLECTIVE_OP.search(line)
            if m:
                row = out.setdefault(m.group(2), {"count": 0, "payload_bytes": 0})
                row["count"] += runs[name]
                row["payload_bytes"] += runs[name] * sum(array_bytes(m.group(1)))
    return out


def loop_trip_counts(dump_dir: str) -> dict[str, int]:
    """{while loop HLO name: known trip count} of the dumped program(s)."""
    out = {}
    for prefix in module_prefixes(dump_dir):
        out.update({m.group(1): int(m.group(2)) for m in _TRIP.finditer(hlo_text(prefix))})
    return out


# ---------------------------------------------------------------------------
# registers and spills

_PTXAS_FUNC = re.compile(
    r"Function properties for (\S+)\s*\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, "
    r"(\d+) bytes spill loads"
)
_PTXAS_USED = re.compile(r"Compiling entry function '([^']+)' for '(\w+)'.*?Used (\d+) registers", re.S)
_ENTRY = re.compile(r"\.entry (\w+)\(")
_PTX_TARGET = re.compile(r"^\.target (\w+)", re.M)


def ptxas_path() -> str | None:
    """ptxas from the CUDA wheels jax's plugin installs (nvidia/cuda_nvcc for CUDA 12, nvidia/cu13 for 13),
    else the one on PATH, else CUDA's default install."""
    try:
        import nvidia  # noqa: PLC0415 - optional: the CUDA wheels of jax's plugin (the cuda12 extra)

        bases = list(getattr(nvidia, "__path__", []))
    except ImportError:
        bases = []
    for base in bases:
        for sub in ("cuda_nvcc", "cu13"):
            candidate = os.path.join(base, sub, "bin", "ptxas")
            if os.access(candidate, os.X_OK):
                return candidate
    found = shutil.which("ptxas")
    if found is None and os.access("/usr/local/cuda/bin/ptxas", os.X_OK):
        found = "/usr/local/cuda/bin/ptxas"
    return found


def ptx_entries(dump_dir: str) -> dict[str, str]:
    """{kernel entry name: PTX file} of the dumped program(s)."""
    out = {}
    for path in sorted(glob.glob(os.path.join(dump_dir, "*.ptx"))):
        for name in _ENTRY.findall(Path(path).read_text()):
            out.setdefault(name, path)
    return out


def ptxas_usage(ptx_path: str, arch: str | None = None) -> dict[str, dict]:
    """{entry: registers, spill_stores, spill_loads, stack_frame, arch} from `ptxas -v` (arch: the PTX's .target)."""
    text = Path(ptx_path).read_text()
    if arch is None:
        m = _PTX_TARGET.search(text)
        arch = m.group(1) if m else "sm_80"
    return {k: dict(v) for k, v in _ptxas_log(text, arch).items()}


@functools.lru_cache(maxsize=256)
def _ptxas_log(ptx_text: str, arch: str) -> dict[str, dict]:
    # Cached on the PTX itself: the same kernel compiled for two cards of one architecture is one ptxas run.
    exe = ptxas_path()
    if exe is None:
        raise PluginMissing(f"ptxas not found (it comes with jax[cuda12]): {INSTALL_HINT}")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx_text)
        f.flush()
        res = subprocess.run([exe, f"-arch={arch}", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"ptxas -arch={arch} failed: {res.stderr.strip()[:300]}")
    log = res.stderr + res.stdout
    out = {}
    for name, stack, stores, loads in _PTXAS_FUNC.findall(log):
        out[name] = dict(stack_frame=int(stack), spill_stores=int(stores), spill_loads=int(loads), arch=arch)
    for name, used_arch, regs in _PTXAS_USED.findall(log):
        out.setdefault(name, dict(arch=used_arch))["registers"] = int(regs)
    return out


def pallas_kernels(dump_dir: str, launches: list[Launch] | None = None) -> list[dict]:
    """One row per Pallas kernel of the dumped program: grid, threads, shared memory, registers, spills, launches."""
    launches = read_launches(dump_dir) if launches is None else launches
    entries = ptx_entries(dump_dir)
    rows: dict[str, dict] = {}
    for launch in launches:
        if launch.category != "pallas":
            continue
        row = rows.get(launch.kernel)
        if row is None:
            row = rows[launch.kernel] = dict(
                name=launch.kernel,
                grid=list(launch.grid or ()),
                threads=launch.threads[0] if launch.threads else None,
                shared_memory=launch.shared_memory,
                launches=0,
            )
            if launch.kernel in entries:
                row.update(ptxas_usage(entries[launch.kernel]).get(launch.kernel, {}))
        row["launches"] += launch.count
    return sorted(rows.values(), key=lambda r: r["name"])


def occupancy_blocks(registers: int, threads: int, shared_memory: int, target: GpuTarget) -> int:
    """Blocks of `threads` that fit one SM by registers (allocated per warp in units of 256) and shared memory."""
    warps = -(-threads // target.threads_per_warp)
    per_warp = -(-registers * target.threads_per_warp // 256) * 256
    by_regs = target.registers_per_core_limit // max(per_warp * warps, 1)
    by_threads = target.threads_per_core_limit // threads
    by_smem = target.shared_memory_per_core // shared_memory if shared_memory else by_threads
    return max(0, min(by_regs, by_threads, by_smem, 32))
