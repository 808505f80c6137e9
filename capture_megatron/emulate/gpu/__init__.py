"""The GPU kernel set on fake CUDA tensors: modules that keep what the GPU's kernels keep.

On the fake-cuda device (capture_megatron.emulate.fake_cuda) megatron-core's own code runs on fake
CUDA tensors, so every torch op already follows CUDA's dispatch. What has no kernel on this
machine — Megatron's fused softmax (a CUDA extension), Transformer Engine's fused RoPE and its
attention backends — is replaced here by modules that allocate and keep, tensor by tensor, what
the real kernel allocates and keeps (sources cited in each module and in docs/MEMORY_MODEL.md).
Each one computes the real result on real tensors (tests check it against the plain torch path)
and only allocates on fake tensors.

- softmax: the `scaled_*_softmax_cuda` extensions of Megatron's FusedScaleMaskSoftmax.
- rope: Transformer Engine's fused RoPE (FusedRoPEFunc).
- attention: flash / cuDNN-fused attention and TE's unfused attention, per --attention-backend.
- cp: TE's ring (p2p) context-parallel attention around the flash / fused kernels.
- grouped: TE's GroupedLinear, the experts of --moe-grouped-gemm (megatron's TEGroupedMLP).
- flex: DeepEP's HybridEP (--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend
  hybridep): what its dispatch and combine return and keep; its own buffers are counted outside.
- deepep: DeepEP's Buffer (--moe-flex-dispatcher-backend deepep): what its layout, dispatch and
  combine return and keep, at the routing forecast; its buffers are counted outside.
- install: puts them where megatron-core looks for the real ones.
"""
