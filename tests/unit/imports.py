"""Every import statement of the package, read from the source (no module is imported): which
module imports which, at module level, inside a function, or only for type checking (under
`if TYPE_CHECKING:`). Used by test_layering."""

from __future__ import annotations

import ast
import pathlib
from dataclasses import dataclass

import capture_megatron

ROOT = pathlib.Path(capture_megatron.__file__).parent
PACKAGE = "capture_megatron"


@dataclass(frozen=True)
class Edge:
    """One import: `source` (a module of the package) imports `target` at `line`."""

    source: str
    target: str
    line: int
    type_only: bool = False
    """Under `if TYPE_CHECKING:`: never runs, but the type checker follows it."""


def module_name(path: pathlib.Path) -> str:
    """Dotted module name of a source file of the package."""
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, pathlib.Path]:
    """Every module of the package, by dotted name."""
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _type_checking_lines(tree: ast.AST) -> set[int]:
    """Lines inside `if TYPE_CHECKING:` blocks (imports there never run, mypy reads them)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _resolve(name: str, known: set[str]) -> str:
    """The package module `name` refers to: itself, or its closest known parent."""
    while name not in known and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def edges(type_only: bool = False) -> list[Edge]:
    """Every import in the package: package modules by their module, others by their top name.
    The imports under `if TYPE_CHECKING:` come too when `type_only` (marked `Edge.type_only`)."""
    known = set(modules())
    out = []
    for source, path in modules().items():
        tree = ast.parse(path.read_text())
        typing_only = _type_checking_lines(tree)
        for node in ast.walk(tree):
            only = getattr(node, "lineno", 0) in typing_only
            if only and not type_only:
                continue
            for target in _targets(node, source, path, known):
                out.append(Edge(source, target, node.lineno, only))
    return out


def _targets(node: ast.AST, source: str, path: pathlib.Path, known: set[str]) -> list[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative import
            package = source if path.name == "__init__.py" else source.rsplit(".", 1)[0]
            for _ in range(node.level - 1):
                package = package.rsplit(".", 1)[0]
            base = f"{package}.{base}" if base else package
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    else:
        return []
    return [_resolve(n, known) if n.startswith(PACKAGE) else n.split(".")[0] for n in names]


def unit(module: str) -> str:
    """The top-level unit a module belongs to: capture_megatron.planner.search -> plan."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"
