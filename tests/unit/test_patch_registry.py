"""The patch registry (capture_megatron/emulate/patches.py): every target of every patch exists in
the installed torch and megatron-core (where a megatron-core upgrade starts; each CI leg checks its
own megatron-core, 0.16.1 and 0.19.2), every patch applied is written for the installed
megatron-core series, revert() puts every original back, docs/ARCHITECTURE.md lists every patch
with its series, and tests/conftest.py's `unpatched` fixture
leaves torch unpatched after a test that trained megatron-core's schedule on CPU."""

import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from capture_megatron.config import versions as mcore
from capture_megatron.emulate.patches import MEGATRON_CORE_VERSIONS, Patch, series_range

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "ARCHITECTURE.md"

SCRIPT = textwrap.dedent(
    """
    import importlib, json, sys
    import torch
    from capture_megatron.train.checkpoint import megatron_fixes as ckpt_fixes
    from capture_megatron.train.checkpoint import trust as ckpt_safe
    from capture_megatron.train import data_cache
    from capture_megatron.emulate import cpu_compat
    from capture_megatron.emulate import patches

    def resolve(target):
        if target.startswith("sys.modules["):
            return sys.modules, target[len("sys.modules['"):-2]
        parts = target.split(".")
        for i in range(len(parts) - 1, 0, -1):
            try:
                owner = importlib.import_module(".".join(parts[:i]))
                break
            except ImportError:
                continue
        for name in parts[i:-1]:
            owner = getattr(owner, name)
        return owner, parts[-1]

    def current(owner, name):
        if owner is sys.modules:
            return sys.modules.get(name, patches._MISSING)
        if isinstance(owner, type):
            return owner.__dict__.get(name, patches._MISSING)
        return getattr(owner, name, patches._MISSING)

    out = []
    for device in ("cpu", "meta", "fake-cuda"):
        before = torch.cuda.current_device
        if device == "fake-cuda":
            cpu_compat.apply_fake_cuda()
        else:
            cpu_compat.apply(device)
        if device == "cpu":  # train/ applies these with the cpu patches
            ckpt_fixes.apply()
            ckpt_fixes.writers_die_with_rank()
            ckpt_safe.install()
            data_cache.install()
        originals = patches.originals()
        moded = torch._C._is_torch_function_mode_enabled()
        for p in patches.applied():
            owner, name = resolve(p.target)
            row = dict(device=device, target=p.target, why=p.why, adds=p.adds,
                       versions=p.versions, exists=originals[p.target] is not patches._MISSING)
            out.append(row)
        patches.revert()
        for row in out:
            if row["device"] == device:
                owner, name = resolve(row["target"])
                row["reverted"] = current(owner, name) is originals[row["target"]]
                # a class's inherited method (MCoreLoadPlanner.load_bytes) exists unpatched too
                row["exists"] |= isinstance(owner, type) and hasattr(owner, name)
                row["source"] = getattr(sys.modules.get(getattr(owner, "__name__", "")),
                                        "__file__", None)
        assert moded and not torch._C._is_torch_function_mode_enabled(), device
        assert torch.cuda.current_device is before and patches.device() is None, device
    # switching devices and back wraps megatron-core's method once; after revert() the next
    # apply wraps the original again
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer as ho
    cls = ho.HybridDeviceOptimizer
    unpatched = cls.__dict__["_init_sub_optimizers"]
    cpu_compat.apply("cpu")
    wrapped = cls.__dict__["_init_sub_optimizers"]
    cpu_compat.apply_fake_cuda()
    cpu_compat.apply("cpu")
    once = cls.__dict__["_init_sub_optimizers"] is wrapped and wrapped is not unpatched
    patches.revert()
    cpu_compat.apply("cpu")
    again = cls.__dict__["_init_sub_optimizers"].__closure__
    patches.revert()
    rewrapped = any(c.cell_contents is unpatched for c in again)
    print("RESULT ROWS " + json.dumps(out))
    print("RESULT WRAPS " + json.dumps(dict(once=once, rewrapped=rewrapped)))
    """
)


@pytest.fixture(scope="module")
def script() -> dict[str, object]:
    """The script's results, by the tag of each output line ("ROWS", "WRAPS")."""
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    tagged = [x.split(" ", 2)[1:] for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    return {tag: json.loads(value) for tag, value in tagged}


@pytest.fixture(scope="module")
def rows(script) -> list[dict]:
    """What each device's patches replaced, applied and reverted in a fresh interpreter."""
    return script["ROWS"]


def test_switching_devices_wraps_once_and_revert_lets_the_next_apply_wrap_the_original(script):
    """cpu -> fake-cuda -> cpu keeps one wrapper of HybridDeviceOptimizer._init_sub_optimizers;
    after revert() a new apply wraps megatron-core's own method."""
    assert script["WRAPS"] == {"once": True, "rewrapped": True}


def test_every_patch_target_exists_in_installed_torch_and_megatron_core(rows):
    """The guard of a megatron-core (or torch) upgrade: a renamed or removed target fails here.
    A target that megatron-core binds only with an optional package (`adds`) must still be a name
    its module uses."""
    assert {r["device"] for r in rows} == {"cpu", "meta", "fake-cuda"}
    assert len({r["target"] for r in rows}) >= 50
    for row in rows:
        assert row["exists"] or row["adds"], row["target"]
        if row["adds"] and row["source"]:
            name = row["target"].rsplit(".", 1)[1]
            text = pathlib.Path(row["source"]).read_text()
            assert re.search(rf"\b{name}\b", text), f"megatron-core no longer uses {name}"


def test_revert_restores_every_original_and_exits_the_modes(rows):
    """apply(device) then revert() leaves every torch / megatron-core attribute the original
    object (`is`), and no TorchFunctionMode active (asserted in the script)."""
    assert all(r["reverted"] for r in rows), [r["target"] for r in rows if not r["reverted"]]


def _torch_has_cuda_kernel(target: str) -> bool:
    """Whether `target` is a torch operator this torch build has a CUDA kernel for."""
    prefix = "torch.ops.aten."
    if not target.startswith(prefix):
        return False
    op = target[len(prefix) :]
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", "CUDA"))


def _doc_rows() -> dict[str, str]:
    """docs/ARCHITECTURE.md's "Patch registry" table: target -> its megatron-core series."""
    section = DOC.read_text().split("## Patch registry", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"^\| `([^`]+)` \|.*\| ([0-9.-]+) \|$", section, re.M))


