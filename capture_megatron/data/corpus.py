"""A small real-text corpus from what is already on the machine: Python standard-library docstrings.

`stdlib_corpus(out_path, max_bytes)` writes JSON lines `{"text": ...}`, one document per module,
class, method or function docstring, walking `sys.stdlib_module_names` in sorted order (packages'
submodules one level down after their package); about 1.4 MB in all on CPython 3.11. Modules that
fail to import, print anything while importing, or have side effects (opening a browser, a window)
are skipped. For one Python installation the file is the same for the same `max_bytes`: documents
are appended whole until the next one would pass `max_bytes`."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import json
import os
import pkgutil
import sys
import warnings
from collections.abc import Iterator
from types import ModuleType

SKIP_MODULES = frozenset(
    {
        "antigravity",
        "this",
        "idlelib",
        "turtledemo",
        "turtle",
        "tkinter",
        "pydoc_data",
        "lib2to3",
        "ensurepip",
        "venv",
        "msilib",
        "winreg",
        "winsound",
        "msvcrt",
        "_winapi",
        "nturl2path",
        "readline",
        "curses",
        "webbrowser",
        "tty",
        "pty",
        "crypt",
        "nis",
        "spwd",
        "ossaudiodev",
        "xxsubtype",
        "xxlimited",
    }
)
"""Modules never imported: side effects on import, platform-specific, or not text-bearing."""

MIN_DOC_CHARS = 40
"""Docstrings shorter than this are left out (one-liners such as 'Return self==value.')."""


def _import_quietly(name: str) -> ModuleType | None:
    """The module `name`, or None when importing it fails or writes to stdout/stderr."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
        ):
            warnings.simplefilter("ignore")
            module = importlib.import_module(name)
    except BaseException:  # noqa: BLE001 - SystemExit and friends from odd modules are skipped too
        return None
    return None if out.getvalue() or err.getvalue() else module


def _own_doc(obj: object) -> str:
    """`obj`'s own docstring (not inherited), cleaned, or ''."""
    doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) else ""


def module_documents(module: ModuleType) -> list[str]:
    """Documents of one module: its docstring, then each public class, its methods, and function
    defined in it, by sorted name; each as 'qualified.name\\n\\ndocstring'."""
    name = module.__name__
    found = [(name, _own_doc(module))]
    try:
        members = sorted(vars(module).items())
    except TypeError:
        members = []
    for attr, obj in members:
        if attr.startswith("_") or getattr(obj, "__module__", None) != name:
            continue
        if inspect.isclass(obj):
            found.append((f"{name}.{attr}", _own_doc(obj)))
            for meth, fn in sorted(vars(obj).items()):
                if not meth.startswith("_") and callable(fn):
                    found.append((f"{name}.{attr}.{meth}", _own_doc(fn)))
        elif inspect.isfunction(obj) or inspect.isbuiltin(obj):
            found.append((f"{name}.{attr}", _own_doc(obj)))
    return [f"{qual}\n\n{doc}" for qual, doc in found if len(doc) >= MIN_DOC_CHARS]


def iter_stdlib_modules() -> Iterator[ModuleType]:
    """Importable public standard-library modules in a fixed order: each top-level module (sorted),
    followed by its package's public submodules one level down (sorted)."""
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in SKIP_MODULES:
            continue
        module = _import_quietly(name)
        if module is None:
            continue
        yield module
        path = getattr(module, "__path__", None)
        subs = sorted(info.name for info in pkgutil.iter_modules(path)) if path else []
        for sub in subs:
            if not sub.startswith("_") and sub not in ("test", "tests"):
                submodule = _import_quietly(f"{name}.{sub}")
                if submodule is not None:
                    yield submodule


def iter_stdlib_documents() -> Iterator[str]:
    """Every document of every importable public standard-library module, in a fixed order."""
    seen: set[str] = set()
    for module in iter_stdlib_modules():
        for doc in module_documents(module):
            if doc not in seen:
                seen.add(doc)
                yield doc


def stdlib_corpus(out_path: str, max_bytes: int = 1 << 20) -> int:
    """Write standard-library docstrings as JSONL `{"text": ...}` to `out_path`, at most `max_bytes`
    bytes (whole documents only). Returns the number of documents written."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes {max_bytes} must be positive")
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    written = size = 0
    with open(out_path, "w", encoding="utf-8") as f:
        for doc in iter_stdlib_documents():
            line = json.dumps({"text": doc}, ensure_ascii=False) + "\n"
            n = len(line.encode("utf-8"))
            if size + n > max_bytes:
                break
            f.write(line)
            size += n
            written += 1
    return written
