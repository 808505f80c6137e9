"""The package's layering, read from its import statements (CONTRIBUTING.md, docs/ARCHITECTURE.md):
stages import only the stages below them, nothing outside cli/ imports cli/, the pure packages never
import torch or Megatron (not even inside a function), and no module import cycle exists."""

from __future__ import annotations

import subprocess
import sys
from collections import defaultdict

import pytest
from imports import Edge, edges, modules, unit

ALLOWED = {
    "__init__": {"api", "version"},
    "version": set(),
    "errors": set(),
    "serial": {"errors"},
    "fields": {"serial"},
    "features": {"errors", "fields", "serial"},
    "config": {"errors", "features", "fields", "serial"},
    "records": {"version", "config", "errors", "serial"},
    "cache": {"version", "config", "errors"},
    "fit": {"config", "records", "errors", "serial"},
    "rules": {"config", "records", "fit", "errors", "serial"},
    "forecast": {"config", "records", "fit", "errors", "serial"},
    "steptime": {"config", "forecast", "errors", "serial"},
    "planner": {
        *("version", "config", "records", "fit", "rules", "forecast", "steptime", "errors"),
        *("flags", "serial"),
    },
    "memory": set(),
    "data": {"config", "errors"},
    "flags": {"config", "errors", "rules"},
    "emulate": {"cache", "config", "errors"},
    "megatron": {"config", "emulate", "errors", "rules", "serial"},
    "megatron_lm": {"emulate", "errors", "megatron"},
    "profile": {
        *("version", "cache", "config", "emulate", "errors", "fit", "megatron", "memory"),
        *("forecast", "records", "rules", "serial"),
    },
    "train": {
        *("config", "data", "emulate", "errors", "flags", "megatron", "memory", "rules"),
        "serial",
    },
    "pretrain_gpt": {"train"},
    "api": {
        *("version", "cache", "config", "data", "errors", "fit", "flags", "forecast", "planner"),
        *("steptime", "profile", "records", "rules", "serial"),
    },
    "__main__": {"cli"},  # `python -m capture_megatron`: the console script
    "cli": {
        *("version", "api", "cache", "config", "data", "errors", "fit", "flags", "megatron"),
        *("megatron_lm", "memory", "planner", "forecast", "steptime", "profile", "records"),
        *("rules", "serial", "train"),
    },
}
"""Which top-level units each unit may import (capture_megatron.<unit>)."""
for _allowed in ALLOWED.values():  # features and fields sit below config: whoever may import it
    if "config" in _allowed:
        _allowed |= {"features", "fields"}
PURE = (
    "__init__",
    "version",
    "fields",
    "features",
    "errors",
    "serial",
    "config",
    "records",
    "cache",
    "fit",
    "forecast",
    "steptime",
    "rules",
    "planner",
    "api",
    "flags",
)
"""Units that never import torch, Megatron or anything that does: the planner runs without them."""
HEAVY = ("torch", "megatron", "transformer_engine", "apex")
"""Third-party packages the pure units must not import."""


def _internal(type_only: bool = False) -> list[Edge]:
    return [e for e in edges(type_only) if e.target.startswith("capture_megatron")]


def test_every_unit_is_in_the_table():
    assert {unit(m) for m in modules()} == set(ALLOWED)


def test_units_import_only_what_the_layering_allows():
    bad = [
        f"{e.source}:{e.line} imports {e.target}"
        for e in _internal()
        if unit(e.target) != unit(e.source) and unit(e.target) not in ALLOWED[unit(e.source)]
    ]
    assert not bad, "layering broken:\n" + "\n".join(bad)


def test_nothing_outside_cli_imports_cli():
    bad = [
        e
        for e in _internal()
        if unit(e.target) == "cli" and unit(e.source) not in ("cli", "__main__")
    ]
    assert not bad, bad


def test_pure_units_never_import_torch_or_megatron():
    bad = [
        f"{e.source}:{e.line} imports {e.target}"
        for e in edges()
        if unit(e.source) in PURE and e.target in HEAVY
    ]
    assert not bad, "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(part) > 1:
                found.append(sorted(part))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def _graph(level: str, found: list[Edge]) -> dict[str, set[str]]:
    """Who imports whom, module by module or unit by unit."""
    graph: dict[str, set[str]] = defaultdict(set)
    name = (lambda m: m) if level == "module" else unit
    for e in found:
        if name(e.source) != name(e.target):
            graph[name(e.source)].add(name(e.target))
    for node in list(graph):
        graph.setdefault(node, set())
    return graph


@pytest.mark.parametrize("level", ["module", "unit"])
def test_no_import_cycles(level):
    """Type-only imports (under `if TYPE_CHECKING:`) count too: mypy follows them, and a cycle
    through one is a cycle of the design that a deferred import only hides."""
    assert _cycles(_graph(level, _internal(type_only=True))) == []


def test_type_only_imports_are_read():
    """The cycle test sees the imports under `if TYPE_CHECKING:` (data.preprocess has some)."""
    found = [e for e in _internal(type_only=True) if e.type_only]
    assert ("capture_megatron.data.preprocess", "capture_megatron.data.tokenizer_base") in {
        (e.source, e.target) for e in found
    }
    assert not any(e.type_only for e in _internal())


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(defaultdict(set, graph)) == [["a", "b", "c"]]


def test_planning_imports_no_torch():
    code = (
        "import sys; import capture_megatron.planner, capture_megatron.forecast, "
        "capture_megatron.fit, capture_megatron.steptime, capture_megatron.api, "
        "capture_megatron.config, capture_megatron.profile, capture_megatron.train, "
        "capture_megatron.flags.parser, capture_megatron.flags.args; "
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')); "
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
