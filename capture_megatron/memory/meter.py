"""MemoryMeter: one interface for the profiler and the trainer, per device.

- CpuMeter: exact live tensor bytes on the host (LiveTensorTracker), process-long.
- FakeMeter: the same accounting for FakeTensorMode tensors (enter it inside the fake mode).
- CudaMeter: the caching allocator's allocated bytes (torch.cuda.memory_allocated /
  max_memory_allocated) and, separately, what it reserves on top (max_memory_reserved).
"""

from __future__ import annotations

from capture_megatron.memory.live import LiveTensorTracker


class MemoryMeter:
    """Live and peak allocated bytes of this process."""

    device = "cpu"
    """cpu, fake or cuda."""

    def current(self) -> int:
        """Bytes allocated now."""
        raise NotImplementedError

    def peak(self) -> int:
        """Peak bytes since the last reset_peak()."""
        raise NotImplementedError

    def reset_peak(self) -> None:
        """Start a new peak window at the current bytes."""
        raise NotImplementedError

    def reserved(self) -> int:
        """Peak bytes the allocator held (CUDA); 0 where there is no caching allocator."""
        return 0

    def stop(self) -> None:
        """Stop measuring (no-op unless the meter runs a mode)."""

    def start_events(self) -> None:
        """Begin logging allocations and releases (cpu and fake; a no-op on cuda)."""

    def take_events(self) -> list[tuple[str, int, int]] | None:
        """('+op' or '-op', bytes, origin) per allocation/release since start_events() (origin: see
        LiveTensorTracker.events); None on cuda."""
        return None


class CpuMeter(MemoryMeter):
    """Exact accounting of host tensor storages from creation on (a process-long dispatch mode)."""

    device = "cpu"

    def __init__(self, only: str | None = None):
        self.tracker = LiveTensorTracker(only)
        self.tracker.__enter__()

    def current(self) -> int:
        """Live tensor bytes now."""
        return self.tracker.current_bytes

    def peak(self) -> int:
        """Peak live tensor bytes since the last reset_peak()."""
        return self.tracker.peak_bytes

    def reset_peak(self) -> None:
        """Start a new peak window at the current live bytes."""
        self.tracker.reset_peak()

    def stop(self) -> None:
        """Leave the tracker's dispatch mode: nothing is counted after this."""
        self.tracker.__exit__(None, None, None)

    def start_events(self) -> None:
        """Begin logging allocations and releases."""
        self.tracker.start_events()

    def take_events(self) -> list[tuple[str, int, int]] | None:
        """The log since start_events() (see LiveTensorTracker.events); logging stops."""
        return self.tracker.take_events()


class FakeMeter(CpuMeter):
    """CpuMeter for FakeTensorMode tensors (create it while the fake mode is active); `only`:
    count the tensors of this device type only ('cuda' on the fake-cuda device)."""

    device = "fake"


class CudaMeter(MemoryMeter):
    """torch.cuda's allocator statistics (this process's current device)."""

    device = "cuda"

    def __init__(self) -> None:
        import torch

        self.cuda = torch.cuda
        self.cuda.reset_peak_memory_stats()

    def current(self) -> int:
        """Bytes allocated now (torch.cuda.memory_allocated)."""
        return int(self.cuda.memory_allocated())

    def peak(self) -> int:
        """Peak allocated bytes since the last reset_peak() (max_memory_allocated)."""
        return int(self.cuda.max_memory_allocated())

    def reset_peak(self) -> None:
        """Reset torch.cuda's peak statistics: a new window at the current bytes."""
        self.cuda.reset_peak_memory_stats()

    def reserved(self) -> int:
        """Peak bytes the caching allocator held (max_memory_reserved)."""
        return int(self.cuda.max_memory_reserved())


_METERS: dict[str, MemoryMeter] = {}


def make_meter(device: str) -> MemoryMeter:
    """The process's meter for `device` (cpu and cuda meters are created once and shared)."""
    if device in ("fake", "fake-cpu"):
        return FakeMeter()
    if device == "fake-cuda":
        return FakeMeter(only="cuda")
    if device not in _METERS:
        _METERS[device] = {"cpu": CpuMeter, "cuda": CudaMeter}[device]()
    return _METERS[device]
