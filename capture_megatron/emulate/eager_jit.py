"""megatron-core's fused functions run eagerly in a process without CUDA, by megatron's own switch.

megatron-core 0.16.1 decorates its fused functions (bias-GeLU, bias-SwiGLU, the experts' GLU, the
router's expert bias, L2Norm, ...) with ``megatron.core.jit.jit_fuser``, which is
``torch.compile`` on torch >= 2.2; ``megatron.core.jit.disable_jit_fuser()`` makes it a no-op
decorator. The decorator is applied when each module is imported, so the switch must come before
megatron-core's first import, which ``install`` arranges: an import hook calls
``disable_jit_fuser()`` right after ``megatron.core.jit`` executes, before any module that uses
it.

Why, in a CPU run:
- the profiling workers run these functions eagerly already (TORCHDYNAMO_DISABLE: the fake-CUDA
  device cannot compile), so a CPU training rank now runs the functions the probes measured;
- ``torch.compile`` on a CPU compiles C++ with Inductor at a function's first call (seconds per
  function, and a C++ compiler the machine may lack), and merely decorating imports torch._dynamo
  and Inductor: about 1.3 s of each process's 3.5 s start on this machine.

Only CPU processes install it (training ranks without CUDA, the profiling workers); a GPU rank
keeps megatron's compiled functions. Not in the patch registry (emulate.patches): it changes a
process before megatron-core exists in it and cannot be undone there (the decorated functions keep
what they were decorated with).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

JIT_MODULE = "megatron.core.jit"
"""The module that defines jit_fuser and disable_jit_fuser (megatron-core 0.16.1)."""


class _EagerJit(importlib.abc.MetaPathFinder):
    """Finds megatron.core.jit as the path finder does, and switches its fuser off once it ran."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        """The spec of megatron.core.jit with the switch added (None for every other module)."""
        if fullname != JIT_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        loader: Any = spec.loader if spec else None
        if spec is None or not hasattr(loader, "exec_module"):
            return None
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            module.disable_jit_fuser()

        loader.exec_module = exec_module
        return spec


def install() -> bool:
    """Make megatron-core's jit_fuser a no-op in this process; False (nothing done) when
    megatron.core.jit was imported already (its functions are decorated by then)."""
    if JIT_MODULE in sys.modules:
        return False
    if not any(isinstance(f, _EagerJit) for f in sys.meta_path):
        sys.meta_path.insert(0, _EagerJit())
    return True


def eager() -> bool:
    """Whether megatron-core's jit_fuser is the no-op decorator in this process."""
    jit = sys.modules.get(JIT_MODULE)
    return jit is not None and getattr(jit, "jit_fuser", None) is getattr(jit, "noop_decorator", 0)
