"""Selective recompute's discarded outputs are counted as freed (memory/live.py hears
megatron-core's CheckpointWithoutOutput free them with `untyped_storage().resize_(0)`), on the
GPU kernel set in bf16 and under FP8: one MoE layer probed with and without --recompute-modules
moe_act (4 experts, top-2, EP 2, capacity 1 padded: 256 expert rows of width 256 on a rank)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from capture_megatron.memory.live import LiveTensorTracker

ROWS, WIDTH = 256, 256


def test_a_storage_resized_in_place_is_recounted():
    """resize_(0) releases a tracked storage's bytes, resizing back counts them again."""
    before = torch.UntypedStorage.resize_  # (a process-long CpuMeter may hold it already)
    with LiveTensorTracker() as tracker:
        t = torch.empty(1024, dtype=torch.float32)
        assert tracker.current_bytes == 4096
        t.untyped_storage().resize_(0)
        assert tracker.current_bytes == 0
        t.untyped_storage().resize_(4096)
        assert tracker.current_bytes == tracker.peak_bytes == 4096
    assert torch.UntypedStorage.resize_ is before  # restored on exit


def _saved(modules: tuple[str, ...], fp8: bool) -> int:
    from capture_megatron.config import Kernels
    from capture_megatron.features.moe import Experts
    from capture_megatron.profile.session import run_probes
    from capture_megatron.records import ExpertsProbe, Probe, ProbeShape, Variant

    experts = Experts(
        num_experts=4, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=True, moe_expert_capacity_factor=1.0,
        moe_pad_expert_input_to_capacity=True, moe_aux_loss_coeff=0.01, routing_bound=True,
    )  # fmt: skip
    kernels = Kernels(fp8_format="hybrid", fp8_recipe="tensorwise") if fp8 else Kernels()
    rc = "selective" if modules else "none"
    variant = Variant("bf16", rc, True, True, "RMSNorm", "rope", False, False, True)
    variant = dataclasses.replace(
        variant, recompute_modules=modules, moe=ExpertsProbe(experts, 2, 1, "exact")
    )
    shape = ProbeShape(2, 128, 128, 4, 4, 32, 256, 256, 2)
    probe = Probe(variant, shape, "middle", 1)
    return run_probes([probe], "fake-cuda", kernels.for_gpu(), progress=False)[0].saved_bytes


@pytest.mark.slow
def test_moe_act_frees_the_activation_output_unless_fp8_already_does():
    """bf16: the second expert GEMM saves the activation's output [rows, width]; recomputing
    moe_act discards it. FP8: that GEMM saves its own FP8 copy instead, the bf16 output dies
    anyway, so recomputing moe_act saves nothing more."""
    assert _saved((), False) - _saved(("moe_act",), False) == ROWS * WIDTH * 2
    assert _saved((), True) == _saved(("moe_act",), True)
