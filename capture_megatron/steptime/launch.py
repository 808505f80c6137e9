"""Host launch time and what CUDA graphs save (--cuda-graph-impl, --cuda-graph-scope). Pure
Python.

In eager mode the host launches every kernel (launch_seconds each: PyTorch's dispatcher and the
CUDA launch); the GPU runs ahead of the host as long as its kernels take longer than their
launches, so a layer costs the longer of its kernels' time and its launches' (small per-GPU work:
small models, high TP or EP, small micro-batches). A captured CUDA graph replays its kernels with
one launch. megatron-core 0.16.1's scopes (transformer/enums.py CudaGraphScope): attn, mlp (dense
layers), moe (drop-and-pad MoE layers only), moe_router, moe_preprocess; empty: the whole layer;
full_iteration (--cuda-graph-impl local): the whole forward and backward of a step, the schedule's
own host work (chunk_overhead) included.

The kernel counts per module are estimates of megatron-core 0.16.1's Transformer Engine layers
(fused norms, linear layers, rotary embedding, fused attention, bias-dropout-add, the
communication calls; MLA's extra projections, norms and splits; the router's score kernels,
the dispatcher's metadata and permutes); the backward launches about twice the forward's.
"""

from __future__ import annotations

from capture_megatron.config import ModelShape, ParallelPlan
from capture_megatron.steptime.kernels import Setting

KERNELS = {
    "attn": 12,
    "mla": 10,
    "mlp": 7,
    "moe_router": 14,
    "moe_preprocess": 8,
    "moe": 10,
    "expert": 3,
}
"""Kernels each module launches in one forward (mla: MLA's extra ones; expert: each local expert's
own without --moe-grouped-gemm, else once for the grouped GEMMs)."""
LAYER = ("attn", "mlp", "moe")
"""What the default (empty) scope captures: the whole layer."""


def captured(s: Setting) -> frozenset[str]:
    """The module scopes CUDA graphs capture (empty without CUDA graphs)."""
    if s.run.cuda_graph_impl in ("", "none"):
        return frozenset()
    scope = frozenset(s.run.cuda_graph_scope)
    return scope if scope else frozenset(LAYER)


def full_iteration(s: Setting) -> bool:
    """Whether one graph replays the whole step (the schedule's host work included)."""
    return "full_iteration" in captured(s)


def _modules(shape: ModelShape, plan: ParallelPlan, moe: bool) -> dict[str, int]:
    """Kernels per module of one layer's forward."""
    attn = KERNELS["attn"] + (KERNELS["mla"] if shape.mla.enabled else 0)
    if not moe:
        return {"attn": attn, "mlp": KERNELS["mlp"]}
    m = shape.moe
    experts = KERNELS["expert"] * (1 if m.moe_grouped_gemm else max(m.num_experts // plan.ep, 1))
    return {
        "attn": attn,
        "moe_router": KERNELS["moe_router"],
        "moe_preprocess": KERNELS["moe_preprocess"],
        "moe": KERNELS["moe"] + experts,
    }


def host_seconds(s: Setting, shape: ModelShape, plan: ParallelPlan, moe: bool) -> float:
    """Host seconds one layer's forward takes to launch (the backward: twice), the captured
    scopes one launch each. A dropless MoE layer cannot be captured whole (megatron-core captures
    the moe scope for drop-and-pad layers only); its router and preprocess can."""
    scopes = captured(s)
    if "full_iteration" in scopes:
        return 0.0
    padded = shape.moe.moe_pad_expert_input_to_capacity
    launches = 0
    for name, count in _modules(shape, plan, moe).items():
        graphed = name in scopes and (name != "moe" or padded)
        if name in ("moe_router", "moe_preprocess") and "moe" in scopes and padded:
            graphed = True
        launches += 1 if graphed else count
    return launches * s.k.launch_seconds


def host_bound(forward: float, backward: float, host: float) -> tuple[float, float]:
    """(forward, backward) seconds the host adds to a layer whose kernels take `forward` and
    `backward` when launching them takes `host` and 2 x `host`."""
    return max(0.0, host - forward), max(0.0, 2 * host - backward)
