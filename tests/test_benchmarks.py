"""Smoke tests of the benchmark scripts: each CLI runs at tiny sizes and writes the JSON it documents.

No timing is asserted (timings are printed by the benchmarks, never tested).
The scripts run in a subprocess, as a user would run them; most of their time
is XLA:CPU compiling the tiny programs.
"""

from __future__ import annotations

import gzip
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from benchmarks import bench_strategies as BS
from benchmarks import profile_step

from helpers import run_cli


def run_bench(tmp_path, module: str, args: str, meta_keys: tuple[str, ...]) -> tuple[dict, list[dict], str]:
    """`python -m benchmarks.<module> ARGS --json F` on the CPU: (meta, rows, stdout); the meta names `meta_keys`."""
    out = tmp_path / f"{module}.json"
    proc = run_cli(f"benchmarks.{module}", *args.split(), "--json", str(out))
    assert "backend: cpu" in proc.stdout
    data = json.loads(out.read_text())
    for key in meta_keys:
        assert key in data["meta"], key
    return data["meta"], data["rows"], proc.stdout


@pytest.mark.slow
def test_bench_attention_cli_writes_json(tmp_path):
    meta, rows, _ = run_bench(
        tmp_path,
        "bench_attention",
        "--config cpu_tiny --seq-lens 64 --no-backward --iters 1 --warmup 0",
        ("backend", "device", "jax", "dtype", "batch", "model", "kernels", "chunked_check_max_abs_err"),
    )
    # The chunked dense baseline computes the same attention (output and grads).
    assert meta["chunked_check_max_abs_err"] < 1e-4
    assert [(r["seq"], r["mode"]) for r in rows] == [(64, "fwd")]
    row = rows[0]
    for name in ("nsa", "dense_xla", "dense_chunked"):
        assert row[f"{name}_ms"] > 0, name
        mem = row[f"{name}_mem"]
        for key in ("argument", "output", "temp", "alias", "generated_code", "total"):
            assert key in mem, (name, key)
        assert mem["total"] > 0
    assert row["dense_best"] in ("xla", "chunked")
    assert row["dense_ms"] == row[f"dense_{row['dense_best']}_ms"]
    assert row["speedup_nsa_vs_dense"] == pytest.approx(row["dense_ms"] / row["nsa_ms"])
    for key in ("mem_ratio_dense_vs_nsa", "dense_mem_total", "cpu_time_ratio_dense_vs_nsa"):
        assert key in row, key


@pytest.mark.slow
def test_bench_compile_cli_writes_json(tmp_path):
    meta, rows, _ = run_bench(
        tmp_path,
        "bench_compile",
        "--config cpu_tiny --seq-len 32 --n-layers 1 --remat none --scan true --set train.global_batch=1",
        ("backend", "device", "config", "seq_len", "global_batch", "accumulate"),
    )
    assert meta["seq_len"] == 32
    assert len(rows) == 1
    row = rows[0]
    assert "error" not in row, row.get("error")
    assert (row["n_layers"], row["remat"], row["scan_layers"]) == (1, "none", True)
    assert row["step"] in ("project", "minimal")
    for key in ("lower_s", "compile_s", "total_s", "stablehlo_kib", "n_params"):
        assert row[key] > 0, key
    for key in ("argument", "output", "alias", "temp", "generated_code", "total"):
        assert key in row["mem"], key
    assert row["mem"]["argument"] > 0


