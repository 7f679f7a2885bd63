"""The cards this project compiles for without them (nsa_jax/tools/aot.py): their public specifications.

`TARGETS`: A100 40GB and 80GB PCIe (sm_80), H100 80GB SXM (sm_90) and L4 24GB (sm_89, the strategy
study's card), each a `GpuTarget` whose fields are XLA's GpuDeviceInfoProto; `config_text()` is the
target config jax's topology API compiles for, `usable_bytes()` the share of the card jax's allocator
takes. `TPU_TARGETS`: TPU slices (`TpuTarget`: v4, v5e, v5p, v6e) by their topology names. `get_target(name)`
names the valid cards and slices on a bad one.
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


@dataclasses.dataclass(frozen=True)
class TpuTarget:
    """A TPU slice, by its Cloud name (`v5e-8`: the chips' generation and the slice's size in chips for v5e /
    v6e, in TensorCores for v4 / v5p) and the topology jax compiles for (`v5e:2x4`); libtpu describes the
    chips, this names the slice and the public HBM per chip."""

    name: str
    topology: str
    chips: int
    hbm_per_chip: int
    bf16_flops_per_chip: float

    @property
    def description(self) -> str:
        return f"TPU {self.topology} slice, {self.chips} chips of {self.hbm_per_chip / 2**30:.0f} GiB"

    def usable_bytes(self, fraction: float | None = None) -> int:
        """A chip's HBM: jax's TPU client hands out all of it (no allocator fraction), less what the program's
        own runtime reserves, which only a TPU shows."""
        return int(self.hbm_per_chip * (1.0 if fraction is None else fraction))


def _tpu(name: str, topology: str, chips: int, gib: int, tflops: float) -> TpuTarget:
    return TpuTarget(name, topology, chips, gib * 2**30, tflops * 1e12)


# Slices whose topology libtpu describes on a CPU host; the multi-host ones (v5e-16, v6e-16, v5p-16) compile
# as one program over all their chips, as each host's process would run it.
TPU_TARGETS: dict[str, TpuTarget] = {
    t.name: t
    for t in (
        _tpu("v4-8", "v4:2x2x1", 4, 32, 275),
        _tpu("v4-16", "v4:2x2x2", 8, 32, 275),
        _tpu("v5e-4", "v5e:2x2", 4, 16, 197),
        _tpu("v5e-8", "v5e:2x4", 8, 16, 197),
        _tpu("v5e-16", "v5e:4x4", 16, 16, 197),
        _tpu("v5p-8", "v5p:2x2x1", 4, 95, 459),
        _tpu("v5p-16", "v5p:2x2x2", 8, 95, 459),
        _tpu("v6e-4", "v6e:2x2", 4, 32, 918),
        _tpu("v6e-8", "v6e:2x4", 8, 32, 918),
        _tpu("v6e-16", "v6e:4x4", 16, 32, 918),
    )
}


def get_target(name: str) -> GpuTarget | TpuTarget:
    """The card or TPU slice `name`; a bad name is refused with the valid ones."""
    if name in TARGETS:
        return TARGETS[name]
    if name in TPU_TARGETS:
        return TPU_TARGETS[name]
    raise ValueError(f"unknown target {name!r}; GPU cards: {', '.join(TARGETS)}; TPU slices: {', '.join(TPU_TARGETS)}")
