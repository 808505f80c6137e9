"""Dataclass fields that carry their Megatron flag: each option is declared once, as a field.

A field made with `flag(...)` names the command-line flag that sets it; its help text is the
field's docstring (the string literal under it). `capture_megatron.megatron.flags` builds argparse
groups from such fields, reads parsed values back into the dataclass, and writes a dataclass back
out as flags -- in the spirit of Megatron-LM's ArgumentGroupFactory. Pure Python.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any

FLAG = "capture_megatron.flag"
"""The metadata key under which a field keeps its Flag."""


@dataclass(frozen=True)
class Flag:
    """How one dataclass field is set on the command line."""

    name: str
    """The flag, in Megatron's spelling (e.g. --lr)."""
    negate: bool = False
    """A switch that sets the field to False (--no-progress, --disable-bias-linear)."""
    choices: tuple[str, ...] = ()
    """The accepted values (empty: any value of the field's type)."""
    note: str = ""
    """Help text added after the field's docstring."""
    sep: str = ""
    """For a tuple field: its values given as one word joined by this (Megatron-LM's tuple_type,
    e.g. --window-size 4096,0); empty: one word per value."""
    aliases: tuple[str, ...] = ()
    """Megatron-LM's other spellings of the flag (e.g. --override-opt-param-scheduler)."""


def flag(
    name: str,
    default: Any = dataclasses.MISSING,
    *,
    negate: bool = False,
    choices: tuple[str, ...] = (),
    note: str = "",
    sep: str = "",
    aliases: tuple[str, ...] = (),
) -> Any:
    """A dataclass field set by the flag `name` (no default: the field is required)."""
    meta = {FLAG: Flag(name, negate, tuple(choices), note, sep, tuple(aliases))}
    return dataclasses.field(default=default, metadata=meta)


def flag_of(field: dataclasses.Field) -> Flag | None:
    """The Flag of a field, or None for a field no flag sets."""
    return field.metadata.get(FLAG)


def flagged_fields(cls: type) -> list[tuple[dataclasses.Field, Flag]]:
    """The fields of dataclass `cls` that a flag sets, in declaration order."""
    out = []
    for field in dataclasses.fields(cls):
        spec = flag_of(field)
        if spec is not None:
            out.append((field, spec))
    return out


def to_flags(obj: Any) -> list[str]:
    """The flags that set every field of `obj` that differs from its default (Megatron's names)."""
    out: list[str] = []
    for field, spec in flagged_fields(type(obj)):
        value = getattr(obj, field.name)
        if value == field.default:
            continue
        if isinstance(value, bool):
            if value != spec.negate:
                out.append(spec.name)
        elif isinstance(value, tuple) and spec.sep:
            out += [spec.name, spec.sep.join(map(str, value))]
        elif isinstance(value, tuple):
            out += [spec.name, *map(str, value)]
        else:
            out += [spec.name, str(value)]
    return out


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal under its annotation), by field name; for every
    dataclass in `cls`'s method resolution order. Empty when the source is not available."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in zip(body, body[1:]):
            doc = _docstring(after)
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and doc:
                docs[node.target.id] = " ".join(doc.split())
    return docs


def _docstring(node: ast.stmt) -> str | None:
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
        value = node.value.value
        return value if isinstance(value, str) else None
    return None
