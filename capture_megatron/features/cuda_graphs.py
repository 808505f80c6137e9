"""CUDA graphs (--cuda-graph-impl local | transformer_engine, --cuda-graph-scope): the options, the
flag rules of Megatron-LM and megatron-core 0.16.1 that need no model, and what the graphs keep
(pure Python).

What megatron-core 0.16.1 keeps (transformer/cuda_graphs.py; Transformer Engine's
pytorch/graph.py make_graphed_callables at 5671fd36, which megatron calls with
_reuse_graph_input_output_buffers):
- the graphed callables are per transformer layer: the whole layer (no scope), or its attention
  part (`attn`), a dense layer's MLP (`mlp`), an MoE layer's MLP (`moe`, drop-and-pad only), its
  router and shared experts (`moe_router`) and dispatch preprocessing (`moe_preprocess`); MTP
  layers' inner layers too (TECudaGraphHelper; the local impl's CudaGraphManager per layer);
- TECudaGraphHelper captures one micro-batch without pipelining (PP 1 and no EP overlap), else
  every micro-batch of a step in the schedule's order, at iteration --cuda-graph-warmup-steps
  (after that many eager steps); each captured (layer, micro-batch) forward gets static inputs
  made by the layer's get_layer_static_inputs -- hidden states bf16 [s/CP (/TP with SP), b, h]
  and, where the scope holds self-attention, a causal mask bool [b, 1, s/CP, s] -- reused by a
  later forward of the same signature once the earlier one's backward is captured, so a rank
  holds as many as (layer, micro-batch) forwards are in flight at once in the schedule; the
  rotary table once; one gradient-output buffer per output signature. These live in the
  caching allocator's ordinary pool for the rest of the run;
- the graphs' own tensors (static outputs, saved activations, temporaries, gradient inputs) are
  allocated in one private pool while capturing and freed into it after (TE weak-references the
  static outputs and gradient inputs): the pool stays reserved, so after the capture the graphed
  scopes' activations are reserved memory, not allocated bytes.

So a rank's allocated peak is the largest of its eager steps' (the standard forecast, when
--cuda-graph-warmup-steps > 0), the capture's and the graphed steps' (the static buffers plus
what is not graphed); each is at most the standard forecast plus the static buffers, and what a
GPU holds after the capture -- the graphed steps' allocated bytes plus the pool -- is the same
amount. The forecast adds the static buffers to every moment (capture_megatron.forecast
.cuda_graphs): exact when the graphed scopes hold less than the buffers (router-only scopes),
an upper bound by at most the buffers otherwise. The 30+ GiB users report come from what 0.16.1
no longer does (one static input and output per (layer, micro-batch) before TE 2.7's buffer
reuse: every micro-batch of the step with PP) and from the pool, which is reserved beyond what
torch.cuda.max_memory_allocated shows.
"""

from __future__ import annotations

from dataclasses import dataclass

from capture_megatron.errors import require
from capture_megatron.fields import flag
from capture_megatron.serial import JsonMixin

IMPLS = ("none", "local", "transformer_engine")
"""Megatron-LM's --cuda-graph-impl choices."""
SCOPES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba", "full_iteration", "full")
"""Megatron-LM's --cuda-graph-scope values (megatron-core's CudaGraphScope, and the deprecated
'full', which means the whole layer)."""


