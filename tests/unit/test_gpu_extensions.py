"""A run on a real GPU is refused before it starts, in one paragraph, when the fused kernels its
flags ask for are not installed (found on the lent H100, where Megatron-LM's defaults under the
local spec died inside megatron-core: apex's fused wgrad, TE's RoPE, Megatron's fused softmax)."""

from __future__ import annotations

import dataclasses

import pytest

from capture_megatron.config import Kernels
from capture_megatron.errors import CaptureError
from capture_megatron.megatron.extensions import gpu_kernels, missing_extensions

NOTHING = lambda module: False  # noqa: E731  (a machine with no extension installed)
EVERYTHING = lambda module: True  # noqa: E731

OFF = dict(masked_softmax_fusion=False, rope_fusion=False, gradient_accumulation_fusion=False)


def test_megatron_defaults_under_the_local_spec_name_every_flag_that_avoids_a_missing_kernel():
    missing = missing_extensions(Kernels(), "local", NOTHING)
    assert len(missing) == 3
    for fix in (
        "--no-masked-softmax-fusion",
        "--no-gradient-accumulation-fusion",
        "--no-rope-fusion",
    ):
        assert sum(fix in m for m in missing) == 1
    with pytest.raises(CaptureError) as err:
        gpu_kernels(Kernels(), "local", NOTHING)
    assert "fused_weight_gradient_mlp_cuda" in str(err.value) and "\n" not in str(err.value)


def test_the_flags_named_are_enough_and_installed_kernels_are_not_refused():
    assert missing_extensions(Kernels(**OFF), "local", NOTHING) == []
    assert gpu_kernels(Kernels(**OFF), "local", NOTHING).transformer_impl == "local"
    assert missing_extensions(Kernels(), "local", EVERYTHING) == []


def test_transformer_engine_brings_its_own_kernels_but_not_the_te_only_fusions():
    assert missing_extensions(Kernels(), "transformer_engine", NOTHING) == []
    te_entropy = Kernels(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="te")
    (only,) = missing_extensions(te_entropy, "transformer_engine", NOTHING)
    assert "--cross-entropy-fusion-impl native" in only
    native = dataclasses.replace(te_entropy, cross_entropy_fusion_impl="native")
    assert missing_extensions(native, "transformer_engine", NOTHING) == []
