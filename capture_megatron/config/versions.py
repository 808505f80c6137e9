"""The megatron-core versions capture-megatron runs on, and the one installed (pure Python).

capture-megatron supports megatron-core 0.16.1 through 0.19.x (`SUPPORTED`). What differs between
them sits in one place per concern, each keyed by a `Series` from this module:
- the patches to torch and megatron-core: capture_megatron.emulate.patches (each patch names the
  series it applies to; tests/unit/test_patch_registry.py checks the targets of the installed one);
- what the adapter builds and calls: capture_megatron.megatron.versioned;
- Megatron-LM's arguments: capture_megatron/flags/megatron_args*.json (one table per series,
  capture_megatron.flags.tables);
- the memory rules the forecast models (defaults and layouts that changed):
  capture_megatron.predict.versioned.

Installed versions are read from package metadata, without importing torch or megatron-core.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from capture_megatron.errors import CaptureError

OLDEST = (0, 16, 1)
"""The oldest megatron-core release supported."""
BELOW = (0, 20)
"""The first megatron-core release not supported (the install requirement's upper bound)."""
SUPPORTED = ">=0.16.1,<0.20"
"""The install requirement on megatron-core (pyproject.toml), as pip writes it."""
TESTED = ("0.16.1", "0.19.2")
"""The releases CI runs on: the default leg (Python 3.11) and the second (Python 3.12)."""


@dataclass(frozen=True, order=True)
class Series:
    """A megatron-core minor release series (0.16, 0.17, ...): what version-dependent code is
    keyed by."""

    major: int
    """The major version (0)."""
    minor: int
    """The minor version (16 through 19)."""

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}"

    @property
    def tag(self) -> str:
        """The Megatron-LM tag of the series' first release whose sources were read
        (core_v0.16.1, core_v0.19.0; 0.19.2's megatron/core equals core_v0.19.0's in every file
        that builds, trains or checkpoints a GPT)."""
        return "core_v0.16.1" if self == V0_16 else f"core_v{self.major}.{self.minor}.0"


V0_16 = Series(0, 16)
"""megatron-core 0.16 (0.16.1): the default leg's."""
V0_19 = Series(0, 19)
"""megatron-core 0.19 (0.19.2): the second CI leg's."""


def parse(text: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string such as '0.19.2', '0.17.0rc0' or
    '0.16.1+nv25.12' (pre-release and local parts dropped)."""
    found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text.strip())
    if not found:
        raise ValueError(f"not a version: {text!r}")
    return tuple(int(x or 0) for x in found.groups())


def series_of(text: str) -> Series:
    """The Series of a megatron-core version string; CaptureError outside `SUPPORTED`."""
    parts = parse(text)
    if parts < OLDEST or parts[:2] >= BELOW:
        raise CaptureError(
            f"megatron-core {text} is installed; capture-megatron supports megatron-core "
            f"{SUPPORTED} (0.16.1 through 0.19.x): install one of those, or a capture-megatron "
            "release made for your megatron-core"
        )
    return Series(parts[0], parts[1])


def installed(distribution: str) -> str | None:
    """The installed version of a distribution, or None."""
    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def megatron_core() -> str:
    """The installed megatron-core's version; CaptureError when it is missing."""
    found = installed("megatron-core") or installed("megatron_core")
    if found is None:
        raise CaptureError(
            "megatron-core is not installed: `pip install 'megatron-core>=0.16.1,<0.20'`, or "
            "install capture-megatron into the environment that holds it"
        )
    return found


def current() -> Series:
    """The installed megatron-core's Series (CaptureError when missing or unsupported)."""
    return series_of(megatron_core())


TE_ENV = "CAPTURE_MEGATRON_TE_VERSION"
"""Environment variable naming the Transformer Engine release (major.minor) the GPUs train with,
for a forecast made where it is not installed (fake CUDA): e.g. 2.12 for an NGC container that
ships it with megatron-core 0.16.1."""
TE_NEWEST_ADMITTED = {V0_16: (2, 11)}
"""The newest Transformer Engine a megatron-core series' own requirement admits, where it pins one:
megatron-core 0.16.1's `transformer-engine[core_cu13,pytorch]>=2.9.0a0,<2.12.0` (its dev extra)
installs 2.11; 0.17 on leave it unpinned (2.12 or later)."""
TE_FULL_SIZE_MOMENTS = ((2, 10), (2, 11))
"""Transformer Engine releases whose FusedAdam makes each Adam moment `torch.empty(param.shape)`
(TE PR #1762, reverted by #2535 in 2.12; transformer_engine/pytorch/optimizers/fused_adam.py
_initialize_state): under Megatron-FSDP, whose optimizer parameters are DTensors of the
parameter's global shape, the moments are whole tensors, gathered over TP and not sharded."""


def transformer_engine() -> tuple[int, int]:
    """(major, minor) of the Transformer Engine a GPU run trains with: CAPTURE_MEGATRON_TE_VERSION
    when set, else the one installed, else the newest the installed megatron-core admits."""
    given = os.environ.get(TE_ENV, "").strip()
    if given:
        try:
            return parse(given)[:2]  # type: ignore[return-value]
        except ValueError:
            raise CaptureError(
                f"{TE_ENV}={given!r} is not a Transformer Engine version: give major.minor, "
                "e.g. 2.12"
            ) from None
    return _default_te()


@functools.cache
def _default_te() -> tuple[int, int]:
    """The installed Transformer Engine's (major, minor), else TE_NEWEST_ADMITTED's."""
    for name in ("transformer-engine", "transformer_engine"):
        text = installed(name)
        if text:
            return parse(text)[:2]  # type: ignore[return-value]
    return TE_NEWEST_ADMITTED.get(current(), (2, 12))


def te_full_size_moments() -> bool:
    """Whether the GPU run's FusedAdam keeps Megatron-FSDP's Adam moments whole
    (TE_FULL_SIZE_MOMENTS)."""
    return transformer_engine() in TE_FULL_SIZE_MOMENTS
