"""What a Megatron-LM checkout needs installed before its pretrain_gpt.py can start, checked before
`capture-megatron megatron-lm` launches torchrun (a missing module would otherwise surface as one
raw traceback per rank plus torchrun's own report).

Megatron-LM's scripts import more than megatron-core declares: at core_v0.16.1 pretrain_gpt.py
needs `six` and `regex` (its tokenizers), `triton` (megatron/training/initialize.py imports the
batch-invariant kernels unconditionally, even on CPU) and `pydantic` (megatron/rl, imported by
training.py), and at start-up rank 0 compiles megatron/core/datasets/helpers.cpp with `pybind11`.
None of this is hard-coded here: the checkout's own import graph is read (`required_modules`: the
imports every module executes unconditionally at import time, followed through the checkout's own
modules), and when that finds nothing missing the script's imports are run once in a subprocess
(`probe`) to catch what reading the source cannot see. Pure Python; runs without torch.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig

from capture_megatron.errors import CaptureError

SCRIPT = "pretrain_gpt.py"
"""The Megatron-LM script the wrapper runs."""
PIP_NAMES = {"yaml": "pyyaml", "PIL": "pillow", "sklearn": "scikit-learn", "attr": "attrs"}
"""Import names whose package on the registry is named differently."""
HELPERS = os.path.join("megatron", "core", "datasets")
"""Where Megatron-LM keeps the C++ dataset helpers it compiles at start-up."""
PROBE_TIMEOUT_S = 300
"""How long the import probe may take (it imports torch and Megatron)."""


def _module_file(checkout: str, name: str) -> str | None:
    """The checkout's file for module `name` (a package's __init__.py), or None."""
    path = os.path.join(checkout, *name.split("."))
    if os.path.isfile(os.path.join(path, "__init__.py")):
        return os.path.join(path, "__init__.py")
    return path + ".py" if os.path.isfile(path + ".py") else None


def _in_checkout(checkout: str, name: str) -> bool:
    """Whether `name` resolves inside the checkout (a module, a package or a namespace folder)."""
    return _module_file(checkout, name) is not None or os.path.isdir(
        os.path.join(checkout, *name.split("."))
    )


def _unconditional_imports(tree: ast.Module, package: str) -> list[str]:
    """Absolute names imported by statements at module level outside try / if blocks (those are
    optional or conditional) and outside functions and classes (those run later, if at all);
    `from a import b` yields both a and a.b (b may be a submodule)."""
    names: list[str] = []
    todo = list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.With, ast.For)):
            todo[:0] = node.body
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(p for p in (*parts, base) if p)
            names += [base] + [f"{base}.{alias.name}" for alias in node.names]
    return [n for n in names if n]


def required_modules(checkout: str, script: str = SCRIPT) -> dict[str, str]:
    """Top-level modules outside the checkout that `script` needs at import time: name -> the
    checkout file (relative path) that imports it first."""
    found: dict[str, str] = {}
    seen: set[str] = set()
    todo = [(os.path.join(checkout, script), "")]
    while todo:
        path, package = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        for target in _unconditional_imports(tree, package):
            parts = target.split(".")
            if not _in_checkout(checkout, parts[0]):
                found.setdefault(parts[0], os.path.relpath(path, checkout).replace(os.sep, "/"))
                continue
            for depth in range(1, len(parts) + 1):  # importing a.b.c runs a, a.b and a.b.c
                prefix = ".".join(parts[:depth])
                file = _module_file(checkout, prefix)
                if file is not None:
                    is_package = file.endswith("__init__.py")
                    parent = prefix if is_package else prefix.rpartition(".")[0]
                    todo.append((file, parent))
    return found


def _installed(name: str) -> bool:
    if name in sys.builtin_module_names or name in getattr(sys, "stdlib_module_names", ()):
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def launch_path() -> str:
    """PATH for the launched job: this interpreter's folder first, so that `python3` in
    Megatron-LM's start-up `make` (`python3 -m pybind11`) is the interpreter that runs the job."""
    return os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])


