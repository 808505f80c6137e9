"""Dataclass fields that carry their Megatron flag: each option is declared once, as a field.

A field made with `flag(...)` names the command-line flag that sets it; its help text is the
field's docstring (the string literal under it). `capture_megatron.flags.parser` builds argparse
groups from such fields, reads parsed values back into the dataclass, and writes a dataclass back
out as flags -- in the spirit of Megatron-LM's ArgumentGroupFactory. Pure Python.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import textwrap
import types
import typing
from dataclasses import dataclass
from typing import Any

from capture_megatron.serial import OMIT_DEFAULT, ByIdentity, type_hints

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
    omit_default: bool = False,
) -> Any:
    """A dataclass field set by the flag `name` (no default: the field is required;
    `omit_default`: left out of JSON at its default, see OMIT_DEFAULT)."""
    meta: dict[str, Any] = {FLAG: Flag(name, negate, tuple(choices), note, sep, tuple(aliases))}
    if omit_default:
        meta[OMIT_DEFAULT] = True
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
        body = _class_body(klass)
        for node, after in zip(body, body[1:]):
            doc = _docstring(after)
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and doc:
                docs[node.target.id] = " ".join(doc.split())
    return docs


def _class_body(klass: type) -> list[ast.stmt]:
    """The statements of a class's definition; empty when its source is not available. A class
    defined at its module's top level is looked up in the module's parse, made once per module
    (inspect.getsource tokenizes the module again for every class: a tenth of a second in every
    process that builds a parser)."""
    try:
        path = inspect.getsourcefile(klass)
        if path and klass.__qualname__ == klass.__name__:
            node = _top_level_classes(path).get(klass.__name__)
            if node is not None:
                return node.body
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
    except (OSError, TypeError, SyntaxError):
        return []
    return tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []


@functools.cache
def _top_level_classes(path: str) -> dict[str, ast.ClassDef]:
    """The classes a module file defines at its top level, by name (the last definition of a
    name, the one the module keeps)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


def _docstring(node: ast.stmt) -> str | None:
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
        value = node.value.value
        return value if isinstance(value, str) else None
    return None


def _kind(hint: Any) -> Any:
    """int / float / tuple[int, ...] / a dataclass for a field's annotation (Optional removed),
    None for anything else."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if len(args) == 1 else None
    if hint in (int, float) or (isinstance(hint, type) and dataclasses.is_dataclass(hint)):
        return hint
    if typing.get_origin(hint) is tuple and typing.get_args(hint)[:1] == (int,):
        return tuple
    return None


def _number_problem(name: str, value: Any, kind: Any, at_least: float | None) -> str | None:
    """Why one numeric value is not acceptable (None: it is)."""
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        return f"{name} {value!r} must be an integer"
    if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        return f"{name} {value!r} must be a number"
    if kind is float and not math.isfinite(value):
        return f"{name} {value} must be a finite number"
    if at_least is not None and value < at_least:
        return f"{name} {value:g} must be at least {at_least:g}"
    return None


AT_LEAST_ONE = frozenset(
    {
        *("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length"),
        *("--vocab-size", "--make-vocab-size-divisible-by", "--rotary-base"),
        *("--tensor-model-parallel-size", "--pipeline-model-parallel-size"),
        *("--context-parallel-size", "--expert-model-parallel-size"),
        *("--expert-tensor-parallel-size", "--num-layers-per-virtual-pipeline-stage"),
        *("--num-virtual-stages-per-pipeline-rank", "--micro-batch-size", "--global-batch-size"),
        *("--microbatch-group-size-per-virtual-pipeline-stage", "--top", "--train-iters"),
        *("--log-interval", "--nodes", "--moe-router-topk", "--nvlink-domain"),
    }
)
"""Flags whose 0 is meaningless (Megatron-LM asserts, divides by them, or would run nothing):
at least 1 when given."""
ABOVE_ZERO = frozenset(
    {
        *("--norm-epsilon", "--rope-scaling-factor", "--adam-eps", "--init-method-std"),
        *("--peak-tflops", "--hbm-gbps", "--nvlink-gbps"),
        *("--network-gbps", "--host-gbps"),
    }
)
"""Float flags that must be above 0."""
BELOW_ONE = frozenset({"--reserve-fraction", "--hidden-dropout", "--attention-dropout"})
"""Fractions of a whole: below 1."""
SELF_CHECKED = frozenset({"--gemm-efficiency"})
"""Flags whose range their class checks with its own words (finite-ness is checked here)."""


@functools.cache
def _checked_fields(cls: Any) -> tuple[tuple[dataclasses.Field, Flag | None, Any], ...]:
    """(field, its flag, its kind) of every field of dataclass `cls` whose kind value_problems
    checks, read once per class (the search builds and validates many plans)."""
    hints = type_hints(cls)
    fields = ((f, flag_of(f), _kind(hints[f.name])) for f in dataclasses.fields(cls))
    return tuple(row for row in fields if row[2] is not None)


_NESTED: ByIdentity[tuple[str, ...]] = ByIdentity()
"""value_problems of nested frozen dataclasses by identity (a search's plans share one DdpOptions
object through every dataclasses.replace; equal values of another type, 2.0 for 2, are other
objects, so they are checked on their own)."""


def _nested_problems(value: Any, every_field: bool) -> tuple[str, ...]:
    """value_problems of a nested dataclass, once per frozen object."""

    def work() -> tuple[str, ...]:
        return tuple(value_problems(value, every_field=every_field))

    frozen = type(value).__dataclass_params__.frozen
    return _NESTED.get(value, every_field, work) if frozen else work()


def value_problems(
    obj: Any, positive: tuple[str, ...] = (), every_field: bool = False
) -> list[str]:
    """What is wrong with the numbers of dataclass `obj`, by its annotations: an int field holds
    an int (not 2.0, not a bool), a float field a finite number, and no value is negative (no
    Megatron size, count, rate or margin is); fields in `positive` are at least 1 (ints) or
    above 0 (floats). Flag fields are named by their flag; `every_field` checks the fields no
    flag sets too (objects read from JSON). None (not given) is accepted; nested dataclasses are
    checked too. Type problems stop the rest of a class's checks (its arithmetic would fail)."""
    problems: list[str] = []
    cls: Any = type(obj)
    for field, spec, kind in _checked_fields(cls):
        value = getattr(obj, field.name)
        if value is None:
            continue
        if dataclasses.is_dataclass(kind):
            problems += _nested_problems(value, every_field)
            continue
        if spec is None and not every_field:
            continue
        name = spec.name if spec else field.name
        if kind is tuple:
            bad = [v for v in value if isinstance(v, bool) or not isinstance(v, int)]
            problems += [f"{name} {list(value)} must be integers"] if bad else []
            continue
        strict = field.name in positive or name in AT_LEAST_ONE or name in ABOVE_ZERO
        floor = None if strict or name in SELF_CHECKED else 0
        problem = _number_problem(name, value, kind, floor)
        if problem is None and strict and (value < 1 if kind is int else value <= 0):
            problem = f"{name} {value:g} must be {'at least 1' if kind is int else 'positive'}"
        if problem is None and name in BELOW_ONE and value >= 1:
            problem = f"{name} {value:g} must be below 1"
        problems += [problem] if problem else []
    return problems
