"""The one registry of run-time patches to torch and megatron-core, and its one state.

Every attribute capture-megatron replaces in torch or megatron-core (cpu_compat, moe_cpu, moe_fake,
gloo_settle, megatron.attention, the fake-cuda GPU kernel set in gpu/*,
train.checkpoint.megatron_fixes, train.checkpoint.trust) is set through ``patch()``, which records
the original; every ``TorchFunctionMode`` entered for the life of a run is entered through
``enter()``; every torch kernel registered for the life of a run (``kernel()``: a dispatch key
torch's CPU build lacks) through the same state. ``revert()`` puts every original back in reverse
order, removes those kernels, exits those modes and forgets which patch groups were applied, so that
the next ``apply`` starts from unpatched torch and megatron-core. ``applied()`` lists what is
patched now (docs/ARCHITECTURE.md "Patch registry" lists them all;
tests/unit/test_patch_registry.py checks that every target still exists in the installed torch and
megatron-core -- where a megatron-core upgrade starts).

Not in the registry: patches scoped to one call that put the original back themselves (cpu_compat's
``Tensor.is_cuda`` while HybridDeviceOptimizer builds its sub-optimizers, host_adam.installed,
gpu.linear's global buffer), and megatron_lm.cpu, which patches the separate process that runs
Megatron-LM's own pretrain_gpt.py.

Versions (megatron-core 0.16.1 through 0.19.x, capture_megatron.config.versions): each patch names
the megatron-core series it is written for (`Patch.versions`: "0.16-0.19", or "0.16" for a name
that later megatron-core binds itself); ``patch()`` refuses one applied on an installed series
outside them, so a patch written for one version never lands unexamined on another, and the
registry test checks the targets of the installed series.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from typing import Any

from capture_megatron.config import versions as mcore

MEGATRON_CORE_VERSIONS = "0.16-0.19"
"""The megatron-core series a patch serves unless it says otherwise (first-last, inclusive)."""

_MISSING = object()


@dataclasses.dataclass(frozen=True)
class Patch:
    """One replaced attribute of torch or megatron-core."""

    target: str
    """The dotted path of the replaced attribute, e.g. 'torch.cuda.current_device'."""
    why: str
    """The megatron-core call sites it serves, in a few words."""
    adds: bool = False
    """True where megatron-core refers to the name but binds it only when an optional package
    (Transformer Engine, DeepEP, apex) imports: the patch supplies it."""
    versions: str = MEGATRON_CORE_VERSIONS
    """The megatron-core series the patch is written for: "0.16-0.19" (first-last) or "0.16"."""

    def __post_init__(self) -> None:
        if "." not in self.target or not self.why:
            raise ValueError(f"a patch needs a dotted target and a reason: {self!r}")
        series_range(self.versions)  # ValueError unless "0.N" or "0.N-0.M"

    def serves(self, series: mcore.Series) -> bool:
        """Whether the patch is written for megatron-core `series`."""
        first, last = series_range(self.versions)
        return first <= series <= last


def series_range(text: str) -> tuple[mcore.Series, mcore.Series]:
    """The first and last Series of a versions string ("0.16-0.19" or "0.16")."""
    ends = [mcore.parse(part) for part in text.split("-")]
    if len(ends) not in (1, 2) or any(len(e) != 3 or e[2] for e in ends):
        raise ValueError(f"patch versions {text!r}: give a series '0.N' or a range '0.N-0.M'")
    first, last = (mcore.Series(e[0], e[1]) for e in (ends[0], ends[-1]))
    if last < first:
        raise ValueError(f"patch versions {text!r}: the range ends before it starts")
    return first, last


@dataclasses.dataclass
class _Entry:
    patch: Patch
    owner: Any
    name: str
    original: Any


@dataclasses.dataclass
class _State:
    entries: dict[tuple[int, str], _Entry] = dataclasses.field(default_factory=dict)
    modes: list[Any] = dataclasses.field(default_factory=list)
    groups: set[str] = dataclasses.field(default_factory=set)
    device: str | None = None
    series: mcore.Series | None = None
    libraries: list[Any] = dataclasses.field(default_factory=list)


_STATE = _State()


def _target(owner: Any, name: str) -> str:
    if isinstance(owner, types.ModuleType):
        return f"{owner.__name__}.{name}"
    if owner is sys.modules:
        return f"sys.modules[{name!r}]"
    return f"{owner.__module__}.{owner.__qualname__}.{name}"


def _current(owner: Any, name: str) -> Any:
    if owner is sys.modules:
        return sys.modules.get(name, _MISSING)
    if isinstance(owner, type):  # the class's own entry (a staticmethod stays one), not inherited
        return owner.__dict__.get(name, _MISSING)
    return getattr(owner, name, _MISSING)


def patch(
    owner: Any,
    name: str,
    new: Any,
    why: str,
    adds: bool = False,
    versions: str = MEGATRON_CORE_VERSIONS,
) -> None:
    """Set ``owner.name = new`` (a module, a class, or ``sys.modules``), recording the original the
    first time; a missing target is an error unless `adds` (the name megatron-core binds only with
    an optional package), and so is a patch whose `versions` leave out the installed
    megatron-core."""
    key = (id(owner), name)
    if key not in _STATE.entries:
        original = _current(owner, name)
        inherited = isinstance(owner, type) and hasattr(owner, name)
        if original is _MISSING and not inherited and not adds:
            raise AttributeError(f"patch target {_target(owner, name)} does not exist")
        made = Patch(_target(owner, name), why, adds, versions)
        if not made.serves(_installed()):
            raise RuntimeError(
                f"patch {made.target} is written for megatron-core {versions}, not the installed "
                f"{mcore.megatron_core()}"
            )
        entry = _Entry(made, owner, name, original)
        _STATE.entries[key] = entry
    if owner is sys.modules:
        sys.modules[name] = new
    else:
        setattr(owner, name, new)


def _installed() -> mcore.Series:
    """The installed megatron-core's series (read once)."""
    if _STATE.series is None:
        _STATE.series = mcore.current()
    return _STATE.series