def test_architecture_doc_lists_every_patch_of_the_installed_megatron_core(rows):
    """docs/ARCHITECTURE.md's "Patch registry" table has a row for every patch applied, with the
    patch's own megatron-core series, and every row whose series include the installed
    megatron-core is applied (a row of another series only: a patch that version needs)."""
    listed = _doc_rows()
    installed = mcore.current()
    applied = {r["target"]: r["versions"] for r in rows}
    assert {t: listed.get(t) for t in applied} == applied
    serving = {t for t, v in listed.items() if Patch("a.b", "x", versions=v).serves(installed)}
    # a CUDA kernel the fake device registers only where torch's build has none (a CPU build)
    serving -= {t for t in serving if t not in applied and _torch_has_cuda_kernel(t)}
    assert serving == set(applied)


def test_every_applied_patch_serves_the_installed_megatron_core(rows):
    """A patch applied on the installed megatron-core names its series (patch() refuses one
    that does not); the registry covers exactly the supported series."""
    installed = mcore.current()
    assert all(Patch(r["target"], r["why"], versions=r["versions"]).serves(installed) for r in rows)
    first, last = series_range(MEGATRON_CORE_VERSIONS)
    assert (first, last) == (mcore.V0_16, mcore.V0_19)


def test_a_patch_outside_its_versions_is_refused(monkeypatch):
    """patch() raises for a patch written for a series other than the installed one, and leaves
    the target untouched; a malformed versions string is a ValueError."""
    import types

    from capture_megatron.emulate import patches

    installed = mcore.current()
    other = "0.16" if installed != mcore.V0_16 else "0.19"
    owner = types.ModuleType("a_module")
    owner.value = 1
    with pytest.raises(RuntimeError, match="written for megatron-core"):
        patches.patch(owner, "value", 2, "a test", versions=other)
    assert owner.value == 1 and patches.applied() == []
    patches.patch(owner, "value", 3, "a test", versions=str(installed))
    assert owner.value == 3
    patches.revert()
    assert owner.value == 1
    for bad in ("0.19-0.16", "0.16.1", "sixteen"):
        with pytest.raises(ValueError):
            Patch("a.b", "x", versions=bad)


TORCH_SNAPSHOT = {
    name: getattr(torch.cuda, name)
    for name in ("is_available", "current_device", "synchronize", "empty_cache", "Stream")
} | {"mode": torch._C._is_torch_function_mode_enabled()}


def test_torch_is_unpatched_at_test_start():
    """Whatever ran before in this process, torch's CUDA entry points are the ones torch had when
    this module was imported, and no TorchFunctionMode is active."""
    from capture_megatron.emulate import patches

    assert patches.applied() == [] and patches.device() is None
    assert not torch._C._is_torch_function_mode_enabled()
    for name, original in TORCH_SNAPSHOT.items():
        if name != "mode":
            assert getattr(torch.cuda, name) is original, name
    assert torch.cuda.current_device.__module__ == "torch.cuda"


@pytest.mark.slow  # trains on CPU in a subprocess: 10-20 s, the full suite runs it
def test_torch_unpatched_after_a_cpu_training_test(tmp_path):
    """Run megatron-core's pipeline schedule on CPU (test_schedule, in-process: cpu_compat.apply),
    then the check above, in one pytest process: the fixture reverted the first test's patches."""
    log = tmp_path / "patches.log"
    tests = [
        "tests/unit/test_schedule.py::test_events_equal_megatron[2-4-1]",
        "tests/unit/test_patch_registry.py::test_torch_is_unpatched_at_test_start",
    ]
    env = dict(os.environ, CAPTURE_MEGATRON_PATCH_LOG=str(log))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider"]
    done = subprocess.run(
        [*command, *tests], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env
    )
    assert done.returncode == 0, done.stdout[-3000:]
    entries = [line.split("\t") for line in log.read_text().splitlines()]
    trained = [int(n) for nodeid, n in entries if "test_schedule" in nodeid]
    assert trained and min(trained) > 0  # the schedule test patched torch / megatron-core
    assert entries[-1][0].endswith("test_torch_is_unpatched_at_test_start")
