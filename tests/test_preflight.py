"""launch.preflight against a stand-in nvidia-smi on PATH: the snapshot, each GPU's PCIe link, and the
refusal of a GPU that already holds another process's memory (one line naming the pid, exit 2)."""

from __future__ import annotations

import json
import os
import pathlib
import stat
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

FAKE = """#!/bin/sh
case "$*" in
  "-q -x") echo '<?xml version="1.0" ?><nvidia_smi_log><attached_gpus>2</attached_gpus></nvidia_smi_log>' ;;
  "-L") echo "GPU 0: NVIDIA A100-PCIE-40GB (UUID: GPU-a)"; echo "GPU 1: NVIDIA A100-PCIE-40GB (UUID: GPU-b)" ;;
  "topo -m") echo "GPU0 X PHB"; echo "GPU1 PHB X" ;;
  --query-gpu=*) echo "0, NVIDIA A100-PCIE-40GB, 4, 4, 16, 16"; echo "1, NVIDIA A100-PCIE-40GB, 3, 4, 8, 16" ;;
  --query-compute-apps=*) printf "%s" "$APPS" ;;
  *) exit 9 ;;
esac
"""


def _run(tmp_path, *args, apps=""):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(FAKE)
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "APPS": apps, "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-m", "launch.preflight", str(tmp_path / "out"), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_preflight_keeps_the_snapshot_and_each_gpus_pcie_link(tmp_path):
    r = _run(tmp_path)
    assert r.returncode == 0, r.stderr
    info = json.loads((tmp_path / "out" / "preflight.json").read_text())
    assert [g["pcie.link.gen.current"] for g in info["pcie"]] == ["4", "3"]
    assert info["pcie"][1]["pcie.link.width.current"] == "8" and info["nvidia_smi_q"] == "nvidia_smi_q.xml"
    assert "<attached_gpus>2</attached_gpus>" in (tmp_path / "out" / "nvidia_smi_q.xml").read_text()
    assert "GPU 0 NVIDIA A100-PCIE-40GB: PCIe gen 4 (max 4) x16 (max x16)\n" in r.stdout
    assert "GPU 1 NVIDIA A100-PCIE-40GB: PCIe gen 3 (max 4) x8 (max x16) (below its maximum" in r.stdout
    assert "expected 2 GPUs" in r.stderr  # a CPU backend here


def test_a_busy_gpu_is_refused_in_one_line_unless_allowed(tmp_path):
    apps = "4242, python, 30000 MiB, GPU-a\n"
    r = _run(tmp_path, apps=apps)
    assert r.returncode == 2 and not (tmp_path / "out" / "preflight.json").exists()
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "pid 4242 (python, 30000 MiB)" in err[0] and "--allow-busy" in err[0]
    ok = _run(tmp_path, "--allow-busy", apps=apps)
    assert ok.returncode == 0 and "WARNING: a GPU already holds" in ok.stderr
    assert json.loads((tmp_path / "out" / "preflight.json").read_text())["compute_apps"][0]["pid"] == "4242"
