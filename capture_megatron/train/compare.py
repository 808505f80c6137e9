"""Predicted vs measured peak per pipeline rank (`capture-megatron verify`, the demo)."""

from __future__ import annotations

from dataclasses import dataclass

from capture_megatron.train.report import MemoryReport


@dataclass(frozen=True)
class RankCheck:
    """Predicted vs measured peak of one pipeline rank."""

    pp_rank: int
    """Pipeline rank."""
    predicted_bytes: int
    """Predicted peak (allocated)."""
    measured_bytes: int
    """Measured peak (allocated; the maximum over its TP/DP peers)."""
    reserved_bytes: int
    """CUDA: measured peak reserved by the allocator (0 on CPU)."""
    without_gpu_bytes: int | None = None
    """On a GPU: the forecast of the same plan made without it (the GPU kernel set on fake CUDA
    tensors, what `predict` forecasts on a machine without the GPU); None elsewhere."""

    @property
    def error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted_bytes - self.measured_bytes) / max(self.measured_bytes, 1)

    @property
    def without_gpu_error(self) -> float | None:
        """(forecast without the GPU - measured) / measured, or None."""
        if self.without_gpu_bytes is None:
            return None
        return (self.without_gpu_bytes - self.measured_bytes) / max(self.measured_bytes, 1)


def compare(
    predicted: tuple[int, ...],
    report: MemoryReport,
    without_gpu: tuple[int, ...] | None = None,
) -> list[RankCheck]:
    """Each pipeline rank's predicted peak (and `without_gpu`, the forecast made without the GPU
    when one was made) against the report's measured one."""
    reserved = [0] * report.plan.pp
    for r in report.ranks:
        reserved[r.pp_rank] = max(reserved[r.pp_rank], r.reserved_bytes)
    return [
        RankCheck(
            r,
            int(predicted[r]),
            int(m),
            reserved[r],
            None if without_gpu is None else int(without_gpu[r]),
        )
        for r, m in enumerate(report.stage_peaks())
    ]
