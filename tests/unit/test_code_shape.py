"""The code stays easy to enter: small files and functions, and a docstring on every module, public
class, public function and field of a public dataclass (CONTRIBUTING.md)."""

from __future__ import annotations

import ast

import pytest
from imports import modules

MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60

SOURCES = {name: path.read_text() for name, path in modules().items()}


def _trees() -> dict[str, ast.Module]:
    return {name: ast.parse(text) for name, text in SOURCES.items()}


def test_files_are_small():
    big = {
        n: len(t.splitlines()) for n, t in SOURCES.items() if len(t.splitlines()) > MAX_FILE_LINES
    }
    assert not big, big


def test_functions_are_small():
    long = [
        f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for name, tree in _trees().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and (node.end_lineno or 0) - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, long


def test_every_module_has_a_docstring():
    assert [n for n, tree in _trees().items() if not ast.get_docstring(tree)] == []


def _is_dataclass(node: ast.ClassDef) -> bool:
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Name) and target.id == "dataclass":
            return True
    return False


def _undocumented_fields(node: ast.ClassDef) -> list[str]:
    body = node.body
    out = []
    for stmt, after in zip(body, [*body[1:], None]):
        documented = (
            isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        )
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and not documented:
            out.append(stmt.target.id)
    return out


@pytest.mark.parametrize("kind", ["class", "function", "field"])
def test_public_things_have_docstrings(kind):
    missing = []
    for name, tree in _trees().items():
        for node in tree.body:
            if getattr(node, "name", "_").startswith("_"):
                continue
            if kind == "class" and isinstance(node, ast.ClassDef) and not ast.get_docstring(node):
                missing.append(f"{name}.{node.name}")
            if (
                kind == "function"
                and isinstance(node, ast.FunctionDef)
                and not ast.get_docstring(node)
            ):
                missing.append(f"{name}.{node.name}")
            if kind == "field" and isinstance(node, ast.ClassDef) and _is_dataclass(node):
                missing += [f"{name}.{node.name}.{f}" for f in _undocumented_fields(node)]
    assert not missing, missing
