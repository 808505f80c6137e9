"""The fake CUDA device: FakeTensorMode with autograd on `cuda:0` tensors in a torch without a GPU.

A CPU-only torch can create fake CUDA tensors, but the first autograd node on one aborts the
process (autograd asks for CUDA's device guard, which a CPU build lacks). fake_cuda.cpp registers
c10's own FakeGuardImpl<CUDA> as that guard and CUDA hooks that report one device; compiled once
against the installed torch's headers with the system C++ compiler (a few seconds, cached under
capture_megatron.cache.cache_dir()) and loaded with RTLD_GLOBAL *before* torch is imported, it lets
a whole megatron-core model run forward and backward on fake CUDA tensors, so that every op follows
CUDA's dispatch (native_dropout keeps a bool mask, native_layer_norm fp32 statistics, the flash
attention op its log-sum-exp). torch.cuda.is_available() stays False; real CPU tensors are
unaffected. Probes on this device run in their own process (capture_megatron.profile.worker).
With torch's CUDA build on a machine without a GPU (Python 3.12's torch from the package registry)
the shim first loads torch's CUDA library, then replaces its CUDA guard and hooks the same way.
See docs/MEMORY_MODEL.md.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import sys
from importlib import resources
from importlib.metadata import version

from capture_megatron.cache import cache_dir
from capture_megatron.errors import CaptureError

SOURCE = "fake_cuda.cpp"
"""The shim's C++ source, shipped as package data of capture_megatron.profile."""
COMPILERS = ("g++", "c++", "clang++")
"""C++ compilers tried, in order ($CXX first when set)."""
_LOADED: list[str] = []


def _torch_dir() -> str:
    spec = __import__("importlib.util").util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise CaptureError("the fake CUDA device needs torch installed")
    return list(spec.submodule_search_locations)[0]


def _compiler() -> str:
    for name in ([os.environ["CXX"]] if os.environ.get("CXX") else []) + list(COMPILERS):
        path = shutil.which(name)
        if path:
            return path
    raise CaptureError(
        "the fake CUDA device (--device fake-cuda, the default GPU memory model on a machine "
        "without a GPU) compiles a small C++ shim against torch and needs a C++ compiler: "
        "install one (e.g. `apt-get install g++`) or set $CXX; --device fake-cpu profiles CPU "
        "kernels without it"
    )


def shim_path() -> str:
    """The compiled shim for the installed torch (compiled on first use)."""
    source = resources.files("capture_megatron.emulate").joinpath(SOURCE).read_bytes()
    torch_dir = _torch_dir()
    # the shim links torch's libraries by absolute path (rpath): one shim per torch installation,
    # so that another venv (or a removed one) never hands its shim to this one
    stamp = version("torch") + sys.version + torch_dir
    key = hashlib.sha1(source + stamp.encode()).hexdigest()
    path = os.path.join(cache_dir(), "fake_cuda", f"libfake_cuda-{key[:16]}.so")
    if os.path.exists(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    src = f"{path[:-3]}-{os.getpid()}.cpp"  # own files: workers may compile at the same time
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(src, "wb") as f:
        f.write(source)
    lib = os.path.join(torch_dir, "lib")
    cuda = os.path.join(lib, "libtorch_cuda.so")  # torch's CUDA build: replace its guard, hooks
    cmd = [
        _compiler(), "-O1", "-shared", "-fPIC", "-std=c++17",
        "-I", os.path.join(torch_dir, "include"), src, "-o", tmp,
        "-L", lib, "-Wl,--no-as-needed", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}", "-ldl",
    ] + ([f'-DCAPTURE_MEGATRON_TORCH_CUDA="{cuda}"'] if os.path.exists(cuda) else [])  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise CaptureError(
            f"compiling the fake CUDA shim failed ({' '.join(cmd[:1])} exit {done.returncode}): "
            f"{done.stderr.strip()[-600:]}"
        )
    os.replace(tmp, path)
    return path


def cuda_build() -> bool:
    """Whether the installed torch is a CUDA build (read from torch/version.py: the shim is loaded,
    or not, before torch is imported). A CUDA build registers CUDA's device guard and hooks
    itself, and a second registration of the hooks would end the process."""
    with open(os.path.join(_torch_dir(), "version.py")) as f:
        found = re.search(r"^cuda\b[^=]*=\s*(.+?)\s*$", f.read(), re.M)
    return found is not None and found.group(1) != "None"


def load() -> None:
    """Load the shim into this process (nothing to load into a CUDA build of torch); CaptureError
    when torch is imported already (the shim must register before torch's first CUDA lookup)."""
    if "torch" in sys.modules:
        raise CaptureError(
            "the fake CUDA shim must be loaded before torch is imported; fake-cuda probes run in "
            "their own process (python -m capture_megatron.profile.worker)"
        )
    if cuda_build():
        _LOADED.append("torch's own CUDA device guard")
        return
    path = shim_path()
    ctypes.CDLL(path, mode=os.RTLD_GLOBAL)
    _LOADED.append(path)


def loaded() -> bool:
    """Whether this process runs with the shim (fake CUDA tensors support autograd)."""
    return bool(_LOADED)
