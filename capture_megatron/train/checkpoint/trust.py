"""Loading a checkpoint without running code from it: the trust boundary of ``--load``.

A torch_dist checkpoint holds three kinds of pickles, and a crafted one can run any code while it
is unpickled on every rank:

- ``common.pt`` (the common state: iteration, shapes, the optimizer's param groups, the scheduler):
  read here with ``torch.load(weights_only=True)`` (``load_common``), torch's restricted unpickler
  (tensors, containers, numbers and strings only);
- the byte items inside the ``.distcp`` shards (this project's RNG states, saved as ShardedObjects):
  torch's DefaultLoadPlanner reads them with ``torch.load(weights_only=False)``; ``install()`` makes
  megatron-core's load planner (MCoreLoadPlanner) read them with ``weights_only=True``;
- ``.metadata`` (torch.distributed.checkpoint's index of the shards), which torch's
  FileSystemReader unpickles with plain ``pickle.load`` and offers no restricted mode for:
  ``check_metadata`` first unpickles it with an allow-list -- the dataclasses and enums of
  torch.distributed.checkpoint and megatron.core.dist_checkpointing, torch.Size, dtypes, layouts
  and memory formats, a few builtin containers -- and refuses the checkpoint, naming what it would
  import, when it references anything else.

Every load of this project (``train --load``, its preflight, every rank) goes through these
checks. What stays trusted: the tensor bytes themselves (read as raw storage, never executed), and
megatron-core's and torch's code. Checkpoints written by other tools may reference other classes in
their ``.metadata`` and are then refused; load only checkpoints from a source you trust with other
tools.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import os
import pickle
from typing import Any

from capture_megatron.emulate import patches
from capture_megatron.errors import CaptureError

_CLASS_MODULES = ("torch.distributed.checkpoint.", "megatron.core.dist_checkpointing.")
_PLAIN = {
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("collections", "OrderedDict"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("megatron.core.dist_checkpointing.strategies.torch", "MCoreMetadata"),
    ("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlan"),
}


def _allowed(module: str, name: str, obj: Any) -> bool:
    """Whether unpickling may reference `obj` (module.name)."""
    if (module, name) in _PLAIN:
        return True
    import torch

    if module == "torch" and isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
        return True
    if module.startswith(_CLASS_MODULES) and isinstance(obj, type):
        return dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)
    return False


class _Restricted(pickle.Unpickler):
    """An unpickler that imports only allowed names (and only from allowed modules)."""

    def find_class(self, module: str, name: str) -> Any:
        """The named object when allowed; UnpicklingError otherwise (nothing else is imported)."""
        known = module in ("builtins", "collections", "torch", "torch.serialization")
        if not (known or module.startswith(_CLASS_MODULES)):
            raise pickle.UnpicklingError(f"{module}.{name}")
        obj = super().find_class(module, name)
        if not _allowed(module, name, obj):
            raise pickle.UnpicklingError(f"{module}.{name}")
        return obj


def check_metadata(directory: str) -> None:
    """CaptureError unless the checkpoint's ``.metadata`` unpickles with the allow-list."""
    path = os.path.join(directory, ".metadata")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        raise CaptureError(f"cannot read {path}: {err.strerror or err}") from None
    try:
        _Restricted(io.BytesIO(data)).load()
    except pickle.UnpicklingError as err:
        raise CaptureError(
            f"{path} references {err}, which a torch_dist checkpoint's index never holds: "
            "unpickling it could run code, so the checkpoint is refused (a crafted or foreign "
            "file; see capture_megatron/train/checkpoint/trust.py for what is trusted)"
        ) from None
    except Exception as err:  # truncated or corrupt pickle
        raise CaptureError(f"{path} is unreadable ({type(err).__name__}: {err})") from None


def load_common(directory: str) -> dict:
    """The checkpoint's common state (``common.pt``), read with weights_only=True."""
    import torch

    path = os.path.join(directory, "common.pt")
    try:
        common = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise CaptureError(
            f"{path} holds objects other than tensors, containers, numbers and strings "
            f"({str(err).splitlines()[0][:200]}): unpickling it could run code, so the "
            "checkpoint is refused"
        ) from None
    except FileNotFoundError:
        raise CaptureError(f"{path} is missing") from None
    except Exception as err:  # truncated zip, wrong format
        raise CaptureError(f"{path} is unreadable ({type(err).__name__}: {err})") from None
    if not isinstance(common, dict):
        raise CaptureError(f"{path} does not hold a common state dict")
    return common


def _load_bytes(self, read_item, value: io.BytesIO) -> None:
    """DefaultLoadPlanner.load_bytes with torch.load(weights_only=True)."""
    import torch
    from torch.distributed.checkpoint._traverse import set_element

    obj = torch.load(value, weights_only=True)
    if self.flatten_state_dict:
        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
    else:
        self.state_dict[read_item.dest_index.fqn] = obj


def install() -> None:
    """Make megatron-core's torch_dist load planner read byte items with weights_only=True."""
    from megatron.core.dist_checkpointing.strategies.torch import MCoreLoadPlanner

    why = "torch_dist loads byte items with weights_only=True"
    patches.patch(MCoreLoadPlanner, "load_bytes", _load_bytes, why)


def load_failed(path: str, err: BaseException) -> CaptureError:
    """The one paragraph for a checkpoint dist_checkpointing could not load."""
    text = str(err)
    if "Weights only load failed" in text or "weights_only" in text:
        return CaptureError(
            f"--load {path}: a stored object in its shards holds more than tensors, containers, "
            "numbers and strings: unpickling it could run code, so the checkpoint is refused"
        )
    last = (text.strip().splitlines() or [type(err).__name__])[-1][:300]
    return CaptureError(
        f"--load {path}: megatron-core could not load the checkpoint ({type(err).__name__}: "
        f"{last}); it does not hold what this run's model and optimizer need"
    )
