"""megatron-core 0.16.1 through 0.19.x (issue 55): the supported range and the installed series
(capture_megatron.config.versions), `capture-megatron --version` and `python -m capture_megatron`,
the flag table of each series, the install requirements that never replace an installed
megatron-core or torch, and what the GPU kernel set refuses on 0.19."""

from __future__ import annotations

import functools
import os
import pathlib
import subprocess
import sys
from importlib.metadata import version

import pytest
import tomllib

from capture_megatron.config import versions
from capture_megatron.errors import CaptureError
from capture_megatron.flags import megatron_lm

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_versions_parse_and_the_supported_range_is_0_16_1_through_0_19():
    assert versions.parse("0.19.2") == (0, 19, 2)
    assert versions.parse("0.16.1+nv25.12") == (0, 16, 1)
    assert versions.parse("0.17.0rc0") == (0, 17, 0)
    assert versions.series_of("0.16.1") == versions.V0_16
    assert versions.series_of("0.18.2") == versions.Series(0, 18)
    assert versions.series_of("0.19.2") == versions.V0_19
    for outside in ("0.16.0", "0.15.3", "0.20.0", "1.0.0"):
        with pytest.raises(CaptureError, match="supports megatron-core >=0.16.1,<0.20"):
            versions.series_of(outside)


def test_the_installed_megatron_core_is_read_from_package_metadata():
    assert versions.megatron_core() == version("megatron-core")
    assert str(versions.current()) in ("0.16", "0.17", "0.18", "0.19")


def test_install_requirements_admit_every_supported_version_and_pin_no_torch():
    """pyproject.toml: megatron-core's range is SUPPORTED's, torch has no upper bound (an
    environment's torch, e.g. a container's, is never replaced for a newer or older one)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"megatron-core{versions.SUPPORTED}" in deps
    torch = [d for d in deps if d.startswith("torch")]
    assert torch == ["torch>=2.6"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    return subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, timeout=120, env=env
    )


def test_version_names_this_package_and_the_stack_it_runs_on():
    """`python -m capture_megatron --version`: capture-megatron, megatron-core, torch,
    Transformer Engine and apex as installed, without importing torch (fast)."""
    from capture_megatron import __version__

    done = _cli("capture_megatron", "--version")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    lines = dict(line.split(None, 1) for line in done.stdout.splitlines()[:5])
    assert lines["capture-megatron"] == __version__
    assert lines["megatron-core"] == version("megatron-core")
    assert lines["torch"] == version("torch")
    assert set(lines) == {
        "capture-megatron",
        "megatron-core",
        "torch",
        "transformer-engine",
        "apex",
    }
    assert "supports megatron-core >=0.16.1,<0.20" in done.stdout


def test_python_dash_m_capture_megatron_is_the_console_script():
    done = _cli("capture_megatron", "--help")
    assert done.returncode == 0 and done.stdout.startswith("usage: capture-megatron")
    done = _cli("capture_megatron", "no-such-command")
    assert done.returncode == 2 and "unknown command 'no-such-command'" in done.stderr


def test_each_series_reads_its_own_megatron_lm_table():
    old, new = (megatron_lm.arguments(s) for s in (versions.V0_16, versions.V0_19))
    names = [{a.flags[0] for a in table} for table in (old, new)]
    assert "--moe-extended-tp" in names[0] - names[1]  # removed in core_v0.19.0
    assert "--use-mup" in names[1] - names[0]  # added
    assert megatron_lm.table_series(versions.Series(0, 17)) == versions.V0_19
    assert megatron_lm.arguments() == megatron_lm.arguments(versions.current())


def test_spec_helpers_read_module_specs_and_partial_builders():
    """megatron-core 0.16's ModuleSpecs and 0.19's functools.partial builders read alike."""
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from capture_megatron.megatron import versioned

    parts = MLPSubmodules(linear_fc1=int, linear_fc2=float)
    for spec in (
        ModuleSpec(module=MLP, submodules=parts),
        functools.partial(MLP, submodules=parts),
    ):
        assert versioned.module_of(spec) is MLP and versioned.submodules_of(spec) is parts
        other = MLPSubmodules(linear_fc1=str, linear_fc2=float)
        changed = versioned.with_submodules(spec, other)
        assert type(changed) is type(spec) and versioned.submodules_of(changed) is other


@pytest.mark.skipif(versions.current() < versions.V0_19, reason="megatron-core 0.19's rule")
def test_flex_is_refused_on_megatron_core_0_19():
    """The GPU kernel set emulates HybridEP as megatron-core 0.16 calls it: on 0.19 flex
    probes are refused with the reason, not run on an emulation of another version."""
    from types import SimpleNamespace

    from capture_megatron.rules.modelled import _flex_device_problem

    experts = SimpleNamespace(moe_token_dispatcher_type="flex")
    variant = SimpleNamespace(moe=SimpleNamespace(experts=experts, ep=2, etp=1))
    assert "0.19's dispatch" in _flex_device_problem(variant, "fake-cuda")  # type: ignore[arg-type]
