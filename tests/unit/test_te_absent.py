"""megatron-core 0.16.1 without Transformer Engine on any device (issue 52): its MoE router reads
`moe_utils.te_general_gemm`, which only TE's import defines, so without TE the router raised
NameError at its first forward -- on a GPU too (an H200 run needed the name set by hand), where the
fix used to be applied on CPU only. emulate/te_absent.py sets it through the patch registry, and
`cpu_compat.apply` applies it whether or not CUDA is usable (training, `profile --device cuda`)."""

from __future__ import annotations

import pytest
import torch

from capture_megatron.emulate import cpu_compat, patches

TARGET = "megatron.core.transformer.moe.moe_utils.te_general_gemm"


def _needed() -> bool:
    """megatron-core lacks the name without TE (0.16; 0.19 binds it to None itself)."""
    from megatron.core.transformer.moe import moe_utils

    return not hasattr(moe_utils, "te_general_gemm")


NEEDED = _needed()
"""Whether the installed megatron-core needs the patch (read before any test patches)."""


def _gating():
    """The router's gating GEMM (moe_utils.router_gating_linear), forward and backward."""
    from megatron.core.transformer.moe import moe_utils

    x = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(4, 8, requires_grad=True)
    out = moe_utils.router_gating_linear(x, w, None, torch.float32)
    out.sum().backward()
    return out, x.grad


@pytest.mark.skipif(not NEEDED, reason="this megatron-core binds te_general_gemm without TE")
def test_without_te_the_router_fails_unpatched():
    """The failure the patch fixes (no TE on this machine), on plain tensors: no device at all."""
    assert not patches.applied()
    with pytest.raises(NameError, match="te_general_gemm"):
        _gating()


def test_applied_where_cuda_is_usable_and_nothing_else(monkeypatch):
    """As on a GPU machine without TE (cpu_compat.needed() False): apply() patches the router's
    name and nothing of the CPU kernel set (no device redirection, no mode), and the router
    computes x w^T."""
    monkeypatch.setattr(cpu_compat, "needed", lambda: False)
    cpu_compat.apply("cpu")
    assert [p.target for p in patches.applied()] == ([TARGET] if NEEDED else [])
    assert patches.device() is None and not torch._C._is_torch_function_mode_enabled()
    out, grad = _gating()
    assert out.shape == (6, 4) and grad.shape == (6, 8)
    patches.revert()
    assert _needed() == NEEDED  # reverted: the module as megatron-core left it


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_applied_on_the_host_devices(device):
    cpu_compat.apply(device)
    assert (TARGET in [p.target for p in patches.applied()]) == NEEDED
