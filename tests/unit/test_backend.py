"""The builder's Backend (issue 30): chosen once by the caller from the device and kernels, it says
what a rank's layers are built from, so the builder never asks which device the patches were
applied for."""

from __future__ import annotations

import pytest

from capture_megatron.config import Kernels
from capture_megatron.megatron.backend import Backend

TE = Kernels(transformer_impl="transformer_engine")
LOCAL = Kernels(transformer_impl="local")


@pytest.mark.parametrize(
    ("device", "kernels", "kind", "real_te", "te_attention"),
    [
        ("cpu", None, "cpu", False, False),
        ("fake-cpu", None, "cpu", False, False),
        ("fake-cuda", TE, "emulated-gpu", False, True),
        ("fake-cuda", LOCAL, "emulated-gpu", False, False),
        ("cuda", TE, "gpu", True, True),
        ("cuda", LOCAL, "gpu", False, False),
        ("cuda", None, "cpu", False, False),
    ],
)
def test_the_device_and_kernels_decide_the_backend(device, kernels, kind, real_te, te_attention):
    b = Backend.of(device, kernels)
    assert (b.kind, b.real_te, b.te_attention, b.emulated) == (
        kind,
        real_te,
        te_attention,
        kind == "emulated-gpu",
    )


def test_the_emulated_unfused_backend_keeps_no_te_attention_and_kinds_are_checked():
    unfused = Kernels(transformer_impl="transformer_engine", attention_backend="unfused")
    assert not Backend.of("fake-cuda", unfused).te_attention
    with pytest.raises(ValueError):
        Backend("gpu")  # a GPU backend without kernels
    with pytest.raises(ValueError):
        Backend("tpu", TE)