@dataclass(frozen=True)
class CudaGraphs(JsonMixin):
    """Megatron-LM's CUDA graph settings (read only when an implementation is chosen)."""

    cuda_graph_impl: str = flag("--cuda-graph-impl", "none", choices=IMPLS, omit_default=True)
    """Which CUDA graphs: none, local (megatron-core's CudaGraphManager per layer, or the whole
    iteration) or transformer_engine (TE's make_graphed_callables per layer scope)."""
    cuda_graph_scope: tuple[str, ...] = flag(
        "--cuda-graph-scope", (), choices=SCOPES, omit_default=True
    )
    """What each graph captures: empty for the whole layer, else attn, mlp, moe, moe_router,
    moe_preprocess, mamba, or full_iteration (local only)."""
    cuda_graph_warmup_steps: int = flag("--cuda-graph-warmup-steps", 3, omit_default=True)
    """Eager training steps before the graphs are captured (their peak is the eager one)."""
    enable_cuda_graph: bool = flag("--enable-cuda-graph", False, omit_default=True)
    """Deprecated: --cuda-graph-impl local."""
    external_cuda_graph: bool = flag("--external-cuda-graph", False, omit_default=True)
    """Deprecated: --cuda-graph-impl transformer_engine."""
    moe_pad_experts_for_cuda_graph_inference: bool = flag(
        "--moe-pad-experts-for-cuda-graph-inference", False, omit_default=True
    )
    """Pads experts for inference graphs; Megatron-LM requires it for --cuda-graph-impl local
    with expert parallelism (training never reads it otherwise)."""

    def __post_init__(self) -> None:
        require(self.problems(), "CUDA graph settings")

    def problems(self) -> list[str]:
        """What Megatron-LM and megatron-core 0.16.1 refuse of these settings alone."""
        p = []
        deprecated = self.enable_cuda_graph or self.external_cuda_graph
        if deprecated and self.cuda_graph_impl != "none":
            p.append(
                "Megatron-LM stops: 'Do not use --enable-cuda-graph or --external-cuda-graph "
                "with --cuda-graph-impl': give --cuda-graph-impl only"
            )
        if self.enable_cuda_graph and self.external_cuda_graph:
            p.append(
                "Megatron-LM stops: '--enable-cuda-graph and --external-cuda-graph cannot be "
                "enabled at the same time': give one --cuda-graph-impl"
            )
        scope = set(self.cuda_graph_scope)
        if "full" in scope and len(self.cuda_graph_scope) > 1:
            p.append(
                "Megatron-LM stops: 'full scope cannot be used with other scopes' (full, "
                "deprecated, means the whole layer): leave out --cuda-graph-scope for it"
            )
        if self.impl == "transformer_engine" and "full_iteration" in scope:
            p.append(
                "--cuda-graph-scope full_iteration needs --cuda-graph-impl local (megatron-core's "
                "TransformerConfig asserts it)"
            )
        if self.enabled and {"moe", "moe_router"} <= scope:
            p.append(
                "--cuda-graph-scope moe and moe_router together: megatron-core asserts 'must not "
                "contain both moe and moe_router'; give one of them"
            )
        local = self.impl == "local"
        if self.enabled and "moe_preprocess" in scope and "moe_router" not in scope and not local:
            p.append(
                "--cuda-graph-scope moe_preprocess needs moe_router (megatron-core asserts "
                "'moe_preprocess cuda graph is only supported with moe_router cuda graph')"
            )
        return p

    @property
    def impl(self) -> str:
        """The implementation Megatron-LM runs (the deprecated switches mapped)."""
        if self.enable_cuda_graph:
            return "local"
        if self.external_cuda_graph:
            return "transformer_engine"
        return self.cuda_graph_impl

    @property
    def enabled(self) -> bool:
        """Whether the run captures CUDA graphs."""
        return self.impl != "none"

    @property
    def scopes(self) -> frozenset[str]:
        """The scopes megatron-core graphs: empty for whole layers ('full' included); the local
        impl takes moe_router and moe_preprocess together (TransformerConfig adds the other)."""
        scope = set(self.cuda_graph_scope) - {"full"}
        if self.impl == "local" and scope & {"moe_router", "moe_preprocess"}:
            scope |= {"moe_router", "moe_preprocess"}
        return frozenset(scope)

    def graphs_layer(self, moe_layer: bool) -> bool:
        """Whether a transformer layer (an MoE layer when `moe_layer`) is captured
        (cuda_graphs._layer_is_graphable: every layer without a scope; with scopes, a layer
        with attention under attn, a dense one under mlp, an MoE one under moe / moe_router /
        moe_preprocess); never under full_iteration, whose one graph is the iteration."""
        scope = self.scopes
        if not self.enabled or "full_iteration" in scope:
            return False
        if not scope or "attn" in scope:
            return True
        if moe_layer:
            return bool(scope & {"moe", "moe_router", "moe_preprocess"})
        return "mlp" in scope

    def graphs_attention(self) -> bool:
        """Whether a captured layer's static inputs hold the causal mask (its graph holds the
        self-attention: no scope, or attn)."""
        return self.enabled and (not self.scopes or "attn" in self.scopes)


def static_input_bytes(
    seq: int, micro_batch: int, hidden: int, tp: int, cp: int, sp: bool, attention: bool
) -> int:
    """Bytes of one captured (layer, micro-batch) forward's static inputs
    (GraphableMegatronModule / TransformerLayer.get_layer_static_inputs): hidden states bf16
    [s/CP (/TP with SP), b, h]; with the attention in the graph, a causal mask bool
    [b, 1, s/CP, s]."""
    rows = seq // cp // (tp if sp else 1)
    total = 2 * rows * micro_batch * hidden
    if attention:
        total += micro_batch * (seq // cp) * seq
    return total
