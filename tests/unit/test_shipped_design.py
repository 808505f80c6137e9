"""The shipped design-shape records (capture_megatron/profile/design) match the keys this code
looks them up by: a change of version, Variant or kernel set without re-running
bench/ship_design.py would leave every design profile to run on the spot (minutes each)."""

from __future__ import annotations

from importlib import resources
from importlib.metadata import version

import pytest

from capture_megatron.config import Kernels
from capture_megatron.config.kernels import kernel_set
from capture_megatron.config.presets import preset
from capture_megatron.profile.design import variant_tps
from capture_megatron.profile.design_cache import SHIPPED, design_key
from capture_megatron.records import Variant

SHIPPED_NAMES = {
    p.name for p in resources.files("capture_megatron.profile").joinpath(SHIPPED).iterdir()
}


SHIPPED_FOR = ("2.13.0+cpu", "0.16.1")
"""The torch and megatron-core the design records are shipped for (bench/ship_design.py: the
default CI leg's); on any other (the second leg's 0.19.2) they are profiled and cached instead."""


@pytest.mark.skipif(
    (version("torch"), version("megatron-core")) != SHIPPED_FOR,
    reason="design records are shipped for torch 2.13.0+cpu and megatron-core 0.16.1 only",
)
@pytest.mark.parametrize("name", ["gpt3-1.3b", "llama2-7b"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("sp, tp", [(False, 2), (True, 4)])
def test_every_shipped_design_key_is_found(name, recompute, sp, tp):
    variant = Variant.of(preset(name), recompute, sp)
    kernels = kernel_set("fake-cuda", Kernels().for_gpu())
    key = design_key("fake-cuda", kernels, variant, variant_tps(variant, tp), True)
    assert key + ".jsonl.gz" in SHIPPED_NAMES, "run python bench/ship_design.py"


def test_no_stale_files_are_shipped():
    assert len(SHIPPED_NAMES) == 12, sorted(SHIPPED_NAMES)