def helper_files(checkout: str) -> tuple[str, ...]:
    """The compiled dataset helpers the run needs (none when the checkout has no helpers.cpp): the
    module this interpreter imports, and the file Megatron-LM's Makefile builds at start-up --
    named by the first `python3-config --extension-suffix` on PATH, which in a virtual
    environment (it has none) may belong to another Python."""
    folder = os.path.join(checkout, HELPERS)
    if not os.path.isfile(os.path.join(folder, "helpers.cpp")):
        return ()
    own = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    try:
        make = subprocess.run(
            ["python3-config", "--extension-suffix"],
            capture_output=True,
            text=True,
            env=dict(os.environ, PATH=launch_path()),
        ).stdout.strip()
    except OSError:  # no python3-config: the Makefile's suffix is empty
        make = ""
    return tuple(os.path.join(folder, "helpers_cpp" + x) for x in dict.fromkeys((own, make)))


def helper_built(checkout: str) -> bool:
    """Whether the checkout's dataset helpers are compiled for this run (or not needed)."""
    return all(os.path.isfile(f) for f in helper_files(checkout))


def probe(checkout: str, script: str = SCRIPT) -> str | None:
    """Run the script's imports (not its main block) once in a subprocess; the top-level name of
    a module it could not import, or None."""
    code = (
        "import runpy, sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "try:\n"
        "    runpy.run_path(sys.argv[2], run_name='capture_megatron_probe')\n"
        "except ModuleNotFoundError as e:\n"
        "    print('MISSING', (e.name or '').split('.')[0])\n"
    )
    env = dict(os.environ, PYTHONWARNINGS="ignore", RANK="0")
    done = subprocess.run(
        [sys.executable, "-c", code, checkout, os.path.join(checkout, script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=PROBE_TIMEOUT_S,
    )
    for line in done.stdout.splitlines():
        if line.startswith("MISSING "):
            name = line.split(" ", 1)[1]
            return None if not name or _in_checkout(checkout, name) else name
    return None


def missing_modules(checkout: str, run_probe: bool = True) -> dict[str, str]:
    """Modules the checkout's pretrain_gpt.py needs that are not installed: name -> who needs it."""
    missing = {name: by for name, by in required_modules(checkout).items() if not _installed(name)}
    if not helper_built(checkout) and not _installed("pybind11"):
        missing["pybind11"] = (
            f"{HELPERS.replace(os.sep, '/')}/Makefile, which compiles helpers.cpp at start-up"
        )
    if not missing and run_probe:
        name = probe(checkout)
        if name is not None:
            missing[name] = SCRIPT
    return missing


def check(checkout: str, run_probe: bool = True) -> None:
    """CaptureError naming every missing module and the pip command that installs them."""
    missing = missing_modules(checkout, run_probe)
    if not missing:
        return
    names = sorted(missing)
    needs = "; ".join(f"{n} (needed by {missing[n]})" for n in names)
    pip = " ".join(PIP_NAMES.get(n, n) for n in names)
    raise CaptureError(
        f"the Megatron-LM checkout {checkout} cannot start here: its {SCRIPT} needs Python "
        f"modules this environment lacks: {needs}. Megatron-LM's scripts need more than "
        f"megatron-core declares; install them into this environment with `{sys.executable} -m "
        f"pip install {pip}` (none of them replaces torch) and run again."
    )


def build_helper(checkout: str) -> None:
    """Compile the checkout's dataset helpers for this interpreter when they are missing, under
    every name of helper_files: the copy under the Makefile's name (another Python's suffix, never
    imported by this one) only lets Megatron-LM's start-up `make` find its target up to date
    instead of compiling it again, or failing, with another Python's settings."""
    if helper_built(checkout):
        return
    own, *others = helper_files(checkout)
    folder = os.path.dirname(own)
    includes = subprocess.run(
        [sys.executable, "-m", "pybind11", "--includes"], capture_output=True, text=True
    ).stdout.strip()
    suffix = os.path.basename(own)[len("helpers_cpp") :]
    done = subprocess.run(
        ["make", "-C", folder, f"CPPFLAGS={includes}", f"LIBEXT={suffix}"],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0 or not os.path.isfile(own):
        tail = " ".join((done.stderr or done.stdout).split()[-40:])
        raise CaptureError(
            f"could not compile Megatron-LM's dataset helpers in {folder} (make exit code "
            f"{done.returncode}: {tail}); Megatron-LM builds them with g++, make and pybind11 at "
            f"start-up: install those, or build them by hand with `make -C {folder}`, and run "
            "again."
        )
    for other in others:
        shutil.copy2(own, other)
        os.utime(other)  # newer than helpers.cpp: make's target is up to date
