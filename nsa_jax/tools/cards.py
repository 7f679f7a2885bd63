"""The cards this project compiles for without them (nsa_jax/tools/aot.py): their public specifications.

`TARGETS`: A100 40GB and 80GB PCIe (sm_80), H100 80GB SXM (sm_90) and L4 24GB (sm_89, the strategy
study's card), each a `GpuTarget` whose fields are XLA's GpuDeviceInfoProto; `config_text()` is the
target config jax's topology API compiles for, `usable_bytes()` the share of the card jax's allocator
takes. `get_target(name)` names the valid cards on a bad one.
"""

from __future__ import annotations

import dataclasses
import os

# jax's default GPU allocator takes this fraction of the card at start-up (XLA_PYTHON_CLIENT_MEM_FRACTION).
DEFAULT_MEM_FRACTION = 0.75


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """One card, from its public specifications (the fields of XLA's GpuDeviceInfoProto)."""

    name: str
    description: str  # device_description_str: what jax reports as device_kind
    compute_capability: tuple[int, int]
    core_count: int  # SMs
    fpus_per_core: int
    shared_memory_per_block_optin: int
    shared_memory_per_core: int
    device_memory_size: int
    memory_bandwidth: int  # bytes / s
    l2_cache_size: int
    clock_rate_ghz: float
    bf16_tensor_flops: float = 0.0  # the dense bf16 tensor-core peak of the datasheet, flop / s (not XLA's)
    shared_memory_per_block: int = 49152
    threads_per_block_limit: int = 1024
    threads_per_warp: int = 32
    threads_per_core_limit: int = 2048
    registers_per_core_limit: int = 65536
    registers_per_block_limit: int = 65536

    @property
    def arch(self) -> str:
        """ptxas -arch of the card (sm_90a: the Hopper instructions Triton emits)."""
        major, minor = self.compute_capability
        return f"sm_{major}{minor}" + ("a" if major >= 9 else "")

    def usable_bytes(self, fraction: float | None = None) -> int:
        """Device memory jax's allocator can hand out: `fraction` (default XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75)."""
        if fraction is None:
            fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_MEM_FRACTION))
        return int(self.device_memory_size * fraction)

    def config_text(self) -> str:
        """The GpuTargetConfigProto in protobuf text form."""
        major, minor = self.compute_capability
        fields = {
            k: getattr(self, k)
            for k in (
                "threads_per_block_limit",
                "threads_per_warp",
                "shared_memory_per_block",
                "shared_memory_per_core",
                "threads_per_core_limit",
                "core_count",
                "fpus_per_core",
                "memory_bandwidth",
                "l2_cache_size",
                "clock_rate_ghz",
                "device_memory_size",
                "shared_memory_per_block_optin",
                "registers_per_core_limit",
                "registers_per_block_limit",
            )
        }
        fields.update(block_dim_limit_x=2147483647, block_dim_limit_y=65535, block_dim_limit_z=65535)
        lines = ["gpu_device_info {"] + [f"  {k}: {v}" for k, v in fields.items()]
        lines += [f"  cuda_compute_capability {{ major: {major} minor: {minor} }}", "}"]
        lines += [
            'platform_name: "CUDA"',
            "dnn_version_info { major: 9 minor: 8 }",
            "runtime_version { major: 12 minor: 9 }",
            f'device_description_str: "{self.description}"',
        ]
        return "\n".join(lines) + "\n"


_A100 = dict(
    compute_capability=(8, 0),
    core_count=108,
    fpus_per_core=64,
    shared_memory_per_block_optin=166912,
    shared_memory_per_core=167936,
    l2_cache_size=41943040,
    clock_rate_ghz=1.41,
    bf16_tensor_flops=312e12,
)
TARGETS: dict[str, GpuTarget] = {
    "a100-40": GpuTarget(
        "a100-40", "NVIDIA A100-PCIE-40GB", device_memory_size=42331013120, memory_bandwidth=1555200000000, **_A100
    ),
    "a100-80": GpuTarget(
        "a100-80", "NVIDIA A100 80GB PCIe", device_memory_size=85899345920, memory_bandwidth=1935000000000, **_A100
    ),
    "h100": GpuTarget(
        "h100",
        "NVIDIA H100 80GB HBM3",
        compute_capability=(9, 0),
        core_count=132,
        fpus_per_core=128,
        shared_memory_per_block_optin=232448,
        shared_memory_per_core=233472,
        device_memory_size=85520809984,
        memory_bandwidth=3352320000000,
        l2_cache_size=52428800,
        clock_rate_ghz=1.98,
        bf16_tensor_flops=989e12,
    ),
    # The strategy study's card (seed 004: 2 x L4 24GB, PCIe, no NVLink): AD104, 58 SMs of 128 FP32 lanes,
    # 100 KB of shared memory per SM (99 KB per block), 48 MB of L2, GDDR6 at 300 GB/s, 2.04 GHz boost,
    # 121 TFLOP/s dense bf16; nvidia-smi reports 23,034 MiB.
    "l4": GpuTarget(
        "l4",
        "NVIDIA L4",
        compute_capability=(8, 9),
        core_count=58,
        fpus_per_core=128,
        shared_memory_per_block_optin=101376,
        shared_memory_per_core=102400,
        device_memory_size=24152899584,
        memory_bandwidth=300000000000,
        l2_cache_size=50331648,
        clock_rate_ghz=2.04,
        bf16_tensor_flops=121e12,
        threads_per_core_limit=1536,
    ),
}


def get_target(name: str) -> GpuTarget:
    if name not in TARGETS:
        raise ValueError(f"unknown GPU target {name!r}; choose one of {', '.join(TARGETS)}")
    return TARGETS[name]
