"""nsa_jax/tools/aot.py: the GPU program compiled on a CPU host for A100 (sm_80) and H100 (sm_90).

Two tiers. The dump readers, the batch search and the fit check's missing-plugin
line run everywhere. The tests marked `aot` compile for the cards and need jax's
CUDA plugin (pip install -e ".[cuda12]"); they are skipped, with that reason, without
it. They fail when a Pallas kernel stops compiling for sm_80 or sm_90 at the
production shapes, when a kernel spills, when the a100_pcie step no longer fits an
A100 40GB or launches more than KERNELS_PER_STEP_LIMIT kernels, or when the layer's
forward+backward at T=65536 needs more than 1 GiB of temporaries. Each layer
compile serves its tests once per session, across workers.
A spill listed under KNOWN_SPILLS below (none today) xfails naming it; a new
one, or a larger one, fails.
"""

from __future__ import annotations

import dataclasses
import fcntl
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import types

import jax
import jax.numpy as jnp
import pytest

from benchmarks import gpu_aot
from launch import info as info_cli
from nsa_jax.config import load_config
from nsa_jax.config import replace as config_replace
from nsa_jax.kernels import SELECTION_KERNELS
from nsa_jax.kernels.block_scores_pallas import compressed_attention_select_pallas
from nsa_jax.kernels.blocksparse_pallas import selection_attention_blocksparse_pallas
from nsa_jax.kernels.cudnn import compressed_attention_grouped
from nsa_jax.kernels.flash_pallas import window_attention_pallas
from nsa_jax.kernels.selection_pallas import selection_attention_pallas
from nsa_jax.tools import aot, hlo_traffic, xla_dump
from nsa_jax.words import count

from helpers import ROOT

needs_plugin = pytest.mark.skipif(
    not aot.cuda_plugin_available(), reason=f"jax's CUDA plugin is not installed ({aot.INSTALL_HINT})"
)

# The production layer (a100_pcie: 12 heads over 2 KV heads, head dim 64, l=32 d=16 lp=64 n=16 w=512) at the
# runbook's T, the selection kernels' switch-over region, long context, and a T no tile divides.
PRODUCTION_T = (2048, 8192, 65536, 3000)
CARDS = ("a100-40", "h100")  # sm_80 and sm_90; the A100 80GB compiles the same kernels as the 40GB
# Spills ptxas reports today, per (card, kernel): a kernel listed here may spill up to this many bytes
# (stores + loads) and the test xfails naming it; any other spill, or a larger one, fails. None today
# (docs/PERFORMANCE.md, "Memory and kernel resources"): nsa_block_select spilled up to 4,944 B on an A100 until it took
# 16 query positions per program instead of 64.
KNOWN_SPILLS: dict[tuple[str, str], int] = {}
# The layer's forward+backward at T=65536 needs 904 MiB of temporaries on an A100 40GB (1,065 MiB before the
# gather selection kernel took fewer positions per program; docs/lab/performance-2026-11-26.md "Kernel resources").
LAYER_TEMP_LIMIT = 1 << 30
# Kernel launches per a100_pcie optimizer step on an A100 40GB: 1,994 with the layers unrolled in the scan
# (model.scan_unroll: 12), one matmul for x's gradient in each layer and two reductions for the logged
# statistics (2,418 before them), under half of the first measured 4,292.
KERNELS_PER_STEP_LIMIT = 2050


# ---------------------------------------------------------------------------
# dump readers and search: no plugin needed


def write_dump(tmp_path):
    """A dumped program: 2 launches before a loop of 3 trips whose body holds a loop of 4 trips."""
    prefix = tmp_path / "module_0001.jit_f"
    (tmp_path / "module_0001.jit_f.thunk_sequence.txt").write_text(
        textwrap.dedent(
            """\
            001: kCustomKernel [source | next=002 (1) ] gemm_fusion_dot grid: [10, 1, 1] threads: [64, 1, 1]  shared_memory: 6144 bytes
            002: kCopy         [prev=001 (1)  | next=003 (1) ] kCopy
            003: kWhile        [prev=002 (1)  | sink ]
            condition:
                004: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
              body:
                005: kCustomKernel [source | next=006 (1) ] my_kernel grid: [192, 1, 2] threads: [128, 1, 1]  shared_memory: 24576 bytes
                006: kWhile        [prev=005 (1)  | sink ]
            condition:
                    007: kCustomKernel [source | sink] loop_compare_fusion_1 grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
                  body:
                    008: kCustomKernel [source | next=009 (1) ] loop_dynamic_update_slice_fusion grid: [16, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
                    009: kDynamicSliceFusion [prev=008 (1) | sink ] params=1, results=1
                010: kCustomKernel [prev=006 (1) | sink ] loop_add_fusion grid: [4, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
            011: kAllReduce    [prev=003 (1)  | sink ] kAllReduce
            """  # noqa: E501
        )
    )
    names = {
        1: "gemm_fusion_dot",
        2: "copy.1",
        3: "while.1",
        4: "loop_compare_fusion",
        5: "pallas_call.3",
        6: "while.2",
        7: "loop_compare_fusion.1",
        8: "loop_dynamic_update_slice_fusion",
        9: "loop_dynamic_slice_fusion.2",
        10: "loop_add_fusion",
        11: "all-reduce-start",
    }
    meta = "".join(
        f'thunk_metadata {{\n  thunk_info {{\n    profile_annotation: "{n}"\n    thunk_id: {i}\n  }}\n}}\n'
        for i, n in names.items()
    )
    (tmp_path / "module_0001.jit_f.thunk_metadata.txt").write_text(meta)
    (tmp_path / "module_0001.jit_f.sm_8.0_gpu_after_optimizations.txt").write_text(
        '  %while.1 = (s32[]) while(%t), condition=%c, body=%b, backend_config={"known_trip_count":{"n":"3"}}\n'
        '  %while.2 = (s32[]) while(%u), condition=%c2, body=%b2, backend_config={"known_trip_count":{"n":"4"}}\n'
        '  %pallas_call.3 = f32[8]{0} custom-call(%x), custom_call_target="__gpu$xla.gpu.triton"\n'
    )
    return prefix


