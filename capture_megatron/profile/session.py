"""Run many probes in one process: device set-up, meters, progress bar.

Devices:
- cpu:  real tensors on the host; exact live-storage accounting (capture_megatron.memory).
- fake: FakeTensorMode on the host: no data, no compute, so a 70B-class layer profiles on a laptop.
        Fake tensors follow the kernels of the device they fake — here the CPU's (dropout keeps a
        mask in the activation dtype, softmax keeps fp32 copies): fake numbers equal cpu numbers
        exactly, not a GPU's. The optimizer step reads gradient norms and cannot run on fake
        tensors, so its transient is not measured (optimizer state is computed from the parameters
        instead).
- cuda: the caching allocator's statistics (max_memory_allocated, reset between probes).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

from capture_megatron import __version__
from capture_megatron.config import ModelShape
from capture_megatron.errors import CaptureError
from capture_megatron.profile.design import model_probes
from capture_megatron.profile.options import DEVICES, ProfileOptions
from capture_megatron.records import Probe, ProfileRecord, Variant

DEPRECATED_COLLECTIVES = (
    r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated"
)
"""torch's warning on the collective names megatron-core 0.16.1 still calls."""


@dataclass(frozen=True)
class Setup:
    """What a profiling session measures with."""

    device: str
    """cpu, cuda or fake."""
    impl: str
    """local or transformer_engine (resolved)."""
    versions: tuple[str, str, str]
    """(capture-megatron, torch, megatron-core)."""


def versions() -> tuple[str, str, str]:
    """Versions that go into every record."""
    import megatron.core
    import torch

    return (__version__, torch.__version__, megatron.core.__version__)


def check_device(device: str) -> None:
    """CaptureError for an unknown or unusable device."""
    import torch

    if device not in DEVICES:
        raise CaptureError(f"--device {device!r} is not one of {', '.join(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise CaptureError(
            "--device cuda: this machine has no usable CUDA device; use --device cpu or fake"
        )


@contextlib.contextmanager
def measuring(device: str, impl: str = "auto"):
    """Yield (Setup, meter) with the device's patches, modes and meter active."""
    import torch

    from capture_megatron.megatron import cpu_compat
    from capture_megatron.megatron.builder import resolve_impl
    from capture_megatron.memory.meter import make_meter

    check_device(device)
    if device != "cuda":
        cpu_compat.apply("cpu")
    resolved = resolve_impl(impl) if device == "cuda" else "local"
    setup = Setup(device, resolved, versions())
    if device != "fake":
        yield setup, make_meter(device)
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        meter = make_meter("fake")
        try:
            yield setup, meter
        finally:
            getattr(meter, "stop", lambda: None)()
    del torch


def run_probes(
    probes: list[Probe],
    device: str,
    impl: str = "auto",
    progress: bool = True,
    timelines: bool = False,
) -> list[ProfileRecord]:
    """Measure every probe (tqdm progress bar) and return the records; with `timelines` (cpu, fake)
    each record carries its windows' allocation timelines, from which fit() builds exact
    transient-peak models."""
    from tqdm import tqdm

    from capture_megatron.profile.groups import fake_job
    from capture_megatron.profile.probe import measure

    records = []
    with measuring(device, impl) as (setup, meter), warnings.catch_warnings():
        # megatron-core 0.16.1 calls torch's deprecated collective names; nothing a user can act on
        warnings.filterwarnings("ignore", DEPRECATED_COLLECTIVES, FutureWarning)
        for probe in tqdm(
            probes,
            desc=f"profiling ({device})",
            unit="probe",
            disable=not progress,
            dynamic_ncols=True,
        ):
            with fake_job(probe.shape.tp, probe.dp):
                try:
                    records.append(
                        measure(probe, meter, setup.device, setup.impl, setup.versions, timelines)
                    )
                except (
                    AssertionError,
                    ValueError,
                ) as err:  # megatron's own validation of the shape
                    raise CaptureError(
                        f"megatron-core rejects the probe {probe.kind} chunk with {probe.layers} "
                        f"layers at {probe.shape}: {err}"
                    ) from None
    return records


def profile(
    shape: ModelShape, options: ProfileOptions = ProfileOptions()
) -> tuple[ProfileRecord, ...]:
    """Profile `shape`: its own sizes at the options' TP and micro-batch sizes (exact anchors later)
    and, unless options.design is off, the design shapes every regression term needs, for each
    variant; CaptureError when no probe fits."""
    check_device(options.device)
    variants = list(options.variants) or [Variant.of(shape)]
    tps, mbs = list(options.tps), list(options.micro_batch_sizes)
    probes = model_probes(shape, variants, tps, mbs, design=options.design)
    if not probes:
        raise CaptureError(
            f"no probe fits: TP sizes {tps} do not divide heads {shape.num_attention_heads} / "
            f"groups {shape.groups} / ffn {shape.ffn} (or SP needs TP > 1)"
        )
    timelines = options.timelines and options.device != "cuda"
    return tuple(
        run_probes(probes, options.device, options.transformer_impl, options.progress, timelines)
    )
