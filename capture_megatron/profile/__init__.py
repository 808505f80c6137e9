"""Profile: build real Megatron-Core pieces (embedding, transformer layers from a ModuleSpec, final
norm + output layer + loss) for a few probe shapes, run them through megatron's own forward,
backward and optimizer step, and measure -> ProfileRecords (capture_megatron.records).

    from capture_megatron.profile import ProfileOptions, profile, memory_source
    records = profile(shape, ProfileOptions(device="fake", tps=(1, 2)))
    source = memory_source(shape, "fake")       # for planner.plan: profiles on demand

Importing this package does not import torch; profiling does. design chooses the probes, probe
builds and measures one, session runs many on a device (cpu, fake, cuda), groups fakes the process
groups, source profiles on demand with a cache.
"""

from capture_megatron.profile.options import DEVICES, ProfileOptions
from capture_megatron.profile.session import profile, run_probes
from capture_megatron.profile.source import default_device, memory_source

__all__ = ["DEVICES", "ProfileOptions", "default_device", "memory_source", "profile", "run_probes"]