def test_read_launches_multiplies_by_loop_trip_counts(tmp_path):
    write_dump(tmp_path)
    launches = {x.thunk_id: x for x in xla_dump.read_launches(str(tmp_path))}
    assert set(launches) == {1, 2, 4, 5, 7, 8, 9, 10, 11}  # loops themselves launch nothing
    # outside: once; the outer condition runs trips + 1 = 4 times, its body 3; the inner body 3 x 4.
    assert [launches[i].count for i in (1, 2, 4, 5, 7, 8, 9, 10, 11)] == [1, 1, 4, 3, 3 * 5, 12, 12, 3, 1]
    assert launches[8].loops == ("while.1", "while.2") and launches[10].loops == ("while.1",)
    assert launches[5].grid == (192, 1, 2) and launches[5].threads == (128, 1, 1)
    assert launches[5].shared_memory == 24576
    cats = {i: launches[i].category for i in launches}
    assert cats == {
        1: "gemm",
        2: "copy_thunks",
        4: "fusions",
        5: "pallas",
        7: "fusions",
        8: "copies",
        9: "copy_thunks",
        10: "fusions",
        11: "collectives",
    }
    counts = xla_dump.launch_counts(list(launches.values()))
    assert counts["pallas"] == 3 and counts["gemm"] == 1 and counts["copies"] == 12
    assert counts["fusions"] == 4 + 15 + 3 and counts["copy_thunks"] == 13 and counts["collectives"] == 1
    assert counts["kernels"] == 3 + 1 + 12 + 22 and counts["total"] == counts["kernels"] + 14
    assert xla_dump.loop_trip_counts(str(tmp_path)) == {"while.1": 3, "while.2": 4}


@pytest.mark.parametrize("largest", [0, 1, 2, 3, 7, 11, 64, 100])
@pytest.mark.parametrize("guess", [None, 5, 11, 12, 90])
def test_largest_batch_finds_the_boundary(largest, guess):
    calls = []

    def fits(b):
        calls.append(b)
        return b <= largest, b

    found, probes = aot.largest_batch(fits, limit=100, guess=(lambda p: guess) if guess else None)
    assert found == largest
    assert sorted(probes) == sorted(set(calls)) and len(calls) == len(set(calls))
    assert len(calls) <= 2 + 2 + 2 * 7  # 1, 2, guess and next, doubling and bisection over 100


def test_largest_batch_right_guess_costs_two_compiles():
    calls = []
    mem = {b: 1000 + 300 * b for b in range(1, 100)}

    def fits(b):
        calls.append(b)
        return mem[b] <= 4000, {"total": mem[b]}

    found, _ = aot.largest_batch(fits, limit=99, guess=aot.affine_guess(4000))
    assert found == 10 and calls == [1, 2, 10, 11]


def test_largest_batch_guess_past_the_limit_probes_the_limit():
    calls = []

    def fits(b):
        calls.append(b)
        return True, {"total": 1000 + b}

    found, _ = aot.largest_batch(fits, limit=4096, guess=lambda p: 10**6)
    assert found == 4096 and calls == [1, 2, 4096]


def test_target_config_text_states_the_card():
    text = aot.TARGETS["h100"].config_text()
    assert "cuda_compute_capability { major: 9 minor: 0 }" in text
    assert "shared_memory_per_block_optin: 232448" in text and "core_count: 132" in text
    assert aot.TARGETS["a100-40"].arch == "sm_80" and aot.TARGETS["h100"].arch == "sm_90a"
    assert aot.TARGETS["a100-40"].usable_bytes(0.5) == 42331013120 // 2


def test_occupancy_by_registers():
    a100 = aot.TARGETS["a100-40"]
    # 128 threads = 4 warps; 255 registers -> 8192 per warp, 32768 per block: 2 blocks of 65536.
    assert xla_dump.occupancy_blocks(255, 128, 0, a100) == 2
    assert xla_dump.occupancy_blocks(128, 128, 0, a100) == 4
    assert xla_dump.occupancy_blocks(64, 128, 90112, a100) == 1  # shared memory binds first


