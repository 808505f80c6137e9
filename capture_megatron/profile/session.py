"""Run many probes in one process: device set-up, meters, progress bar.

Devices:
- cpu:       real tensors on the host; exact live-storage accounting (capture_megatron.memory).
- fake-cpu:  FakeTensorMode on the host: no data, no compute, so a 70B-class layer profiles on a
             laptop. Fake tensors follow the kernels of the device they fake — the CPU's (dropout
             keeps a mask in the activation dtype, softmax keeps fp32 copies): its numbers equal
             cpu numbers exactly, not a GPU's.
- fake-cuda: FakeTensorMode on fake CUDA tensors (capture_megatron.emulate.fake_cuda), in a worker
             process: CUDA's dispatch (1-byte dropout masks, fp32 norm statistics) and the GPU
             kernel set (capture_megatron.emulate.gpu: flash / cuDNN-fused / unfused attention,
             the fused softmax, fused RoPE, Megatron's fused bias-activation and bias-dropout).
- cuda:      the caching allocator's statistics (max_memory_allocated, reset between probes).
On the fake devices the optimizer step reads gradient norms and cannot run, so its transient is
not measured (optimizer state is computed from the parameters instead).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from capture_megatron.config import Kernels, ModelShape
from capture_megatron.config import versions as mcore_versions
from capture_megatron.config.kernels import kernel_set
from capture_megatron.errors import CaptureError
from capture_megatron.megatron import quiet
from capture_megatron.profile.design import built_as, model_probes
from capture_megatron.profile.options import ProfileOptions, device_name
from capture_megatron.profile.setup import Setup
from capture_megatron.records import Probe, ProfileRecord, Variant
from capture_megatron.version import __version__

if TYPE_CHECKING:
    from capture_megatron.memory.meter import MemoryMeter

PROBE_IRRELEVANT = (
    r".*recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
    r"If you are using transformer_engine as the transformer implementation, the core_attn",
    r"The legacy GroupedMLP will be deprecated",
)
"""megatron-core's warnings about the profiling process itself, beyond those silenced everywhere
(capture_megatron.megatron.quiet): its CUDA_DEVICE_MAX_CONNECTIONS, and the advice against
recomputing core attention with TE's fused attention, given for every probe that models
Megatron-LM's own selective recompute (whose default module is core_attn); and the deprecation
of the local spec's GroupedMLP, which the GPU kernel set builds only to replace it with
TEGroupedMLP (capture_megatron.megatron.gpu_spec.moe_spec). They say nothing about the run being
predicted."""


def versions() -> tuple[str, str, str]:
    """Versions that go into every record."""
    import torch

    # package metadata: megatron-core 0.17+'s __version__ appends the commit of whatever git
    # checkout its files lie in (a virtual environment inside a clone: that clone's HEAD)
    return (__version__, torch.__version__, mcore_versions.megatron_core())


def check_device(device: str) -> str:
    """The device's canonical name; CaptureError for an unknown or unusable device."""
    name = device_name(device)
    if name == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise CaptureError(
                "--device cuda: this machine has no usable CUDA device; use --device fake-cuda "
                "(the GPU kernels on fake CUDA tensors) or cpu"
            )
    return name


def _setup(device: str, kernels: Kernels) -> Setup:
    from capture_megatron.megatron.builder import resolve_impl
    from capture_megatron.megatron.extensions import gpu_kernels

    if device in ("cpu", "fake-cpu"):
        return Setup(device, None, kernel_set(device, kernels), versions())
    gpu = kernels.for_gpu()
    if device == "cuda":
        gpu = gpu_kernels(gpu, resolve_impl(kernels.transformer_impl))
    return Setup(device, gpu, kernel_set(device, gpu), versions())


@contextlib.contextmanager
def measuring(device: str, kernels: Kernels = Kernels()) -> Iterator[tuple[Setup, MemoryMeter]]:
    """Yield (Setup, meter) with the device's patches, modes and meter active."""
    from capture_megatron.emulate import cpu_compat
    from capture_megatron.memory.meter import make_meter

    device = check_device(device)
    if device == "fake-cuda":
        from capture_megatron.emulate import fake_cuda

        if not fake_cuda.loaded():
            raise CaptureError("fake-cuda probes run in the worker process (profile.worker)")
        cpu_compat.apply_fake_cuda()
    else:  # on cuda only what megatron-core needs without Transformer Engine
        cpu_compat.apply("cpu")
    setup = _setup(device, kernels)
    if not setup.fake:
        yield setup, make_meter(device)
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        meter = make_meter(device)
        try:
            yield setup, meter
        finally:
            getattr(meter, "stop", lambda: None)()


