"""`python -m launch.preflight OUT_DIR [--allow-busy]`: the machine before a run (the runbooks' preflight).

Writes OUT_DIR/preflight.json (python, jax, backend, devices, `nvidia-smi -L` and `topo -m`, each GPU's
PCIe link generation and width now and at most, the NSA_/NCCL_/XLA_/JAX_/CUDA_ variables) and
OUT_DIR/nvidia_smi_q.xml (`nvidia-smi -q -x`, the full snapshot), prints a line per GPU, and refuses to
start (one line naming the pids, exit 2) when a GPU already holds another process's memory: jax
preallocates most of each card, so a second job on it fails later and less clearly. `--allow-busy`
(ALLOW_BUSY_GPU=1 in launch/run_2xa100_production.sh) only warns. On a machine without nvidia-smi the
GPU fields are null and nothing is refused.
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import shutil
import subprocess
import sys

from launch.cli import Parser, UsageError, run_main

PCIE_FIELDS = (
    "index",
    "name",
    "pcie.link.gen.current",
    "pcie.link.gen.max",
    "pcie.link.width.current",
    "pcie.link.width.max",
)
APP_FIELDS = ("pid", "process_name", "used_memory", "gpu_uuid")


def sh(*cmd: str) -> str | None:
    """A command's stdout, or None when it is missing or fails."""
    if not shutil.which(cmd[0]):
        return None
    r = subprocess.run(cmd, capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


def csv_rows(text: str | None, fields: tuple[str, ...]) -> list[dict[str, str]]:
    """`nvidia-smi --query-...=... --format=csv,noheader` output as dicts (no rows for None or blank)."""
    rows = []
    for line in (text or "").splitlines():
        if line.strip():
            rows.append(dict(zip(fields, (v.strip() for v in line.split(",")))))
    return rows


def pcie_line(gpu: dict[str, str]) -> str:
    """'GPU 0 NVIDIA A100-PCIE-40GB: PCIe gen 4 (max 4) x16 (max x16)', with a note where the link runs
    below its maximum (a card in a slower slot, or a link that trained down)."""
    gen_now, gen_max = gpu.get("pcie.link.gen.current", "?"), gpu.get("pcie.link.gen.max", "?")
    w_now, w_max = gpu.get("pcie.link.width.current", "?"), gpu.get("pcie.link.width.max", "?")
    note = ""
    if (gen_now, w_now) != (gen_max, w_max):
        note = " (below its maximum: an idle card may lower its link generation; check again under load)"
    name = f"GPU {gpu.get('index', '?')} {gpu.get('name', '?')}"
    return f"{name}: PCIe gen {gen_now} (max {gen_max}) x{w_now} (max x{w_max}){note}"


def busy_line(apps: list[dict[str, str]]) -> str | None:
    """The refusal for GPUs that already hold other processes' memory, or None."""
    others = [a for a in apps if a.get("pid") and a["pid"] != str(os.getpid())]
    if not others:
        return None
    held = ", ".join(f"pid {a['pid']} ({a.get('process_name', '?')}, {a.get('used_memory', '?')})" for a in others)
    return (
        f"a GPU already holds another process's memory: {held}; stop it (kill PID) or pass --allow-busy "
        "(ALLOW_BUSY_GPU=1) to start anyway"
    )


def build_parser() -> Parser:
    p = Parser(description=__doc__.splitlines()[0], in_process=True)
    p.add_argument("out", help="folder for preflight.json and nvidia_smi_q.xml (made if missing)")
    p.add_argument("--allow-busy", action="store_true", help="warn, not refuse, when a GPU is already in use")
    return p


def run(args) -> int:
    out = pathlib.Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot make {out}: {e}") from None
    gpus = csv_rows(sh("nvidia-smi", f"--query-gpu={','.join(PCIE_FIELDS)}", "--format=csv,noheader"), PCIE_FIELDS)
    apps = csv_rows(
        sh("nvidia-smi", f"--query-compute-apps={','.join(APP_FIELDS)}", "--format=csv,noheader"), APP_FIELDS
    )
    refusal = busy_line(apps)
    if refusal and not args.allow_busy:  # before jax starts: it would take the cards' memory itself
        raise UsageError(refusal)
    xml = sh("nvidia-smi", "-q", "-x")
    if xml is not None:
        (out / "nvidia_smi_q.xml").write_text(xml + "\n")
    import jax  # noqa: PLC0415 - after the checks: importing jax is slow, and a refusal should be quick

    info = {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": __import__("jaxlib").__version__,
        "backend": jax.default_backend(),
        "devices": [f"{d} ({d.device_kind})" for d in jax.devices()],
        "device_count": jax.device_count(),
        "nvidia_smi_L": sh("nvidia-smi", "-L"),
        "nvidia_smi_topo": sh("nvidia-smi", "topo", "-m"),
        "pcie": gpus or None,
        "compute_apps": apps,
        "nvidia_smi_q": "nvidia_smi_q.xml" if xml is not None else None,
        "env": {
            k: v for k, v in sorted(os.environ.items()) if k.startswith(("NSA_", "NCCL_", "XLA_", "JAX_", "CUDA_"))
        },
    }
    (out / "preflight.json").write_text(json.dumps(info, indent=2) + "\n")
    for gpu in gpus:
        print(f"preflight: {pcie_line(gpu)}")
    if refusal:
        print(f"preflight: WARNING: {refusal.split('; ')[0]} (--allow-busy)", file=sys.stderr)
    print(
        f"preflight: jax {info['jax']} on {info['backend']}: {info['device_count']} device(s) "
        f"-> {out / 'preflight.json'}"
    )
    if info["backend"] != "gpu" or info["device_count"] < 2:
        print("preflight: WARNING: expected 2 GPUs", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(build_parser, run, argv)


if __name__ == "__main__":
    sys.exit(main())