def test_hlo_collective_parser_on_known_programs():
    """bench_strategies' parser: one bf16 psum of [128] is one 256-byte all-reduce as partitioned;
    a psum inside a 3-trip loop runs 3 times per call."""
    mesh = Mesh(np.asarray(jax.devices()[:2]), ("data",))
    psum = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh, in_specs=P("data"), out_specs=P()))
    compiled, partitioned = BS.compile_with_partitioned_hlo(psum.lower(jnp.ones((256,), jnp.bfloat16)))
    assert BS.collectives_in_hlo(partitioned) == {
        "all-reduce": {"count": 1, "bytes": 256, "executed_count": 1, "executed_bytes": 256, "dtypes": ["bf16"]}
    }
    # What runs may differ by backend (XLA:CPU reduces bf16 in fp32: 512 bytes); still one op.
    ran = BS.collectives_in_hlo(compiled.as_text())
    assert set(ran) == {"all-reduce"} and ran["all-reduce"]["count"] == 1
    assert ran["all-reduce"]["bytes"] in (256, 512)

    def looped(x):
        return jax.lax.fori_loop(0, 3, lambda i, y: jax.lax.psum(y * 0.5, "data"), x)

    loop = jax.jit(jax.shard_map(looped, mesh=mesh, in_specs=P("data"), out_specs=P(), check_vma=False))
    ran = BS.collectives_in_hlo(loop.lower(jnp.ones((256,), jnp.float32)).compile().as_text())["all-reduce"]
    assert (ran["count"], ran["bytes"], ran["executed_count"], ran["executed_bytes"]) == (1, 512, 3, 1536)


@pytest.mark.slow
def test_bench_strategies_cli_writes_json(tmp_path):
    sets = "--set model.n_layers=1 --set train.seq_len=32 --set train.global_batch=2"
    _, rows, stdout = run_bench(
        tmp_path, "bench_strategies", f"--strategies dp-bf16,zero1 --steps 1 --warmup 0 {sets}", ()
    )
    assert "device: cpu (x2)" in stdout
    assert [r["variant"] for r in rows] == ["dp-bf16", "zero1"]
    dp, zero1 = rows
    assert "error" not in dp and "error" not in zero1
    # zero1: the same params per device, half the optimizer state (nearly every leaf has an even axis).
    assert zero1["params_bytes"] == dp["params_bytes"]
    assert zero1["opt_bytes"] < 0.55 * dp["opt_bytes"]
    assert dp["collectives"]["partitioned"]["all-reduce"]["dtypes"] == ["bf16", "f32"]  # grads, loss
    assert zero1["collectives"]["compiled"]["all-gather"]["count"] > 0  # updated params gathered
    assert dp["losses"][0] == pytest.approx(zero1["losses"][0], rel=1e-5)


def test_profile_instruction_sources_name_ops_and_kinds():
    """The HLO parser maps compiled instructions to their JAX op and kind (matmul, transpose/copy, ...)."""

    def f(a_NxK, b_KxM):
        with jax.named_scope("my_matmul"):
            c = a_NxK @ b_KxM
        with jax.named_scope("my_flip"):
            return jnp.tanh(c).T.copy() + 1.0

    a = jnp.ones((64, 32))
    b = jnp.ones((32, 48))
    text = jax.jit(f).lower(a, b).compile().as_text()
    src = profile_step.instruction_sources(text)
    by_scope = {}
    for info in src.values():
        for scope in ("my_matmul", "my_flip"):
            if scope in info["op_name"]:
                by_scope.setdefault(scope, set()).add(info["kind"])
    assert "matmul" in by_scope["my_matmul"], by_scope
    assert by_scope["my_flip"] <= {"transpose/copy", "elementwise", "matmul"}, by_scope
    assert profile_step.part_of("jit(step)/layers/attn/nsa_slc/while/body/dot_general") == "selection"
    assert profile_step.part_of("jit(step)/layers/mlp/w1/dot_general") == "mlp"
    assert profile_step.part_of("jit(step)/something/else") == "other"


