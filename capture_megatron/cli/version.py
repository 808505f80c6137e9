"""`capture-megatron --version`: this package and what it runs on (package metadata only)."""

from __future__ import annotations

import importlib.util

from capture_megatron.config.versions import SUPPORTED, installed
from capture_megatron.version import __version__


def _first(*distributions: str) -> str | None:
    return next((v for v in map(installed, distributions) if v is not None), None)


def _module_only(module: str) -> str | None:
    """'installed (version unknown)' when `module` is importable without package metadata (a
    source build without metadata), else None; nothing is imported."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    return "installed (version unknown)" if spec is not None else None


def stack() -> list[tuple[str, str]]:
    """(name, version or 'not installed') of this package and of what it runs on: megatron-core,
    torch, Transformer Engine and apex, read from package metadata (nothing is imported)."""
    te = _first("transformer-engine", "transformer_engine", "transformer-engine-torch")
    rows = [
        ("megatron-core", _first("megatron-core", "megatron_core")),
        ("torch", installed("torch")),
        ("transformer-engine", te or _module_only("transformer_engine")),
        ("apex", _first("apex") or _module_only("apex")),
    ]
    return [("capture-megatron", __version__)] + [(n, v or "not installed") for n, v in rows]


def text() -> str:
    """What `--version` prints: one line per package, then the megatron-core range supported."""
    lines = [f"{name:19s} {found}" for name, found in stack()]
    return "\n".join([*lines, f"(supports megatron-core {SUPPORTED})"])
