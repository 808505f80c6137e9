"""Exact JSON round-trip for the frozen dataclasses that pass between stages."""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from capture_megatron.errors import CaptureError

T = TypeVar("T")
V = TypeVar("V")
OMIT_DEFAULT = "capture_megatron.omit_default"
"""Metadata key of a field that to_plain leaves out at its default (capture_megatron.config
.fields.flag(omit_default=True)), so that adding the field kept the JSON, hence the record keys,
of everything made before it."""


class CachedHash:
    """A frozen dataclass hashed many times (the planner's candidates, as dictionary keys): its
    hash computed once. The class sets `__hash__ = CachedHash.cached_hash` in its own body (a
    dataclass keeps only a __hash__ of its body); the hash is left out of its pickled state (a
    string's hash differs between processes)."""

    def cached_hash(self) -> int:
        """The hash of the compared fields' values, as the dataclass's own, once."""
        found: int | None = self.__dict__.get("_cached_hash")
        if found is None:
            fields = dataclasses.fields(self)  # type: ignore[arg-type]
            found = hash(tuple(getattr(self, f.name) for f in fields if f.compare))
            object.__setattr__(self, "_cached_hash", found)
        return found

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_cached_hash", None)
        return state


class ByIdentity(Generic[V]):
    """Values worked out from objects, kept by the objects' identity: for objects passed around
    unchanged and costly to hash or compare (a schedule's long tuple, a plan's nested settings,
    which an equal value of another type, 2.0 for 2, must not share). An entry keeps its object
    alive, so its id is not reused; `size` entries at most (then all are dropped)."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        """Entries kept at most."""
        self.kept: dict[tuple[int, Any], tuple[Any, V]] = {}
        """(id, extra key): (the object, its value)."""

    def get(self, obj: Any, extra: Any, work: Callable[[], V]) -> V:
        """The value of (obj, extra): kept, or work() and kept."""
        key = (id(obj), extra)
        found = self.kept.get(key)
        if found is not None and found[0] is obj:
            return found[1]
        if len(self.kept) >= self.size:
            self.kept.clear()
        value = work()
        self.kept[key] = (obj, value)
        return value


def to_plain(obj: Any) -> Any:
    """Turn a (nested) dataclass into JSON-ready lists, dicts and scalars (field order kept; a
    field marked omit_default is left out at its default, which from_plain restores)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {
            f.name: to_plain(getattr(obj, f.name))
            for f in dataclasses.fields(obj)
            if not (f.metadata.get(OMIT_DEFAULT) and getattr(obj, f.name) == f.default)
        }
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_plain(v) for k, v in obj.items()}
    return obj


def _build(tp: Any, value: Any) -> Any:
    """Rebuild `value` as type `tp` (dataclass, tuple[...], Optional, dict, scalar)."""
    origin = typing.get_origin(tp)
    if value is None:
        return None
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _build(args[0], value) if len(args) == 1 else value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return from_plain(tp, value)
    if origin is tuple:
        parts = typing.get_args(tp)
        if len(parts) == 2 and parts[1] is Ellipsis:
            return tuple(_build(parts[0], v) for v in value)
        return tuple(_build(a, v) for a, v in zip(parts, value))
    if origin is dict:
        kt, vt = typing.get_args(tp)
        return {_build(kt, k): _build(vt, v) for k, v in value.items()}
    if tp is float and isinstance(value, int):
        return float(value)
    return value


_HINTS: dict[type, dict[str, Any]] = {}
"""type_hints' answers, per class."""


def type_hints(cls: type) -> dict[str, Any]:
    """typing.get_type_hints of a class, evaluated once per class (the annotations are strings
    under `from __future__ import annotations`; the planner builds and checks plans by the
    hundred thousand). Read it, do not change it."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def from_plain(cls: type[T], data: dict[str, Any]) -> T:
    """Rebuild dataclass `cls` from `to_plain` output; unknown keys are an error."""
    hints = type_hints(cls)
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]  # T is a dataclass type
    names = {f.name for f in fields if f.init}
    unknown = set(data) - names - {f.name for f in fields}
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
    kwargs = {k: _build(hints[k], v) for k, v in data.items() if k in names}
    return cls(**kwargs)


class JsonMixin:
    """Adds to_json()/from_json() that round-trip a frozen dataclass exactly."""

    def to_json(self) -> str:
        """This object as a JSON string."""
        return json.dumps(to_plain(self), sort_keys=False)

    @classmethod
    def from_json(cls: type[T], text: str) -> T:
        """Rebuild an object written by to_json()."""
        return from_plain(cls, json.loads(text))


def load_json(path: str, what: str) -> Any:
    """The JSON in file `path`; a CaptureError starting with `what` (e.g. '--hf-config x.json')
    when it cannot be read or parsed."""
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as err:
        raise CaptureError(f"{what}: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise CaptureError(f"{what} is not valid JSON (line {err.lineno}: {err.msg})") from None
    except UnicodeDecodeError as err:
        raise CaptureError(
            f"{what} is not UTF-8 text (byte {err.start}): not a JSON file"
        ) from None


def writable(flag: str, path: str) -> None:
    """Create output file `path`'s directory if it is missing (as Megatron-LM creates --save);
    CaptureError naming `flag` when the file cannot be written there: a directory in its place,
    a parent that is a file or cannot be created, a directory without write permission."""
    if os.path.isdir(path):
        raise CaptureError(f"{flag} {path} is a directory: give the file to write")
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as err:
        raise CaptureError(
            f"{flag} {path}: its directory {parent} cannot be created ({err.strerror})"
        ) from None
    if not os.access(parent, os.W_OK):
        raise CaptureError(f"{flag} {path}: the directory {parent} is not writable")


def writable_dir(flag: str, path: str) -> None:
    """CaptureError unless directory `path` exists or can be created, and can be written."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise CaptureError(f"{flag} {path} is a file, not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        raise CaptureError(f"{flag} {path} cannot be created ({err.strerror})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise CaptureError(f"{flag} {path} is not writable by this user")