def test_profile_attributes_device_kernels_by_hlo_op():
    """On a GPU trace the device kernels count, each under the instruction its hlo_op names.

    The trace is written by hand in the trace-viewer layout (process_name metadata,
    kernel events named after the CUDA kernel with hlo_op/hlo_module arguments, host
    thunk events named after the instruction); a CPU trace has no device track.
    """
    sources = {
        "fusion.3": {"opcode": "fusion"},
        "custom-call.7": {"opcode": "custom-call"},
        "while.2": {"opcode": "while"},
    }
    gpu = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0 (NVIDIA H100)"}},
        # host: the thunk launches, named after the instruction (not device time)
        {"ph": "X", "pid": 1, "name": "fusion.3", "dur": 5.0, "args": {"hlo_op": "fusion.3"}},
        {"ph": "X", "pid": 1, "name": "custom-call.7", "dur": 4.0},
        # device: two kernels of one custom call (a Pallas forward, say) and one fusion
        {"ph": "X", "pid": 7, "name": "nsa_sel_fwd", "dur": 3000.0, "args": {"hlo_op": "custom-call.7"}},
        {"ph": "X", "pid": 7, "name": "nsa_sel_fwd", "dur": 1000.0, "args": {"hlo_op": "custom-call.7"}},
        {"ph": "X", "pid": 7, "name": "loop_fusion_3", "dur": 500.0, "args": {"hlo_op": "fusion.3"}},
        {"ph": "X", "pid": 7, "name": "while_cond", "dur": 9000.0, "args": {"hlo_op": "while.2"}},
        {"ph": "X", "pid": 7, "name": "memcpy", "dur": 70.0, "args": {}},
    ]
    ms, calls, where = profile_step.instruction_times(gpu, sources)
    assert where == "device kernels"
    assert ms == {"custom-call.7": 4.0, "fusion.3": 0.5}
    assert calls == {"custom-call.7": 2, "fusion.3": 1}
    cpu = [e for e in gpu if e.get("pid") == 1]
    ms, calls, where = profile_step.instruction_times(cpu, sources)
    assert where == "host instruction events"
    assert ms == {"fusion.3": 0.005, "custom-call.7": 0.004}


def test_dense_baselines_are_chosen_by_flag():
    """bench_attention --dense: the default set per backend, a subset, none, and one error line otherwise."""
    from benchmarks import bench_attention as BA

    assert BA.dense_choice(None, gpu=False) == ["xla", "chunked"]
    assert BA.dense_choice(None, gpu=True) == ["xla", "chunked", "cudnn"]
    assert BA.dense_choice("cudnn", gpu=True) == ["cudnn"]
    assert BA.dense_choice("none", gpu=True) == []
    for bad in ("cudnn", "flash"):
        with pytest.raises(SystemExit, match="--dense"):
            BA.dense_choice(bad, gpu=False)


@pytest.mark.slow
def test_bench_attention_times_nsa_variants_beside_the_config(tmp_path):
    """--variants: each ';'-separated set of model.nsa settings is one more NSA layer, timed in the same run
    (the Pallas kernels interpreted here; cudnn's fused attention runs on XLA off a GPU)."""
    variants = "compressed_kernel=cudnn;selection_kernel=gather,compressed_kernel=cudnn"
    args = "--config cpu_tiny --seq-lens 64 --no-backward --iters 1 --warmup 0 --dense xla --dtype bfloat16"
    meta, rows, out = run_bench(
        tmp_path, "bench_attention", f"{args} --set model.nsa.attention_impl=pallas --variants {variants}", ()
    )
    names = ["nsa[compressed_kernel=cudnn]", "nsa[selection_kernel=gather,compressed_kernel=cudnn]"]
    # What each runs, in the JSON and on the screen (the config's own layer: the block-sparse kernel at T=64).
    assert meta["kernels"]["cmp"] == "pallas-interpret"
    assert meta["variant_kernels"][names[0]] == {**meta["kernels"], "cmp": "xla-attention+pallas-interpret"}
    assert meta["variant_kernels"][names[1]]["slc"] == "pallas-interpret/gather"
    assert f"{names[0]}: kernels cmp/slc/win=xla-attention+pallas-interpret/" in out
    for name in names:
        assert rows[0][f"{name}_ms"] > 0 and rows[0][f"{name}_speedup_vs_dense"] > 0, name
        assert name in out  # the side-by-side table
    bad = run_cli("benchmarks.bench_attention", *args.split(), "--variants", "compressed_kernel=flash", check=False)
    assert bad.returncode != 0 and "json" not in bad.stdout
    assert bad.stderr.strip().splitlines()[-1].startswith("error: --variants 'compressed_kernel=flash': config:")
    # The variant is checked at the dtype the run uses (cuDNN's attention takes 16-bit inputs).
    fp32 = run_cli(
        "benchmarks.bench_attention", "--config", "cpu_tiny", "--variants", "compressed_kernel=cudnn", check=False
    )
    assert fp32.returncode != 0 and "needs model.dtype=bfloat16" in fp32.stderr.strip().splitlines()[-1]


