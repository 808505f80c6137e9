"""Hardware profiles: what the step-time model assumes about the accelerators and their links
(--gpu-type, each value overridable by flag). Pure Python.

Every number's source is listed in docs/STEP_TIME.md (vendor datasheets; memory as the driver
reports it). Bandwidths are per GPU and per direction, in bytes per second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

from capture_megatron.config.model import GIB
from capture_megatron.errors import CaptureError, require
from capture_megatron.fields import flag
from capture_megatron.serial import JsonMixin


@dataclass(frozen=True)
class Hardware(JsonMixin):
    """One accelerator type and the links between accelerators (validated: every number finite
    and positive)."""

    name: str = "h100-sxm"
    """The profile's name (--gpu-type)."""
    peak_flops: float = 989.4e12
    """Dense BF16 tensor-core FLOP/s of one GPU (no sparsity)."""
    fp32_flops: float = 67e12
    """FP32 FLOP/s of one GPU without tensor cores (what an fp32 GEMM such as an fp32 MoE router
    runs at: PyTorch leaves TF32 off for matmuls)."""
    memory_bytes: int = int(79.65 * GIB)
    """Device memory one process can use, as the driver reports it (the default of
    --gpu-memory-gib)."""
    hbm_bytes_per_s: float = 3.35e12
    """Device-memory bandwidth of one GPU."""
    nvlink_bytes_per_s: float = 450e9
    """NVLink bandwidth of one GPU, per direction (collectives inside an NVLink domain)."""
    network_bytes_per_s: float = 50e9
    """Scale-out network bandwidth of one GPU, per direction (collectives across nodes)."""
    gpus_per_node: int = 8
    """GPUs per node (a Slurm node; tensor parallelism stays inside one)."""
    nvlink_domain: int = 8
    """GPUs that reach each other over NVLink (8 in an HGX node, 72 in a GB200 NVL72 rack)."""
    host_bytes_per_s: float = 64e9
    """Host-device bandwidth of one GPU, per direction (PCIe Gen5 x16, or NVLink-C2C): the
    gradient and parameter copies of --optimizer-cpu-offload (plan/offload_cost.py)."""
    host_memory_bytes: int = 2 * 1024 * GIB
    """Host (CPU) memory of one node, which the node's ranks share: --optimizer-cpu-offload's host
    copies must fit in it (DGX H100 / H200 / B200 datasheets: 2 TB system memory)."""

    def __post_init__(self) -> None:
        p = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "name" and not (math.isfinite(value) and value > 0):
                p.append(f"{FLAG_OF.get(f.name, f.name)} {value:g} must be a positive number")
        if self.nvlink_domain < 1 or self.gpus_per_node < 1:
            p.append("GPUs per node and per NVLink domain must be at least 1")
        require(p, f"hardware profile {self.name!r}")

    def link_bytes_per_s(self, first: int, count: int, stride: int) -> float:
        """Per-GPU bandwidth of a collective over `count` ranks `stride` apart starting at global
        rank `first` (Megatron's rank order): NVLink when they share an NVLink domain, else the
        network of the members each node holds (hierarchical rings; never above NVLink)."""
        span = (count - 1) * stride
        if first // self.nvlink_domain == (first + span) // self.nvlink_domain:
            return self.nvlink_bytes_per_s
        per_node = max(1, min(count, self.nvlink_domain // max(stride, 1)))
        return min(self.nvlink_bytes_per_s, per_node * self.network_bytes_per_s)


def _profile(name: str, **values: Any) -> Hardware:
    return replace(Hardware(name=name), **values)


PROFILES: dict[str, Hardware] = {
    "h100-sxm": Hardware(),
    "h200": _profile("h200", memory_bytes=int(140.40 * GIB), hbm_bytes_per_s=4.8e12),
    "b200": _profile(
        "b200",
        peak_flops=2.25e15,
        fp32_flops=75e12,
        memory_bytes=int(179 * GIB),
        hbm_bytes_per_s=8e12,
        nvlink_bytes_per_s=900e9,
    ),
    "gb200": _profile(
        "gb200",
        peak_flops=2.5e15,
        fp32_flops=80e12,
        memory_bytes=int(186e9),
        hbm_bytes_per_s=8e12,
        nvlink_bytes_per_s=900e9,
        gpus_per_node=4,
        nvlink_domain=72,
        host_bytes_per_s=450e9,
        host_memory_bytes=2 * 480 * GIB,
    ),
    "a100-80gb": _profile(
        "a100-80gb",
        peak_flops=312e12,
        fp32_flops=19.5e12,
        memory_bytes=80 * GIB,
        hbm_bytes_per_s=2.039e12,
        nvlink_bytes_per_s=300e9,
        network_bytes_per_s=25e9,
        host_bytes_per_s=32e9,
    ),
}
"""The built-in profiles by --gpu-type name (sources: docs/STEP_TIME.md)."""
ALIASES = {
    "h100": "h100-sxm",
    "a100": "a100-80gb",
    "h100-sxm5": "h100-sxm",
    "a100-sxm": "a100-80gb",
}
"""Other spellings --gpu-type accepts."""
FLAG_OF = {
    "peak_flops": "--peak-tflops",
    "memory_bytes": "--gpu-memory-gib",
    "hbm_bytes_per_s": "--hbm-gbps",
    "nvlink_bytes_per_s": "--nvlink-gbps",
    "network_bytes_per_s": "--network-gbps",
    "gpus_per_node": "--gpus-per-node",
    "nvlink_domain": "--nvlink-domain",
    "host_bytes_per_s": "--host-gbps",
    "host_memory_bytes": "--host-memory-gib",
}
"""The flag that overrides each field (named in errors)."""


def gpu_profile(name: str) -> Hardware:
    """The built-in profile of --gpu-type `name` (case-insensitive), or one CaptureError naming the
    known types."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in PROFILES:
        raise CaptureError(
            f"--gpu-type {name!r} is unknown; choose one of {', '.join(PROFILES)} (each value can "
            "then be overridden: --peak-tflops, --hbm-gbps, --nvlink-gbps, --network-gbps, "
            "--host-gbps, --gpus-per-node, --gpu-memory-gib)"
        )
    return PROFILES[key]


@dataclass(frozen=True)
class HardwareFlags:
    """The GPU type and overrides of its profile (None: the profile's value)."""

    gpu_type: str = flag(
        "--gpu-type", "h100-sxm", note=f"(capture-megatron; one of {', '.join(PROFILES)})"
    )
    """The accelerator whose profile the step-time estimate uses; its memory is the default of
    --gpu-memory-gib."""
    peak_tflops: float | None = flag("--peak-tflops", None, note="(capture-megatron)")
    """Dense BF16 TFLOP/s of one GPU (default: the profile's)."""
    hbm_gbps: float | None = flag("--hbm-gbps", None, note="(capture-megatron)")
    """Device-memory bandwidth of one GPU in GB/s (default: the profile's)."""
    nvlink_gbps: float | None = flag("--nvlink-gbps", None, note="(capture-megatron)")
    """NVLink bandwidth of one GPU per direction in GB/s (default: the profile's)."""
    network_gbps: float | None = flag("--network-gbps", None, note="(capture-megatron)")
    """Network bandwidth of one GPU per direction in GB/s (default: the profile's)."""
    host_gbps: float | None = flag("--host-gbps", None, note="(capture-megatron)")
    """Host-device bandwidth of one GPU per direction in GB/s (default: the profile's)."""
    host_memory_gib: float | None = flag("--host-memory-gib", None, note="(capture-megatron)")
    """Host (CPU) memory of one node in GiB, shared by its ranks' --optimizer-cpu-offload host
    copies (default: the profile's, 2 TiB as on a DGX H100)."""
    nvlink_domain: int | None = flag("--nvlink-domain", None, note="(capture-megatron)")
    """GPUs that reach each other over NVLink (default: the profile's)."""
    gemm_efficiency: float | None = flag(
        "--gemm-efficiency", None, aliases=("--mfu",), note="(capture-megatron; formerly --mfu)"
    )
    """Step-time model: the fraction of peak FLOP/s large GEMMs reach, in (0, 1] (default: the
    value fitted to published H100 step times, docs/STEP_TIME.md)."""

    def resolve(
        self, gpus_per_node: int | None = None, memory_gib: float | None = None
    ) -> Hardware:
        """The profile with every given override applied (CaptureError for a bad value)."""
        base = gpu_profile(self.gpu_type)
        scaled = {
            "peak_flops": (self.peak_tflops, 1e12),
            "hbm_bytes_per_s": (self.hbm_gbps, 1e9),
            "nvlink_bytes_per_s": (self.nvlink_gbps, 1e9),
            "network_bytes_per_s": (self.network_gbps, 1e9),
            "host_bytes_per_s": (self.host_gbps, 1e9),
        }
        changes: dict[str, Any] = {k: v * unit for k, (v, unit) in scaled.items() if v is not None}
        bad = [f"{FLAG_OF[k]} {v:g}" for k, (v, _) in scaled.items() if v is not None and not ok(v)]
        for key, value in (("gpus_per_node", gpus_per_node), ("nvlink_domain", self.nvlink_domain)):
            if value is not None:
                changes[key] = value
                bad += [] if value >= 1 else [f"{FLAG_OF[key]} {value}"]
        if self.host_memory_gib is not None:  # in bytes too: 1e308 GiB is finite, its bytes not
            host = self.host_memory_gib
            bad += [] if ok(host * GIB) else [f"--host-memory-gib {host:g}"]
            changes["host_memory_bytes"] = int(host * GIB) if ok(host * GIB) else 1
        if memory_gib is not None:
            bad += [] if ok(memory_gib * GIB) else [f"--gpu-memory-gib {memory_gib:g}"]
            changes["memory_bytes"] = int(memory_gib * GIB) if ok(memory_gib * GIB) else 1
        if bad:
            raise CaptureError(
                f"{', '.join(bad)}: hardware values must be finite and positive (GPU counts at "
                "least 1)"
            )
        if gpus_per_node is not None and self.nvlink_domain is None:  # HGX: the node is the domain
            hgx = base.nvlink_domain == base.gpus_per_node
            changes["nvlink_domain"] = gpus_per_node if hgx else base.nvlink_domain
        return replace(base, **changes)


def ok(value: float) -> bool:
    """Whether a hardware value is a finite positive number."""
    return math.isfinite(value) and value > 0