def test_fit_check_without_plugin_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setattr(aot, "cuda_plugin_available", lambda: False)
    assert info_cli.main(["--config", "a100_pcie", "--target", "a100-40"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and 'pip install -e ".[cuda12]"' in err[0]


def test_gpu_aot_without_plugin_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setattr(aot, "cuda_plugin_available", lambda: False)
    assert gpu_aot.main(["--target", "h100", "--seq-lens", "2k"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error:") and 'pip install -e ".[cuda12]"' in err[-1]


def test_gpu_aot_prints_cards_side_by_side(capsys):
    def kernel(regs, spill, smem):
        return dict(
            name="nsa_k",
            grid=[8, 1, 2],
            threads=128,
            shared_memory=smem,
            registers=regs,
            spill_stores=spill,
            spill_loads=spill,
            launches=24,
        )

    def card(name, regs, spill, smem):
        mem = dict(argument=900 * aot.MiB, output=900 * aot.MiB, alias=900 * aot.MiB, temp=2000 * aot.MiB)
        mem["total"] = 2900 * aot.MiB
        launches = dict.fromkeys((*xla_dump.CATEGORIES, "kernels", "total"), 7)
        step = dict(memory=mem, usable_bytes=30000 * aot.MiB, fits=True, launches=launches, kernels=[])
        step["loop_trip_counts"] = {"while.1": 12}
        layer = [dict(seq_len=2048, memory=dict(mem, temp=34 * aot.MiB, total=57 * aot.MiB), kernels=[])]
        layer[0]["kernels"] = gpu_aot.with_occupancy([kernel(regs, spill, smem)], name)
        r = dict(target=name, device=aot.TARGETS[name].description, arch=aot.TARGETS[name].arch, step=step, layer=layer)
        r["worst"] = gpu_aot.worst(r)
        return r

    meta = dict(config="a100_pcie", strategy="dp", devices=2, seq_len=2048, global_batch=2, accumulate=2, dtype="bf16")
    meta["kernels"] = {"cmp": "cudnn+pallas-triton", "slc": "pallas-triton/blocksparse", "win": "pallas-triton"}
    gpu_aot.print_report({"a100-40": card("a100-40", 255, 10, 90112), "h100": card("h100", 128, 0, 40960)}, meta)
    out = capsys.readouterr().out
    assert "sm_80" in out and "sm_90a" in out
    assert "kernels cmp/slc/win cudnn+pallas-triton/pallas-triton/blocksparse/pallas-triton" in out  # what runs
    # registers, spill bytes (stores + loads), shared memory, blocks per SM: each card its own
    assert "255    20  88K 1" in out and "128     0  40K 4" in out
    assert "34 / 57" in out and "a100-40: most registers 255 (nsa_k (T=2048)); most spills 10 B stores" in out


def test_plugin_check_without_the_jax_plugins_package(monkeypatch):
    # Where no jax plugin is installed, the namespace package jax_plugins is absent too and find_spec raises.
    real = importlib.util.find_spec

    def find_spec(name, *args):
        if name.startswith("jax_plugins"):
            raise ModuleNotFoundError("No module named 'jax_plugins'")
        return real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert aot.cuda_plugin_available() is False
    with pytest.raises(aot.PluginMissing, match=r'not installed: pip install -e "\.\[cuda12\]"'):
        aot.target_devices("a100-40", 2)


def _env_without_platforms() -> dict[str, str]:
    """The user's environment: no JAX_PLATFORMS (conftest sets it for the test process)."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["PYTHONPATH"] = str(ROOT)
    return env


@pytest.mark.skipif(aot.cuda_plugin_available(), reason="jax's CUDA plugin is installed here")
def test_info_target_without_plugin_is_one_line():
    # The README's fresh machine: `.[test]` without the cuda12 extra, no JAX_PLATFORMS.
    r = subprocess.run(
        [sys.executable, "-m", "launch.info", "--config", "a100_pcie", "--target", "a100-40", "--devices", "2"],
        cwd=ROOT,
        env=_env_without_platforms(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [
        'error: --target a100-40 compiles with jax\'s CUDA plugin, which is not installed: pip install -e ".[cuda12]"'
    ]


def test_heartbeat_logs_while_the_block_runs():
    lines = []
    with aot.heartbeat(lines.append, "compiling", every=0.05):
        time.sleep(0.4)
    assert lines[0] == "compiling ..."
    assert len(lines) >= 4 and all(line.startswith("compiling: ") and line.endswith(" s so far") for line in lines[1:])
    n = len(lines)
    time.sleep(0.15)
    assert len(lines) == n  # stopped with the block
    assert not any(t.name == "heartbeat" for t in threading.enumerate())
    with aot.heartbeat(None, "quiet", every=0.01):  # no log: no thread, no lines
        assert not any(t.name == "heartbeat" for t in threading.enumerate())


def test_fit_check_says_what_it_compiles(monkeypatch):
    usable = aot.TARGETS["a100-40"].usable_bytes()
    per_row = usable // 10  # 9 rows fit beside the arguments, 10 do not

    def compile_train_step(cfg, target, n_devices, dump_dir=None):
        rows = cfg.train.global_batch // n_devices
        total = per_row // 2 + rows * per_row
        mem = dict(argument=0, output=0, alias=0, temp=total, generated_code=0, total=total)
        time.sleep(0.12)
        return aot.Compiled(target, None, mem, 0.0, 0.0, None)

    monkeypatch.setattr(aot, "compile_train_step", compile_train_step)
    monkeypatch.setattr(aot, "HEARTBEAT_S", 0.05)
    lines = []
    r = aot.fit_check(load_config("cpu_tiny"), "a100-40", 2, log=lines.append)
    assert r["largest_rows"] == 9 and r["configured_fits"]
    for b in r["probes"]:  # each compile: announced, ticking while it runs, then its figure
        i = lines.index(f"  {count(b, 'row')} per device: compiling ...")
        assert lines[i + 1].startswith(f"  {count(b, 'row')} per device: compiling: ")
        done = [line for line in lines if line.startswith(f"  {count(b, 'row')} per device: ") and "MiB" in line]
        assert len(done) == 1 and lines.index(done[0]) > i + 1


@pytest.mark.parametrize("layout", ["cuda_nvcc", "cu13"])
def test_ptxas_from_the_plugins_cuda_wheels(tmp_path, monkeypatch, layout):
    # jax[cuda12] installs nvidia/cuda_nvcc/bin/ptxas, jax[cuda13] nvidia/cu13/bin/ptxas.
    ptxas = tmp_path / "nvidia" / layout / "bin" / "ptxas"
    ptxas.parent.mkdir(parents=True)
    ptxas.write_text("#!/bin/sh\n")
    ptxas.chmod(0o755)
    nvidia = types.ModuleType("nvidia")
    nvidia.__path__ = [str(tmp_path / "nvidia")]
    monkeypatch.setitem(sys.modules, "nvidia", nvidia)
    monkeypatch.delitem(sys.modules, "nvidia.cuda_nvcc", raising=False)
    assert xla_dump.ptxas_path() == str(ptxas)


@pytest.mark.parametrize("devices", ["0", "-1"])
def test_info_target_refuses_no_devices_before_compiling(monkeypatch, capsys, devices):
    def fit_check(*args, **kwargs):
        raise AssertionError("compiled although --devices was refused")

    monkeypatch.setattr(aot, "fit_check", fit_check)
    assert info_cli.main(["--config", "a100_pcie", "--target", "a100-40", "--devices", devices]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"error: --devices {devices} must be >= 1\n"


def test_fit_check_unknown_target(capsys):
    assert info_cli.main(["--config", "a100_pcie", "--target", "v100"]) == 2
    err = capsys.readouterr().err
    assert "unknown target 'v100'; GPU cards: a100-40" in err and "TPU slices: v4-8" in err


# ---------------------------------------------------------------------------
# compiled for the cards: the `aot` tier


def layer_compile(card: str, seq_len: int, root, compressed_kernel: str = "auto", scorer: str = "cmp") -> dict:
    """Memory and Pallas kernels of the a100_pcie layer's fwd+bwd compiled for `card` at T, once per test session
    (with `compressed_kernel` and `scorer`, model.nsa's).

    pytest-xdist workers share `root`: the first to ask compiles under a file lock and
    writes the figures; the others wait and read them.
    """
    tag = f"{card}_{seq_len}" + ("" if compressed_kernel == "auto" else f"_{compressed_kernel}")
    tag += "" if scorer == "cmp" else f"_{scorer}"
    result = root / f"layer_{tag}.json"
    with open(root / f"layer_{tag}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if result.exists():
            return json.loads(result.read_text())
        dump = str(root / f"dump_{tag}")
        cfg = load_config(
            "a100_pcie", [f"model.nsa.compressed_kernel={compressed_kernel}", f"model.nsa.scorer={scorer}"]
        )
        c = aot.compile_layer(cfg, card, seq_len, dump_dir=dump)
        t = aot.get_target(card)
        traffic = hlo_traffic.by_part(hlo_traffic.launch_traffic(dump), t.memory_bandwidth, t.bf16_tensor_flops)
        r = {"memory": c.memory, "kernels": xla_dump.pallas_kernels(dump), "traffic": traffic}
        shutil.rmtree(dump, ignore_errors=True)
        result.write_text(json.dumps(r))
        return r


@pytest.fixture(scope="session")
def dump_root(tmp_path_factory):
    """A folder all pytest-xdist workers of this session share (the parent of their own base folders)."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "aot_compiles"
    root.mkdir(exist_ok=True)
    return root


@pytest.mark.aot
@needs_plugin
def test_target_devices_need_no_jax_platforms():
    # A user's process: no JAX_PLATFORMS; on a host without a GPU the plugin's start-up check used to fail.
    code = "from nsa_jax.tools import aot; import jax; print(len(aot.target_devices('h100', 2)), jax.default_backend())"
    env = _env_without_platforms()
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["2", "cpu"]


@pytest.mark.aot
@pytest.mark.slow
@needs_plugin
def test_info_target_prints_progress_and_the_fit():
    # `launch.info --target` as a user runs it: no JAX_PLATFORMS, a line at least every HEARTBEAT_S while it compiles.
    # One layer, one row as configured, a 6M-token vocabulary: one compile (about 20 s on a 2-core CPU) that does
    # not fit an A100 40GB (its arguments alone take about 26 GiB), then the answer.
    small = ["--set", "model.n_layers=1", "--set", "train.global_batch=1", "--set", "model.vocab_size=6000000"]
    cmd = [sys.executable, "-u", "-m", "launch.info", "--config", "cpu_tiny", *small, "--target", "a100-40"]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=_env_without_platforms(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    stamps = []
    reader = threading.Thread(target=lambda: stamps.extend((time.monotonic(), line) for line in proc.stderr))
    t0 = time.monotonic()
    reader.start()
    try:
        out = proc.stdout.read()
        assert proc.wait(timeout=900) == 1  # the configured batch does not fit
    finally:
        proc.kill()
        reader.join()
    assert "parameters:" in out and "fit on a100-40 (NVIDIA A100-PCIE-40GB), 1 device," in out, out
    assert "-> does NOT fit" in out and "not even 1 row per device fits" in out, out
    lines = [line for _, line in stamps]
    assert any(re.search(r"\d rows? per device: compiling \.\.\.", line) for line in lines), lines
    times = [t0] + [t for t, _ in stamps]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert max(gaps) < 30, f"{max(gaps):.0f} s without a line on stderr: {lines}"


def aot_case(card, T):
    marks = [pytest.mark.aot, pytest.mark.slow, needs_plugin]
    return pytest.param(card, T, marks=marks, id=f"{card}-T{T}")


@pytest.mark.parametrize("card,T", [aot_case(c, T) for c in CARDS for T in PRODUCTION_T])
def test_pallas_kernels_compile_without_spills(card, T, dump_root):
    # The flash kernels in every branch: `auto` trains from 8k with cuDNN's attention in the compressed
    # branch (its own test below), but the flash kernels stay for forward passes, context-parallel
    # chunks and shorter T. Raises when a kernel does not compile (e.g. shared memory).
    r = layer_compile(card, T, dump_root, "pallas")
    names = {k["name"] for k in r["kernels"]}
    # Every branch runs a kernel forward and backward: compression, block selection, selection, window.
    for stem in ("nsa_cmp_", "nsa_block_select", "nsa_selection", "nsa_window_"):
        assert any(n.startswith(stem) for n in names), f"no {stem}* kernel compiled among {sorted(names)}"
    assert all("registers" in k for k in r["kernels"]), "ptxas reported no registers for a kernel"
    spills = {k["name"]: k["spill_stores"] + k["spill_loads"] for k in r["kernels"] if k["spill_stores"]}
    known = {n: b for n, b in spills.items() if b <= KNOWN_SPILLS.get((card, n), -1)}
    if spills and spills == known:
        pytest.xfail(f"known spills on {card} at T={T} (bytes stored + loaded): {spills}")
    assert not spills, f"kernels spill on {card} at T={T} (bytes stored + loaded): {spills}"


@pytest.mark.parametrize(
    "card", [pytest.param(c, marks=[pytest.mark.aot, pytest.mark.slow, needs_plugin]) for c in CARDS]
)
def test_the_minmax_scorer_compiles_without_spills_and_moves_less_than_cmp_at_64k(card, dump_root):
    """The fused minmax scoring kernel (kernels/minmax_pallas.py) in the a100_pcie layer at T = 65536:
    no spills, the layer's temporaries within 1 GiB, and its scoring (the kernel and the XLA pass that
    makes the sub-block extremes) moves fewer bytes than the compressed scorer's kernel."""
    r = layer_compile(card, 65536, dump_root, "pallas", scorer="minmax")
    kernels = {k["name"]: k for k in r["kernels"]}
    assert "nsa_minmax_select" in kernels and "nsa_block_select" not in kernels, sorted(kernels)
    k = kernels["nsa_minmax_select"]
    assert k["spill_stores"] + k["spill_loads"] == 0, k
    assert r["memory"]["temp"] <= LAYER_TEMP_LIMIT, r["memory"]
    cmp = layer_compile(card, 65536, dump_root, "pallas")
    assert "nsa_block_select" in {x["name"] for x in cmp["kernels"]}

    def part_bytes(result, part):  # XLA's launches and the Pallas kernels of one part of the layer
        return sum(x["bytes"] for x in result["traffic"] if x["part"] == part)

    minmax_scoring = part_bytes(r, "block scorer + top-n")
    # What cmp's scoring adds to the compressed branch: its part's bytes beyond the attention alone.
    cmp_scoring = part_bytes(cmp, "compressed attn + top-n") - part_bytes(r, "compressed attn + top-n")
    assert 0 < minmax_scoring <= cmp_scoring, (minmax_scoring, cmp_scoring)


@pytest.mark.parametrize(
    "card", [pytest.param(c, marks=[pytest.mark.aot, pytest.mark.slow, needs_plugin]) for c in CARDS]
)
def test_the_rescore_scorer_compiles_without_spills_at_64k(card, dump_root):
    """rescore in the a100_pcie layer at T = 65536: cmp's fused scoring + top-n kernel keeping 4 n = 64
    candidates and the second stage's kernel (kernels/rescore_pallas.py) compile without spills, and the
    layer's temporaries stay within 1 GiB."""
    r = layer_compile(card, 65536, dump_root, "pallas", scorer="rescore")
    kernels = {k["name"]: k for k in r["kernels"]}
    for name in ("nsa_rescore_select", "nsa_block_select"):
        assert name in kernels, sorted(kernels)
        assert kernels[name]["spill_stores"] + kernels[name]["spill_loads"] == 0, kernels[name]
    assert r["memory"]["temp"] <= LAYER_TEMP_LIMIT, r["memory"]


@pytest.mark.aot
@pytest.mark.slow
@needs_plugin
def test_a_gemma_head_dim_of_256_compiles_for_an_a100():
    # Gemma 3 1B's attention as NSA (head_dim 256, 4 heads over 1): cuDNN's fused attention takes at most 128
    # on an A100 (auto keeps the flash kernels), and the block-select kernel's tiles are sized for its G query
    # tiles and `win` key tiles (it asked for 197,120 bytes of shared memory with one tile of each counted).
    sets = ["model.head_dim=256", "model.v_head_dim=256", "model.n_heads=4", "model.n_kv_heads=1", "model.d_model=1152"]
    cfg = load_config("a100_pcie", sets)
    c = aot.compile_layer(cfg, "a100-40", 8192)
    assert 0 < c.memory["temp"] <= LAYER_TEMP_LIMIT, c.memory


@pytest.mark.aot
@pytest.mark.slow
@needs_plugin
def test_layer_temporaries_at_64k_within_1gib(dump_root):
    temp = layer_compile("a100-40", 65536, dump_root, "pallas")["memory"]["temp"]  # cuDNN's: below
    assert temp <= LAYER_TEMP_LIMIT, f"layer fwd+bwd at T=65536 needs {temp / aot.MiB:.0f} MiB of temporaries"


@pytest.mark.aot
@pytest.mark.slow
@needs_plugin
def test_layer_traffic_at_64k_counts_the_projections_and_names_its_parts(dump_root):
    """What the 64k layer's launches move, per part (hlo_traffic.py): the projections' flops as the
    model's shapes give them (forward, input gradient and weight gradient: 3 x 2 T D N), and nearly
    all of XLA's bytes in a named part of the layer."""
    m = load_config("a100_pcie").model
    T, D, H, K = 65536, m.d_model, m.n_heads, m.n_kv_heads
    rows = {(r["part"], r["pallas"]): r for r in layer_compile("a100-40", T, dump_root, "pallas")["traffic"]}
    qkv_width = H * m.head_dim + 3 * K * m.head_dim + 3 * K * m.v_head_dim + m.nsa.gate_hidden
    assert rows[("qkv proj + RoPE", False)]["flops"] == 3 * 2 * T * D * qkv_width
    assert rows[("out proj", False)]["flops"] == 3 * 2 * T * H * m.v_head_dim * D
    xla_bytes = sum(r["bytes"] for (_, pallas), r in rows.items() if not pallas)
    assert rows.get(("other", False), {"bytes": 0})["bytes"] <= 0.15 * xla_bytes, rows
    for part in ("selection", "compressed attn + top-n", "window"):
        assert rows[(part, True)]["launches"] >= 3, part  # forward and backward kernels of each branch


@pytest.mark.aot
@pytest.mark.slow
@needs_plugin
def test_a100_pcie_step_fits_a100_40gb(tmp_path):
    cfg = load_config("a100_pcie")
    c = aot.compile_train_step(cfg, "a100-40", 2, str(tmp_path))
    usable = aot.TARGETS["a100-40"].usable_bytes(aot.DEFAULT_MEM_FRACTION)
    assert 0 < c.memory["total"] <= usable, f"{c.memory['total'] / aot.MiB:.0f} MiB per device"
    # A layer loop brought back (3,850) or new kernels per layer fail here.
    kernels = xla_dump.launch_counts(xla_dump.read_launches(str(tmp_path)))["kernels"]
    assert 0 < kernels <= KERNELS_PER_STEP_LIMIT, f"{kernels} kernel launches per a100_pcie optimizer step"


@pytest.mark.aot
@pytest.mark.slow
@needs_plugin
def test_context_parallel_step_fits_two_a100_80gb_and_moves_no_quadratic_collective(tmp_path):
    """a100_pcie_256k (one sequence over two cards) at T = 65536 for two A100 80GB: it fits, its K/V
    travel by all-gathers and reduce-scatters of a few K/V arrays of the whole sequence at most
    (nothing O(T^2 / C) or O(T n_blocks)); the per-card temporaries are at most 1.25 / 2 of one
    card's."""
    T = 65536
    cfg = load_config("a100_pcie_256k", [f"train.seq_len={T}"])
    c2 = aot.compile_train_step(cfg, "a100-80", 2, str(tmp_path))
    usable = aot.TARGETS["a100-80"].usable_bytes(aot.DEFAULT_MEM_FRACTION)
    assert 0 < c2.memory["total"] <= usable
    traffic = xla_dump.collective_traffic(str(tmp_path))
    assert {"all-gather", "reduce-scatter", "all-reduce"} <= set(traffic)
    m = cfg.model
    one_branch_kv = T * m.n_kv_heads * m.head_dim * 2  # bf16
    # The sequence's collectives (XLA combines a few into one launch: the K and V of two branches at
    # most, 4 arrays of T tokens); the all-reduce carries the bf16 gradient, parameter-sized. A score
    # or block tensor moved whole would be T^2 / C or T n_blocks: thousands of times larger.
    assert max(traffic[kind]["largest"] for kind in ("all-gather", "reduce-scatter")) <= 4 * one_branch_kv
    c1 = aot.compile_train_step(config_replace(cfg, ["parallel.context=1"]), "a100-80", 1)
    assert c2.memory["temp"] <= 0.625 * c1.memory["temp"], (c2.memory["temp"], c1.memory["temp"])


def test_largest_seq_len_finds_the_longest_within_its_tolerance():
    """The search over T (launch.info --target under context parallelism) on a made-up memory curve."""
    for cap in (3000, 40_000, 300_000, 2_000_000):
        budget = 1000 + 3 * cap

        def fits(T, budget=budget):
            total = 1000 + 3 * T + T * T // 10**7  # a little more than linear, as compiled memory is
            return total <= budget, {"total": total}

        best = max(T for T in range(512, 4 * cap, 512) if fits(T)[0])  # the answer, by brute force
        for start in (512, 65536, 1 << 20):
            T, probes = aot.largest_seq_len(fits, start, 512, budget)
            assert T % 512 == 0 and fits(T)[0] and T >= best * 15 / 16 - 512, (cap, start, T, best)
            assert len(probes) <= 16, (cap, start, sorted(probes))
    assert aot.largest_seq_len(lambda T: (False, {"total": T}), 4096, 512, 10)[0] == 0


@pytest.mark.aot
@needs_plugin
def test_compressed_regrouped_lowers_to_one_cudnn_attention_for_cuda():
    # kernels/cudnn.py at 64k: one fused forward and one fused backward over the Tc = 4095 tokens
    # padded to 4096, with the 16 queries x 6 heads of each group as 96 query heads per KV head.
    # The lowering asks the CUDA plugin for cuDNN's version (the layer with it compiles below).
    t, l, d = 65536, 32, 16
    tc = (t - l) // d + 1
    sds = jax.ShapeDtypeStruct
    q, kc = sds((1, t, 12, 64), jnp.bfloat16), sds((1, tc, 2, 64), jnp.bfloat16)
    fwd = lambda q, kc, vc: compressed_attention_grouped(q, kc, vc, l=l, d=d)
    grad = jax.grad(lambda q, kc, vc: fwd(q, kc, vc).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    text = aot.export_for_cuda(grad, q, kc, kc).mlir_module()
    calls = re.findall(r"custom_call @([\w$]+)\((%[\w#]+)", text)
    assert sorted(name for name, _ in calls) == sorted(aot.CUDNN_ATTENTION_TARGETS), calls
    assert "tensor<1x4096x192x64xbf16>" in text and "tensor<1x4096x2x64xbf16>" in text
    assert not re.search(r"\b4096x4096x", text)  # no score matrix outside the fused kernel


def _cudnn_compressed_layer(seq_len):
    """(fn, args): the a100_pcie layer's fwd+bwd with `compressed_kernel: cudnn`, a GPU's kernel plan."""
    cfg = load_config("a100_pcie").model
    cfg = dataclasses.replace(cfg, nsa=dataclasses.replace(cfg.nsa, compressed_kernel="cudnn"))
    return aot.layer_forward_backward(cfg, seq_len)


@pytest.mark.aot
@needs_plugin
def test_layer_with_cudnn_compressed_attention_lowers_for_cuda():
    # compressed_kernel: cudnn at 64k: the branch's attention is one cuDNN fused forward and backward; the
    # scores read the log-sum-exp pass (nsa_cmp_lse) instead of the flash forward, which is gone with its
    # backward; the other branches keep their kernels.
    fn, args = _cudnn_compressed_layer(65536)
    text = aot.export_for_cuda(fn, *args).mlir_module()
    calls = re.findall(r"custom_call @([\w$]+)\(", text)
    assert sorted(c for c in calls if c in aot.CUDNN_ATTENTION_TARGETS) == sorted(aot.CUDNN_ATTENTION_TARGETS)
    names = set(re.findall(r"\bnsa_\w+", text))
    assert {"nsa_cmp_lse", "nsa_block_select", "nsa_selection_fwd", "nsa_window_fwd"} <= names, names
    assert not names & {"nsa_cmp_fwd", "nsa_cmp_dq", "nsa_cmp_dkv"}, names
    assert not re.search(r"\b4096x4096x", text)  # no score matrix outside the fused kernel


@pytest.mark.aot
@pytest.mark.slow
@needs_plugin
@pytest.mark.parametrize("card", CARDS)
def test_layer_with_cudnn_compressed_attention_compiles_within_budget(card, dump_root):
    # compressed_kernel: cudnn compiled for the card at 64k (cuDNN's calls included): the log-sum-exp pass in
    # place of the branch's flash kernels, no spill, and the layer's temporaries within the same 1 GiB.
    r = layer_compile(card, 65536, dump_root, "cudnn")
    kernels = {k["name"]: k for k in r["kernels"]}
    assert "nsa_cmp_lse" in kernels and "nsa_block_select" in kernels, sorted(kernels)
    assert not {"nsa_cmp_fwd", "nsa_cmp_dq", "nsa_cmp_dkv"} & set(kernels), sorted(kernels)
    spills = {n: k["spill_stores"] + k["spill_loads"] for n, k in kernels.items() if k["spill_stores"]}
    assert not spills, f"kernels spill on {card} (bytes stored + loaded): {spills}"
    temp = r["memory"]["temp"]
    assert temp <= LAYER_TEMP_LIMIT, f"layer fwd+bwd at T=65536 needs {temp / aot.MiB:.0f} MiB of temporaries"


# A context-parallel chunk at the production shapes: 2048 query rows of an 8192-token sequence (4 devices).
CHUNK_ROWS, CHUNK_SEQ = 2048, 8192


def chunk_kernels(card: str, traced: bool) -> dict[str, dict]:
    """{kernel: ptxas figures} of every branch kernel's forward and backward for one chunk of the a100_pcie layer
    (window; compressed attention with block selection; gather selection with the layer's tiling; block-sparse
    selection), compiled for `card`; `traced`: the query offset is an argument of the compiled program, else the
    Python int 0 (the kernels without an offset, at the same shapes)."""
    cfg = load_config("a100_pcie").model
    nsa, h, kvh = cfg.nsa, cfg.n_heads, cfg.n_kv_heads
    tc = (CHUNK_SEQ - nsa.l) // nsa.d + 1
    sharding = jax.sharding.SingleDeviceSharding(aot.target_devices(card, 1)[0])
    sds = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    q, k, kc = (
        sds((1, CHUNK_ROWS, h, cfg.head_dim)),
        sds((1, CHUNK_SEQ, kvh, cfg.head_dim)),
        sds((1, tc, kvh, cfg.head_dim)),
    )
    idx = sds((1, CHUNK_ROWS, kvh, nsa.n), jnp.int32)

    def loss(q, k, v, kc, vc, idx, off):
        kw = dict(lp=nsa.lp, n=nsa.n, num_blocks=CHUNK_SEQ // nsa.lp, q_offset=off)
        o_cmp, blocks = compressed_attention_select_pallas(q, kc, vc, l=nsa.l, d=nsa.d, **kw)
        gather = SELECTION_KERNELS["gather"]
        outs = (
            window_attention_pallas(q, k, v, nsa.w, q_offset=off),
            o_cmp,
            selection_attention_pallas(q, k, v, idx, nsa.lp, block_sizes=gather, q_offset=off),
            selection_attention_blocksparse_pallas(q, k, v, idx, nsa.lp, q_offset=off),
        )
        return sum(o.astype(jnp.float32).sum() for o in outs), blocks

    grad = jax.grad(loss if traced else lambda *a: loss(*a, 0), argnums=(0, 1, 2, 3, 4), has_aux=True)
    args = (q, k, k, kc, kc, idx) + ((sds((), jnp.int32),) if traced else ())
    with tempfile.TemporaryDirectory() as dump:
        aot.compile_for(card, grad, args, dump)
        return {row["name"]: row for row in xla_dump.pallas_kernels(dump)}


@pytest.mark.aot
@pytest.mark.slow
@needs_plugin
@pytest.mark.parametrize("card", CARDS)
def test_kernels_under_a_traced_query_offset_compile_without_spills(card):
    # The offset is read from a kernel input: no kernel may spill for it, nor hold fewer blocks per SM (by
    # registers, threads and shared memory) than without an offset. Registers without -> with the offset when
    # this was written, sm_80 (sm_90): nsa_cmp_fwd 160 -> 162 (123 -> 128), nsa_cmp_dq 187 -> 183 (122 -> 126),
    # nsa_cmp_dkv 255 -> 255 (197 -> 200); every other kernel at most one register more, or fewer.
    target = aot.get_target(card)
    with_offset, without = chunk_kernels(card, traced=True), chunk_kernels(card, traced=False)
    stems = ("nsa_window_", "nsa_cmp_", "nsa_block_select", "nsa_selection_dkv", "nsa_selection_bsp_")
    assert set(with_offset) == set(without) and all(any(n.startswith(s) for n in with_offset) for s in stems)

    def blocks(k):
        return xla_dump.occupancy_blocks(k["registers"], k["threads"], k["shared_memory"], target)

    figures = {n: (without[n]["registers"], k["registers"]) for n, k in sorted(with_offset.items())}
    spills = {n: k["spill_stores"] + k["spill_loads"] for n, k in with_offset.items()}
    spills = {n: b for n, b in spills.items() if b}
    assert not spills, f"kernels spill under a query offset on {card} (bytes stored + loaded): {spills}; {figures}"
    fewer = {n: (blocks(without[n]), blocks(k)) for n, k in with_offset.items() if blocks(k) < blocks(without[n])}
    assert not fewer, f"fewer blocks per SM under a query offset on {card}: {fewer}; registers {figures}"


@pytest.mark.aot
@pytest.mark.slow
@needs_plugin
def test_overlapped_reduction_is_scheduled_inside_the_backward_of_the_a100_pcie_step():
    """parallel.overlap_reduce on 2 x A100 (benchmarks/overlap_schedule.py): nearly every byte of the
    gradient all-reduces is scheduled before backward work that can hide it, where the one-reduction step
    runs them all after the backward; the compiled memory stays within 5% of the one-reduction step's."""
    from benchmarks.overlap_schedule import measure

    res = measure("a100_pcie", "a100-40", 2, [])
    one, over = res["one reduction"], res["overlap"]

    def hidden(r):  # share of the all-reduce bytes with backward launches still to run after them
        return sum(a["bytes"] for a in r["all_reduces"] if a["backward_after"] > 0) / sum(
            a["bytes"] for a in r["all_reduces"]
        )

    assert hidden(one) == 0.0 and hidden(over) > 0.9, (one["all_reduces"], over["all_reduces"])
    assert over["memory"]["total"] <= 1.05 * one["memory"]["total"], (over["memory"], one["memory"])


@pytest.mark.aot
@pytest.mark.slow
@needs_plugin
def test_the_study_table_compiles_each_strategy_for_two_l4s():
    """benchmarks.bench_study on a small dense model for 2 x L4 (sm_89, the study's card): dp all-reduces
    the bf16 gradient; zero1 reduce-scatters it, all-gathers the parameters and holds half the moments."""
    from benchmarks import bench_study

    small = [
        "model.n_layers=2",
        "model.scan_unroll=1",
        "model.d_model=256",
        "model.n_heads=4",
        "model.n_kv_heads=2",
        "model.d_ff=512",
    ]
    rows = {}
    for name in ("dp", "zero1"):
        cfg = bench_study.study_config("smollm2-135m", 128, 8, name, small)
        rows[name] = bench_study.measure(cfg, "l4", 2)
    dp, zero1 = rows["dp"], rows["zero1"]
    assert dp["fits"] and set(dp["collectives"]) == {"all-reduce"}
    assert {"reduce-scatter", "all-gather"} <= set(zero1["collectives"])
    assert "bf16" in dp["collectives"]["all-reduce"]["dtypes"]
    assert zero1["memory"]["argument"] < 0.8 * dp["memory"]["argument"]
    assert bench_study.main(["--strategies", "dp,zero3"]) == 2
