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

    @property
    def error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted_bytes - self.measured_bytes) / max(self.measured_bytes, 1)


def compare(predicted: tuple[int, ...], report: MemoryReport) -> list[RankCheck]:
    """Each pipeline rank's predicted peak against the report's measured one."""
    reserved = [0] * report.plan.pp
    for r in report.ranks:
        reserved[r.pp_rank] = max(reserved[r.pp_rank], r.reserved_bytes)
    return [
        RankCheck(r, int(predicted[r]), int(m), reserved[r])
        for r, m in enumerate(report.stage_peaks())
    ]