def test_profile_attributes_kernels_inside_cuda_graphs():
    """Inside a CUDA graph every kernel's hlo_op names the command buffer, not an instruction.

    A kernel named after a fusion (XLA's '.' -> '_') is matched to that instruction; one
    no instruction is named after (cuBLAS, Pallas) is counted under its own name, with
    its kind read from the name. Hand-written events in the layout jax 0.11 writes.
    """
    sources = {"loop_add_fusion.19": {"opcode": "fusion", "op_name": "jit(step)/mlp/add", "source": "", "kind": "x"}}
    buf = {"hlo_op": "command_buffer_1", "hlo_module": "jit_train_step"}
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "X", "pid": 1, "name": "loop_add_fusion_19", "dur": 300.0, "args": buf},
        {"ph": "X", "pid": 1, "name": "nsa_selection_bsp_dkv", "dur": 2000.0, "args": buf},
        {"ph": "X", "pid": 1, "name": "nsa_selection_bsp_dkv", "dur": 1000.0, "args": buf},
        {"ph": "X", "pid": 1, "name": "nvjet_sm90_tst_128x160", "dur": 700.0, "args": buf},
        {"ph": "X", "pid": 1, "name": "memcpy32_post", "dur": 5.0, "args": {}},  # no instruction launched it
    ]
    ms, calls, where = profile_step.instruction_times(events, sources)
    assert where == "device kernels"
    assert ms == {"kernel:nsa_selection_bsp_dkv": 3.0, "kernel:nvjet_sm90_tst_128x160": 0.7, "loop_add_fusion.19": 0.3}
    assert calls["kernel:nsa_selection_bsp_dkv"] == 2
    res = profile_step.summarise(events, sources, steps=1, wall_s=None)
    by_name = {r["instruction"]: r for r in res["rows"]}
    assert by_name["kernel:nsa_selection_bsp_dkv"]["kind"] == "pallas"
    assert by_name["kernel:nsa_selection_bsp_dkv"]["part"] == "selection"
    assert by_name["kernel:nvjet_sm90_tst_128x160"]["kind"] == "matmul"
    assert by_name["loop_add_fusion.19"]["part"] == "mlp"
    assert abs(res["op_ms_per_step"] - 4.0) < 1e-9


