"""benchmarks/export_report.py: the layer's CUDA export read back at a small T."""

from __future__ import annotations

import json

from benchmarks import export_report

T = 1536  # a100_pcie shape: H=12, K=2, D=64, l=32, d=16, lp=64, n=16; Nb=24, T_cmp=95 (no axis equals n)


def test_tensor_types_and_custom_calls_from_text():
    text = (
        "%0 = stablehlo.add %a, %b : tensor<1x2x8x4xf32>\n"
        "%1 = stablehlo.custom_call @__gpu$xla.gpu.triton(%0) : (tensor<1x2x8x4xf32>) -> tensor<3x5xbf16>\n"
        "%2 = stablehlo.custom_call @__gpu$xla.gpu.triton(%1) : (tensor<3x5xbf16>) -> tensor<i1>\n"
        "%3 = stablehlo.custom_call @cu_thing(%2) : (tensor<i1>) -> tensor<100xi32>\n"
    )
    tensors = export_report.tensor_types(text)
    assert [(t["shape"], t["dtype"], t["bytes"]) for t in tensors] == [
        ([100], "i32", 400),
        ([1, 2, 8, 4], "f32", 256),
        ([3, 5], "bf16", 30),
        ([], "i1", 1),
    ]
    assert export_report.custom_calls(text) == {export_report.TRITON_TARGET: 2, "cu_thing": 1}


def test_fingerprint_ignores_source_locations_only():
    body = '%0 = stablehlo.add %a, %b : tensor<4xf32> loc(#loc3)\n%1 = stablehlo.custom_call @k(%0) {ir = "x"}'
    moved = '%0 = stablehlo.add %a, %b : tensor<4xf32> loc(#loc9)\n%1 = stablehlo.custom_call @k(%0) {ir = "x"}'
    fp = export_report.fingerprint
    assert fp(body + '\n#loc3 = loc("a.py":10:2)') == fp(moved + '\n#loc9 = loc("a.py":12:2)')
    assert fp(body) != fp(body.replace('ir = "x"', 'ir = "y"'))  # a kernel's IR changed
    assert fp(body) != fp(body.replace("f32", "bf16"))


def test_report_pallas_layer_has_no_score_tensor(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert export_report.main(["--seq-len", str(T), "--json", str(out), "--max-tensor-mib", "64"]) == 0
    text = capsys.readouterr().out
    assert f"T={T}" in text and "largest tensor: " in text
    r = json.loads(out.read_text())
    # Forward: compressed attention, block selection, selection, window; backward: dq and dk/dv
    # of each branch. T <= 2 n lp, so the selection runs the block-sparse flash kernel, whose
    # dk/dv needs no reverse index (the gather kernel above that length adds its segment reduction).
    assert r["kernel_custom_calls"] == 10
    assert r["score_tensors"] == []
    assert len(r["fingerprint"]) == 16 and "fingerprint (the GPU program" in text
    largest = r["largest"]
    assert largest["bytes"] == max(t["bytes"] for t in r["top"]) and largest["bytes"] <= 64 * 2**20
    assert f"{'x'.join(map(str, largest['shape']))}x{largest['dtype']}" in text


def test_report_sees_the_xla_score_tensors(capsys):
    # The check can fail: the XLA path ranks blocks from a [B, T, K, T/lp] score tensor.
    assert export_report.main(["--seq-len", str(T), "--impl", "xla", "--max-tensor-mib", "1e-3"]) == 1
    text = capsys.readouterr().out
    assert "kernel custom calls (__gpu$xla.gpu.triton): 0" in text
    assert f"1x{T}x2x{T // 64}xf32" in text


def test_bad_input_is_one_error_line(capsys):
    assert export_report.main(["--seq-len", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --seq-len 8")
    assert export_report.main(["--set", "model.nsa.d=5"]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    # attention_impl=pallas asked for explicitly with a block length its selection kernel cannot take.
    assert export_report.main(["--seq-len", "256", "--set", "model.nsa.lp=48"]) == 2
    assert capsys.readouterr().err.startswith("error: block_size=48")