def run_probes(
    probes: list[Probe],
    device: str,
    kernels: Kernels = Kernels(),
    progress: bool = True,
    timelines: bool = False,
    tick: Callable[[], object] | None = None,
) -> list[ProfileRecord]:
    """Measure every probe (tqdm progress bar; `tick` called after each) and return the records;
    with `timelines` (not on cuda) each record carries its windows' allocation timelines, from
    which fit() builds exact transient-peak models. fake-cuda probes run in worker processes
    (profile.remote). CaptureError, before any probe runs, for what the device cannot model."""
    from capture_megatron.rules.modelled import refuse_on_fake_device

    device = device_name(device)
    for probe in probes:
        refuse_on_fake_device(probe.variant, device, kernels)
    builds = [built_as(p) for p in probes]
    unique = list(dict.fromkeys(builds))
    if len(unique) < len(probes):  # each chunk measured once (built_as), its record shared
        measured = run_probes(unique, device, kernels, progress, timelines, tick)
        by_build = dict(zip(unique, measured, strict=True))
        return [dataclasses.replace(by_build[b], variant=p.variant) for p, b in zip(probes, builds)]
    if device == "fake-cuda":
        from capture_megatron.emulate import fake_cuda

        if not fake_cuda.loaded():
            from capture_megatron.profile.remote import run_in_worker

            return run_in_worker(probes, kernels, progress, timelines)
    records: list[ProfileRecord] = []
    with warnings.catch_warnings():
        quiet.install()  # again inside catch_warnings, which restores the filters on exit
        for message in PROBE_IRRELEVANT:
            warnings.filterwarnings("ignore", message, UserWarning)
        quiet.initialize_rerun_state_machine()  # the probes' schedules would, with a warning
        with measuring(device, kernels) as (setup, meter):
            for record in _run(probes, meter, setup, progress, timelines):
                records.append(record)
                if tick is not None:
                    tick()
    return records


def _run(
    probes: list[Probe], meter: MemoryMeter, setup: Setup, progress: bool, timelines: bool
) -> Iterator[ProfileRecord]:
    import gc

    from tqdm import tqdm

    import capture_megatron.profile.probe  # noqa: F401  (megatron-core's modules, imported once)

    # Each probe ends with a full collection (its chunk's reference cycles): move everything alive
    # before it (the imported modules; what earlier probes left, ~500 objects each: torch's and
    # megatron-core's caches) out of the collector's sight so that it scans only the probe's
    # objects (0.2 s -> ~0.01 s a probe).
    gc.collect()
    for probe in tqdm(
        probes,
        desc=f"profiling ({setup.device})",
        unit="probe",
        disable=not progress,
        dynamic_ncols=True,
    ):
        gc.freeze()
        yield _measure(probe, meter, setup, timelines)


def _measure(probe: Probe, meter: MemoryMeter, setup: Setup, timelines: bool) -> ProfileRecord:
    from capture_megatron.profile.experts import probe_world
    from capture_megatron.profile.groups import fake_job
    from capture_megatron.profile.probe import measure

    with fake_job(probe.shape.tp, *probe_world(probe)):
        try:
            return measure(probe, meter, setup, timelines)
        except (AssertionError, ValueError) as err:  # megatron's own validation of the shape
            raise CaptureError(
                f"megatron-core rejects the probe {probe.kind} chunk with {probe.layers} "
                f"layers at {probe.shape}: {err}"
            ) from None


def profile(
    shape: ModelShape, options: ProfileOptions = ProfileOptions()
) -> tuple[ProfileRecord, ...]:
    """Profile `shape`: its own sizes at the options' TP and micro-batch sizes (exact anchors later)
    and, unless options.design is off, the design shapes every regression term needs, for each
    variant (those come from the design cache when a model of the same variant was profiled before,
    or shipped: capture_megatron.profile.design_cache); CaptureError when no probe fits."""
    from capture_megatron.profile.design import design_shapes, probes_for, variant_tps
    from capture_megatron.profile.design_cache import design_key, load_design, store_design

    device = device_name(options.device)
    variants = list(options.variants) or [Variant.of(shape)]
    tps, mbs = list(options.tps), list(options.micro_batch_sizes)
    probes = model_probes(shape, variants, tps, mbs, design=False)
    if not probes:
        raise CaptureError(
            f"no probe fits: TP sizes {tps} do not divide heads {shape.num_attention_heads} / "
            f"groups {shape.groups} / ffn {shape.ffn} (or SP needs TP > 1)"
        )
    timelines = options.timelines and device != "cuda"
    anchors = len(probes)
    found: list[ProfileRecord] = []
    missing: list[tuple[str, int, int]] = []  # (design key, first probe, probes)
    for variant in [v for v in variants if v.designed] if options.design else []:
        design_tps = variant_tps(variant, max(tps))
        name = design_key(
            device, _setup(device, options.kernels).kernel_set, variant, design_tps, timelines
        )
        have = load_design(name)
        if have is not None:
            found += have
            continue
        more = probes_for(variant, design_shapes(design_tps))
        missing.append((name, len(probes), len(more)))
        probes += more
    records = run_probes(probes, device, options.kernels, options.progress, timelines)
    for name, first, count in missing:
        store_design(name, records[first : first + count])
    return tuple(records[:anchors]) + tuple(found) + tuple(records[anchors:])
