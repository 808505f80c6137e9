"""The package's version, in one place (pyproject reads it; records, caches and plan JSON carry it:
bump it when probes or the plan JSON change, so stale caches are profiled again and old plans
refused with a message)."""

__version__ = "0.6.0"
PROBE_REVISION = 2
"""Revision of what a probe measures within one package version: raised when the emulation
changes the bytes a probe records (2: fake CUDA counts tensor bytes, torch's fused RMSNorm and
CUDA embedding backward; issue 52), so that records cached by an earlier build of the same version
are profiled again (cache.records_path, profile.design_cache's cache folder).
The shipped design records are written by this revision."""