def test_profile_step_puts_cudnn_kernels_in_the_part_of_the_modules_cudnn_calls():
    """Inside a CUDA graph cuDNN's kernels name no instruction; the module's cuDNN custom calls say where
    they sit (in the NSA layer: the compressed branch), and a module whose calls sit in two parts names none."""
    cmp_call = (
        "  %custom-call.3 = (bf16[1,12,64,64]{3,2,1,0}, u8[0]{0}) custom-call(%a, %b, %c), "
        'custom_call_target="__cudnn$fmhaSoftmax", metadata={op_name="jit(f)/jvp(NSAAttention)/nsa_cmp/attn"}'
    )
    win_call = cmp_call.replace("%custom-call.3", "%custom-call.4").replace("nsa_cmp", "nsa_win")
    other = (
        '  %custom-call.5 = f32[8]{0} custom-call(%a), custom_call_target="Sharding", metadata={op_name="x/nsa_win/y"}'
    )

    def module(*calls):
        return "\n".join(["ENTRY %main (a: f32[8]) -> f32[8] {", *calls, "}"])

    assert profile_step.cudnn_part(module(cmp_call, other)) == "compressed attn + top-n"
    assert profile_step.cudnn_part(module(cmp_call, win_call, other)) is None
    assert profile_step.cudnn_part(module(other)) is None
    buf = {"hlo_op": "command_buffer_1"}
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "X", "pid": 1, "name": "cudnn_generated_fort_native_sdpa_sm90", "dur": 2400.0, "args": buf},
        {"ph": "X", "pid": 1, "name": "nsa_window_fwd", "dur": 700.0, "args": buf},
    ]
    parts = {
        r["instruction"]: r["part"]
        for r in profile_step.summarise(events, {}, 1, None, cudnn="compressed attn + top-n")["rows"]
    }
    assert parts == {
        "kernel:cudnn_generated_fort_native_sdpa_sm90": "compressed attn + top-n",
        "kernel:nsa_window_fwd": "window",
    }
    assert profile_step.summarise(events, {}, 1, None)["rows"][0]["part"] == "other"  # without the module's word