def kernel(op: str, key: str, fn: Any, why: str) -> None:
    """Register `fn` as the kernel of torch's aten operator `op` for dispatch key `key`
    (torch.library) until ``revert()``; listed as the patch of ``torch.ops.aten.<op>``."""
    import torch

    owner = torch.ops.aten
    if (id(owner), op) in _STATE.entries:
        return
    library = torch.library.Library("aten", "IMPL")
    library.impl(op, fn, key)
    _STATE.libraries.append(library)
    target = Patch(f"torch.ops.aten.{op}", why)
    _STATE.entries[(id(owner), op)] = _Entry(target, owner, op, getattr(owner, op))


def enter(mode: Any) -> None:
    """Enter a TorchFunctionMode until ``revert()`` (or ``exit_modes()``)."""
    mode.__enter__()
    _STATE.modes.append(mode)


def exit_modes() -> None:
    """Exit the modes entered through ``enter()``, last first."""
    while _STATE.modes:
        _STATE.modes.pop().__exit__(None, None, None)


def first(group: str) -> bool:
    """True the first time `group` (a module's set of patches) is asked for since the last
    ``revert()``; it counts as applied from then on."""
    if group in _STATE.groups:
        return False
    _STATE.groups.add(group)
    return True


def set_device(device: str | None) -> None:
    """Record the host device the patches redirect CUDA to ("cpu", "meta", "fake-cuda")."""
    _STATE.device = device


def device() -> str | None:
    """The device the patches were applied for, or None when none are."""
    return _STATE.device


def applied() -> list[Patch]:
    """The patches in force, in the order they were first made."""
    return [entry.patch for entry in _STATE.entries.values()]


def originals() -> dict[str, Any]:
    """The original object of each patched target (what ``revert()`` puts back)."""
    return {entry.patch.target: entry.original for entry in _STATE.entries.values()}


def revert() -> None:
    """Put every patched attribute back, last first, exit the registry's modes and forget the
    applied groups and device."""
    exit_modes()
    while _STATE.libraries:  # kernels registered through kernel()
        _STATE.libraries.pop()._destroy()
    for entry in reversed(list(_STATE.entries.values())):
        owner, name = entry.owner, entry.name
        if owner is sys.modules:
            if entry.original is _MISSING:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = entry.original
        elif entry.original is _MISSING:
            if name in getattr(owner, "__dict__", {}) or hasattr(owner, name):
                delattr(owner, name)
        else:
            setattr(owner, name, entry.original)
    _STATE.entries.clear()
    _STATE.groups.clear()
    _STATE.device = None
