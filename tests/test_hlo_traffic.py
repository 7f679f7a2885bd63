"""The parts of the model by op_name (nsa_jax/tools/parts.py) and what a compiled program's launches move
(nsa_jax/tools/hlo_traffic.py): bytes and flops by hand from a small module's shapes, and the NSA layer's
named scopes in a program compiled on this CPU."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import pytest

from nsa_jax.config import load_config
from nsa_jax.nsa.layer import NSAAttention
from nsa_jax.tools import hlo_traffic, parts, xla_dump
from nsa_jax.tools.xla_dump import Launch

MODULE = """\
%fused_slice (param_0: f32[1024,64]) -> f32[8,64] {
  %param_0 = f32[1024,64]{1,0} parameter(0)
  ROOT %slice.1 = f32[8,64]{1,0} slice(%param_0), slice={[0:8], [0:64]}
}

%fused_dus (param_0.1: s32[33,100], param_1.1: s32[1,100], param_2.1: s32[]) -> s32[33,100] {
  %param_0.1 = s32[33,100]{1,0} parameter(0)
  %param_1.1 = s32[1,100]{1,0} parameter(1)
  %param_2.1 = s32[] parameter(2)
  %constant.1 = s32[] constant(0)
  ROOT %dynamic-update-slice.1 = s32[33,100]{1,0} dynamic-update-slice(%param_0.1, %param_1.1, %param_2.1, %constant.1)
}