def test_profile_step_reads_a_saved_trace(tmp_path):
    """--read-trace summarises a trace folder written elsewhere, by kernel name, without compiling."""
    folder = tmp_path / "trace" / "plugins" / "profile" / "run1"
    folder.mkdir(parents=True)
    events = [
        {"ph": "M", "name": "process_name", "pid": 3, "args": {"name": "/device:GPU:0"}},
        {"ph": "X", "pid": 3, "name": "nsa_window_fwd", "dur": 1500.0, "args": {"hlo_op": "command_buffer_2"}},
        {"ph": "X", "pid": 3, "name": "nsa_window_fwd", "dur": 1500.0, "args": {"hlo_op": "command_buffer_2"}},
        {"ph": "X", "pid": 3, "name": "wrapped_concatenate", "dur": 1000.0, "args": {"hlo_op": "command_buffer_2"}},
    ]
    with gzip.open(folder / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    out = tmp_path / "read.json"
    proc = run_cli(
        "benchmarks.profile_step", "--read-trace", str(tmp_path / "trace"), "--steps", "2", "--json", str(out)
    )
    assert "summed op time 2.0 ms" in proc.stdout, proc.stdout
    rows = {r["instruction"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["kernel:nsa_window_fwd"]["ms_per_step"] == 1.5
    assert rows["kernel:nsa_window_fwd"]["part"] == "window"
    assert rows["kernel:wrapped_concatenate"]["kind"] == "transpose/copy"
    missing = run_cli("benchmarks.profile_step", "--read-trace", str(tmp_path / "nowhere"), check=False)
    assert missing.returncode != 0 and "--read-trace" in missing.stderr


@pytest.mark.slow
def test_profile_step_cli_writes_json(tmp_path):
    out = tmp_path / "profile.json"
    proc = run_cli(
        "benchmarks.profile_step",
        "--layer",
        "--backward",
        "--config",
        "cpu_tiny",
        "--seq-len",
        "128",
        "--steps",
        "1",
        "--trace-dir",
        str(tmp_path / "trace"),
        "--json",
        str(out),
    )
    assert "by part" in proc.stdout and "by kind" in proc.stdout
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert rows and all(r["ms_per_step"] >= 0 for r in rows)
    assert abs(sum(r["share"] for r in rows) - 1.0) < 1e-6
    assert {p["part"] for p in data["meta"]["parts"]} & {"selection", "compressed attn + top-n", "window"}
    assert any((tmp_path / "trace").rglob("*.xplane.pb"))


@pytest.mark.slow
def test_bench_kernels_cli_times_the_xla_paths_and_names_the_gpu_candidates(tmp_path):
    flash = "block_rows=128,num_warps=8;num_stages=3"
    args = "--branches compressed,window,selection --seq-lens 256 --iters 1 --warmup 0 --backward"
    args += f" --flash-variants {flash}"
    meta, rows, _ = run_bench(tmp_path, "bench_kernels", args, ("flash_variants",))
    by = {(r["branch"], r["mode"], r["impl"]): r for r in rows}
    for mode in ("fwd", "fwd+bwd"):
        assert by[("compressed", mode, "xla")]["ms"] > 0 and by[("window", mode, "xla")]["ms"] > 0
        for name in ("pallas", "pallas-attn", "cudnn-attn"):  # kernels/cudnn.py's candidate among them
            assert by[("compressed", mode, name)]["note"] == "no GPU"
        assert by[("window", mode, "cudnn")]["note"] == "no GPU"
        # The XLA selection's two strategies, each forced: timed, and the same attention as `auto`'s.
        for name in ("xla-gather", "xla-masked"):
            assert by[("selection", mode, name)]["ms"] > 0
            assert by[("selection", "fwd", name)]["max_abs_diff"] < 3e-2
        # Each flash tiling is a candidate of every flash kernel, named after its tiles.
        for tiles in flash.split(";"):
            for branch, base in (("window", "pallas"), ("compressed", "pallas-attn"), ("selection", "blocksparse")):
                assert by[(branch, mode, f"{base}[{tiles}]")]["note"] == "no GPU"
    assert meta["flash_variants"] == flash.split(";")
    bad = run_cli("benchmarks.bench_kernels", "--flash-variants", "rows=128", check=False)
    assert bad.returncode != 0 and "error: --flash-variants entry 'rows=128'" in bad.stderr


def test_bench_pretrained_fit_shapes_are_the_published_models_and_bad_names_are_one_line(capsys):
    """The shapes give the published models' dense parameter counts (NSA's two extra K/V projections and
    gates taken out), and an unknown model is one error line before anything compiles."""
    from benchmarks import bench_pretrained_fit as PF
    from nsa_jax.config import load_config
    from nsa_jax.info import parameter_counts

    published = {"smollm2-135m": 134_515_008, "qwen2.5-0.5b": 494_032_768, "llama3.2-1b": 1_235_814_400}
    for name, dense in published.items():
        m = load_config("llama8b_64k", PF.model_sets(name)).model
        d, L, K, Dh, gh = m.d_model, m.n_layers, m.n_kv_heads, m.head_dim, m.nsa.gate_hidden
        extra_kv = 2 * 2 * (d * K * Dh + (K * Dh if m.qkv_bias else 0))  # two more branches' K and V
        gates = d * gh + gh + gh * 3 * m.n_heads + 3 * m.n_heads
        assert parameter_counts(m)["total"] - L * (extra_kv + gates) == dense, name
    assert PF.main(["--models", "smollm2-135m,gpt2"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown --models gpt2; known: smollm2-135m")


def test_bench_pretrained_fit_largest_searches_each_split_sequence_from_the_first_length(monkeypatch, capsys):
    """--largest runs launch.info's search (aot.fit_check) once per target and C > 1, on one sequence of
    the first --seq-lens over C cards with the model's shape and loss chunk, and prints what it found."""
    from benchmarks import bench_pretrained_fit as PF
    from nsa_jax.tools import aot

    calls = []

    def fit_check(cfg, target, n_devices, log=None):
        calls.append((target, n_devices, cfg.parallel.context, cfg.train.seq_len, cfg.train.global_batch))
        calls.append((cfg.model.d_model, cfg.train.loss_chunk))
        probes = {cfg.train.seq_len: 1, 3 * cfg.train.seq_len: 2}
        return {
            "largest_seq_len": 3 * cfg.train.seq_len,
            "largest": {"total": 5 * aot.MiB},
            "seq_probes": probes,
            "usable_bytes": 7,
        }

    monkeypatch.setattr(aot, "fit_check", fit_check)
    monkeypatch.setattr(aot, "compile_on_host", lambda: None)
    argv = ["--models", "smollm2-360m", "--contexts", "1,2", "--seq-lens", "64k,128k", "--loss-chunks", "4096"]
    assert PF.main([*argv, "--largest"]) == 0
    assert calls == [("a100-80", 2, 2, 65536, 1), (960, 4096)]
    assert "a100-80  C=2: largest T 196,608 (5 MiB per card; probes 2)" in capsys.readouterr().out


def test_a_models_saved_selections_are_what_bench_kernels_times(tmp_path):
    """selection_locality --save-idx writes a layer's selections; bench_kernels --idx-file reads them back
    (the first KV heads, the first T positions) in place of random ones, and refuses a file of another
    block geometry or a layer it lacks with one line."""
    from benchmarks import bench_kernels as BK
    from experiments.selection_locality import save_selections
    from nsa_jax.kernels.reference import random_block_indices

    rng = np.random.default_rng(0)
    idx = np.stack([random_block_indices(rng, 2, 512, 3, 16, 64) for _ in range(3)])  # [layers, rows, T, K, n]
    idx = rng.permuted(idx, axis=-1)  # slots in any order: the file keeps each set sorted, unused (-1) last
    key = np.where(idx < 0, 1 << 20, idx)
    want = np.where(np.sort(key, -1) == 1 << 20, -1, np.sort(key, -1))
    res = {"checkpoint": "ckpt", "length": 512, "lp": 64, "n": 16}
    out = tmp_path / "sel.npz"
    save_selections(str(out), idx, [0, 2], res)
    got = BK.load_selections(str(out), 2)
    np.testing.assert_array_equal(got, want[2][:, :, :2])  # the benchmark's two KV heads of three
    opts = BK.parse_args(["--idx-file", str(out), "--idx-layer", "2", "--batch", "2"])
    *_, used = BK.make_inputs(256, opts, jnp.bfloat16)
    np.testing.assert_array_equal(used, want[2][:, :256, :2])
    with pytest.raises(SystemExit, match="holds layers \\[0, 2\\]"):
        BK.load_selections(str(out), 1)
    with pytest.raises(SystemExit, match="holds 2 rows of 512"):
        BK.make_inputs(1024, opts, jnp.bfloat16)
    save_selections(str(out), idx, [0], res | {"lp": 32})
    with pytest.raises(SystemExit, match="blocks of 32 and n=16, the benchmark's are 64 and 16"):
        BK.load_selections(str(out), None)


@pytest.mark.slow
def test_bench_train_times_each_setting_once_and_a_failing_one_costs_no_other_row(tmp_path):
    """--global-batches x --variants: a variant that names its own batch is timed once; a variant that fails
    (a bad config) is reported, the other rows and the peak still come out, and the exit status says so."""
    out = tmp_path / "train.json"
    small = ["--set", "model.n_layers=1", "--set", "train.seq_len=128", "--set", "train.accumulate=1"]
    args = ["--configs", "cpu_tiny", *small, "--steps", "1", "--peak-n", "64", "--global-batches", "2,4"]
    args += ["--variants", "train.global_batch=2,model.nsa.lp=7", "--json", str(out)]
    proc = run_cli("benchmarks.bench_train", *args, timeout=600, check=False)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert sorted(r["global_batch"] for r in data["rows"]) == [2, 4] and all(r["mfu"] > 0 for r in data["rows"])
    assert len(data["failed"]) == 1 and "model.nsa.lp=7" in data["failed"][0] and "ConfigError" in data["failed"][0]
    assert "error: 1 of 3 rows failed" in proc.stderr
