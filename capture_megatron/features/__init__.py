"""One home per Megatron feature: each module declares the feature's flags (the fields of its
option dataclass, capture_megatron.fields), what it keeps in memory and what it costs in time, in
Megatron's and Transformer Engine's terms, from numbers (pure Python, below config: the objects
between stages hold these options). Its support rules are in the rule book
(capture_megatron.rules); where the GPU kernel set emulates it on fake CUDA tensors, in
capture_megatron.emulate.gpu.

- fp8: Transformer Engine's FP8 tensors (recipes, scales, weight caches, scaling state);
- moe: mixture-of-experts layers (Experts: counts, routing, dispatcher, grouped GEMM);
- dispatch: the flex token dispatcher (DeepEP / HybridEP) and its communication buffers;
- mla: multi-latent attention (LatentAttention);
- recompute: activation recomputation (granularity, method, --recompute-modules);
- activation_offload: fine-grained activation offloading (--offload-modules);
- optimizer_offload: optimizer CPU offloading (HybridDeviceOptimizer);
- optimizers: the optimizers besides Adam (--optimizer sgd / muon / dist_muon);
- fsdp: Megatron-FSDP (--use-megatron-fsdp, --data-parallel-sharding-strategy);
- tp_overlap: TP communication overlap's userbuffers (--tp-comm-overlap);
- delay_wgrad: --delay-wgrad-compute's queued weight-gradient inputs (with the EP overlap);
- cuda_graphs: CUDA graphs (--cuda-graph-impl, --cuda-graph-scope): rules and static buffers.

docs/ARCHITECTURE.md ("How to add a Megatron feature") has a worked example.
"""