%gemm_computation (parameter_0: bf16[256,128], parameter_1: bf16[128,64]) -> bf16[256,64] {
  %parameter_0 = bf16[256,128]{1,0} parameter(0)
  %parameter_1 = bf16[128,64]{1,0} parameter(1)
  ROOT %dot.1 = bf16[256,64]{1,0} dot(%parameter_0, %parameter_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (p0: f32[1024,64], x: f32[8], buf: s32[33,100], upd: s32[1,100], i: s32[], a: bf16[256,128], b: bf16[128,64]) -> f32[8] {
  %p0 = f32[1024,64]{1,0} parameter(0)
  %x = f32[8]{0} parameter(1)
  %buf = s32[33,100]{1,0} parameter(2)
  %upd = s32[1,100]{1,0} parameter(3)
  %i = s32[] parameter(4)
  %a = bf16[256,128]{1,0} parameter(5)
  %b = bf16[128,64]{1,0} parameter(6)
  %loop_slice_fusion = f32[8,64]{1,0} fusion(%p0), kind=kLoop, calls=%fused_slice, metadata={op_name="jit(f)/jvp(NSAAttention)/nsa_qkv/slice"}
  %loop_dynamic_update_slice_fusion = s32[33,100]{1,0} fusion(%buf, %upd, %i), kind=kLoop, calls=%fused_dus, metadata={op_name="jit(f)/transpose(jvp(NSAAttention))/nsa_slc/while/body/dynamic_update_slice"}
  %gemm_fusion_dot = bf16[256,64]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_computation, metadata={op_name="jit(f)/jvp(NSAAttention)/nsa_out/o/dot_general"}
  %copy.1 = f32[1024,64]{0,1} copy(%p0)
  %dot.2 = bf16[256,64]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/mlp/w1/dot_general" source_file="/src/nsa_jax/layers.py" source_line=42}
  ROOT %pallas_call.3 = f32[8]{0} custom-call(%x), custom_call_target="__gpu$xla.gpu.triton"
}
"""  # noqa: E501


def launches() -> list[Launch]:
    rows = [
        ("loop_slice_fusion", "loop_slice_fusion", "fusions", 1),
        ("loop_dynamic_update_slice_fusion", "loop_dynamic_update_slice_fusion", "copies", 33),
        ("gemm_fusion_dot", "gemm_fusion_dot", "gemm", 2),
        ("copy.1", "copy.1", "copy_thunks", 1),
        ("dot.2", "sm90_xmma_gemm", "gemm", 1),
        ("pallas_call.3", "nsa_window_fwd", "pallas", 1),
    ]
    return [Launch(i, "kCustomKernel", hlo, kernel, cat, n, ()) for i, (hlo, kernel, cat, n) in enumerate(rows)]


def test_bytes_and_flops_of_each_launch_from_the_shapes(tmp_path):
    (tmp_path / "module_0001.jit_f.thunk_sequence.txt").write_text("")
    (tmp_path / "module_0001.jit_f.sm_9.0a_gpu_after_optimizations.txt").write_text(MODULE)
    got = {t.launch.hlo: t for t in hlo_traffic.launch_traffic(str(tmp_path), launches())}
    # A fusion that only slices its operand reads the slice: 8 x 64 f32 read, the same written.
    assert got["loop_slice_fusion"].bytes == 2 * 8 * 64 * 4
    # An in-place update reads its update and index, writes the update; the buffer is not streamed.
    assert got["loop_dynamic_update_slice_fusion"].bytes == (100 * 4 + 4) + 100 * 4
    # A gemm: both operands and the result; 2 M N K flops.
    assert got["gemm_fusion_dot"].bytes == (256 * 128 + 128 * 64 + 256 * 64) * 2
    assert got["gemm_fusion_dot"].flops == 2 * 256 * 64 * 128
    assert got["copy.1"].bytes == 2 * 1024 * 64 * 4 and got["copy.1"].flops == 0
    assert got["pallas_call.3"].bytes == 2 * 8 * 4
    # A dot launched on its own (a library call): the same count as inside a gemm fusion.
    assert got["dot.2"].flops == 2 * 256 * 64 * 128 and got["dot.2"].bytes == got["gemm_fusion_dot"].bytes
    assert hlo_traffic.parse_module(MODULE)["main"]["dot.2"].source == "layers.py:42"
    parts_of = {hlo: t.part for hlo, t in got.items()}
    assert parts_of == {
        "loop_slice_fusion": "qkv proj + RoPE",
        "loop_dynamic_update_slice_fusion": "selection",
        "gemm_fusion_dot": "out proj",
        "copy.1": "other",  # no op_name
        "dot.2": "mlp",
        "pallas_call.3": "window",  # no op_name: the kernel's own name
    }
    bandwidth, peak = 1e9, 1e9
    rows = {(r["part"], r["pallas"]): r for r in hlo_traffic.by_part(list(got.values()), bandwidth, peak)}
    sel = rows[("selection", False)]
    assert sel["launches"] == 33 and sel["bytes"] == 33 * 804
    assert sel["floor_ms"] == pytest.approx(33 * 804 / bandwidth * 1e3)
    gemm = rows[("out proj", False)]  # flops over peak is the larger: 2 runs x 4.19 ms
    assert gemm["flops"] == 2 * 2 * 256 * 64 * 128
    assert gemm["floor_ms"] == pytest.approx(2 * 2 * 256 * 64 * 128 / peak * 1e3)
    assert rows[("window", True)]["launches"] == 1
    top = hlo_traffic.top_launches(list(got.values()), bandwidth, peak, 3)
    assert [r["hlo"] for r in top] == ["gemm_fusion_dot", "dot.2", "copy.1"]  # the Pallas kernel is not listed


def test_part_of_reads_the_layer_scopes_then_kernel_names_then_words():
    part_of = parts.part_of
    assert part_of("jit(step)/layers/attn/nsa_slc/while/body/dot_general") == "selection"
    assert part_of("jit(f)/transpose(jvp(NSAAttention))/nsa_cmp/compress/cmp_k/dot_general") == "compression MLP"
    assert part_of("jit(f)/jvp(NSAAttention)/nsa_cmp/pallas_call") == "compressed attn + top-n"
    # A where() inside the gates lowers to select_n: the scope decides, not the word "select".
    assert part_of("jit(f)/jvp(NSAAttention)/nsa_gates/select_n") == "gates"
    assert part_of("kernel:nsa_selection_bsp_dkv") == "selection"
    assert part_of("kernel:nsa_block_select") == "compressed attn + top-n"
    assert part_of("kernel:nsa_window_fwd") == "window"
    assert part_of("jit(step)/layers/mlp/w1/dot_general") == "mlp"
    assert part_of("jit(step)/something/else") == "other"
    assert set(parts.PARTS) >= {p for p, _ in parts.LAYER_PARTS} | {"other"}


@pytest.mark.slow
@pytest.mark.parametrize("scorer", ["cmp", "minmax"])
def test_every_op_of_the_layer_is_in_a_named_part(scorer):
    """The layer's forward and backward compiled on this CPU: each of its parts names ops (the block
    scorer's own part under a scorer that reads the selection keys), and all but a few ops of
    NSAAttention (iotas of positions) sit in one of its scopes."""
    cfg = load_config("cpu_tiny", [f"model.nsa.scorer={scorer}"]).model
    layer = NSAAttention(cfg)
    x = jnp.ones((1, 128, cfg.d_model), jnp.float32)
    params = layer.init(jax.random.PRNGKey(0), x)["params"]

    def forward_backward(p, xx):
        def forward(pp, x_):
            y, aux = layer.apply({"params": pp}, x_, mutable=["aux"])
            return y + 0 * sum(jnp.sum(v) for v in jax.tree.leaves(aux))  # keeps the statistics

        y, vjp = jax.vjp(forward, p, xx)
        return vjp(y)

    text = jax.jit(forward_backward).lower(params, x).compile().as_text()
    counts = collections.Counter(
        parts.part_of(ins.op_name)
        for body in hlo_traffic.parse_module(text).values()
        for ins in body.values()
        if "NSAAttention" in ins.op_name
    )
    expected = {p for p, _ in parts.LAYER_PARTS} - ({"block scorer + top-n"} if scorer == "cmp" else set())
    assert expected - set(counts) == set() and set(counts) - {"other"} <= expected, counts
    assert counts["other"] <= 0.02 * sum(counts.values()), counts


def test_collective_group_sizes_in_each_form_xla_prints():
    """replica_groups as explicit groups, an iota list, or named mesh axes (the SPMD partitioner's
    collectives, e.g. zero1's parameter gathers): each is matched and sized."""
    assert xla_dump.group_size("{{0,1},{2,3}}") == 2
    assert xla_dump.group_size("[2,4]<=[8]") == 4
    assert xla_dump.group_size("mesh['axis_0'=1,'axis_1'=1,'axis_2'=2] {'axis_2'}") == 2
    assert xla_dump.group_size("mesh['data'=2,'seq'=4] {'data','seq'}") == 8
    line = (
        "  %all-gather-start.13 = (f32[12,768,1024]{1,0,2}, f32[12,768,2048]{1,0,2}) all-gather-start("
        "%bitcast.3296.0), channel_id=62, replica_groups=mesh['axis_0'=1,'axis_1'=1,'axis_2'=2] {'axis_2'}, "
        "dimensions={2}, use_global_device_ids=true"
    )
    ((name, _, op, groups),) = xla_dump._COLLECTIVE.findall(line)
    assert (name, op, xla_dump.group_size(groups)) == ("all-gather-start.13", "all-gather-start", 2)


LOOPED = """\
%gather_wrapper (param_0.9: bf16[4,256]) -> bf16[16,256] {
  %param_0.9 = bf16[4,256]{1,0} parameter(0)
  ROOT %all-gather.1 = bf16[16,256]{1,0} all-gather(%param_0.9), replica_groups={{0,1,2,3}}, dimensions={0}
}

%body (p: (s32[], f32[1024])) -> (s32[], f32[1024]) {
  %p = (s32[], f32[1024]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[1024]{0} get-tuple-element(%p), index=1
  %all-reduce.7 = f32[1024]{0} all-reduce(%x), replica_groups={{0,1}}, to_apply=%add
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[1024]{0}) tuple(%next, %all-reduce.7)
}

%cond (p.1: (s32[], f32[1024])) -> pred[] {
  %p.1 = (s32[], f32[1024]{0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %bound = s32[]{:T(128)} constant(12)
  ROOT %lt = pred[] compare(%i.1, %bound), direction=LT
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (x.2: f32[1024], y.2: bf16[4,256]) -> (f32[1024], bf16[16,256]) {
  %x.2 = f32[1024]{0} parameter(0)
  %y.2 = bf16[4,256]{1,0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[1024]{0}) tuple(%zero, %x.2)
  %loop = (s32[], f32[1024]{0}) while(%init), condition=%cond, body=%body
  %out = f32[1024]{0} get-tuple-element(%loop), index=1
  %g = bf16[16,256]{1,0} fusion(%y.2), kind=kCustom, calls=%gather_wrapper
  ROOT %r = (f32[1024]{0}, bf16[16,256]{1,0}) tuple(%out, %g)
}
"""


def test_collectives_of_a_compiled_text_count_their_loops_trips():
    # By hand: the all-reduce of 1024 fp32 runs in a loop of 12 trips (its condition's bound), the
    # all-gather to 16 x 256 bf16 once, inside a fusion's computation; the reduction `add` holds none.
    got = xla_dump.hlo_collectives(LOOPED)
    assert got == {
        "all-reduce": {"count": 12, "payload_bytes": 12 * 1024 * 4},
        "all-gather": {"count": 1, "payload_bytes": 16 * 256 * 2},
    }
