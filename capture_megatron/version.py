"""The package's version, in one place (pyproject reads it; records, caches and plan JSON carry it:
bump it when probes or the plan JSON change, so stale caches are profiled again and old plans
refused with a message)."""

__version__ = "0.6.0"
