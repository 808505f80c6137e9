"""capture-megatron's verdict on the pretrain_gpt.py arguments Megatron-LM added between
core_v0.16.1 and core_v0.19.0 (megatron_args-0.19.json) that neither policy's prefixes nor its
sets already classify. Merged into capture_megatron.rules.flags (IGNORED and UNMODELLED), so
that a 0.19 command line is read by the same rules. Pure Python.

Where a flag's effect on memory was not traced through megatron-core 0.19's code it is refused
when given at a value other than Megatron-LM's default (UNMODELLED), never silently ignored.
"""

from __future__ import annotations

IGNORED_0_19 = frozenset(
    """
    --high-priority-a2a-comm-stream --lion-beta1 --lion-beta2
    --pytorch-profiler-collect-shapes --pytorch-profiler-collect-callstack
    --pytorch-profiler-collect-chakra --record-shapes --nvtx-ranges --gpu-sniff-test-interval
    --verify-integrity --no-stream-ckpt-dequant --override-ckpt-iteration
    --flight-recorder-dump-path --flight-recorder-trace-buffer-size
    --no-flight-recorder-dump-on-timeout --flight-recorder-include-stack-trace
    --no-flight-recorder-include-only-active --no-flight-recorder-extra-dump-on-exec
    --start-eval-at-iter --validation-set-names
    --no-tokenizer-sentencepiece-ignore-extra-whitespaces --null-tokenizer-eod-id
    --null-tokenizer-pad-id --chat-template --num-speculative-tokens
    --use-same-sampling-seed-across-dp-ranks --mamba-inference-conv-states-dtype
    --mamba-inference-ssm-states-dtype --enable-msc
    --fault-injector-ranks --fault-injector-num-ranks --fault-injector-fault-types
    --fault-injector-fault-probabilities --fault-injector-fault-delay
    --fault-injector-delay-start-iteration --fault-injector-mtti-seconds
    --fault-injector-offset-seconds --fault-injector-seed
    --yarn-original-max-position-embeddings --yarn-beta-fast --yarn-beta-slow
    --yarn-correction-range-round-to-int --no-yarn-correction-range-round-to-int
    --cpu-offloading-retain-pinned-cpu-buffers
""".split()
)
"""New flags that cannot change the training peak of allocated bytes: stream priorities, the
Lion optimizer's betas (values, not tensors; --optimizer lion itself is not an option here),
profiling, flight recorder and fault injection, checkpoint checks, evaluation, tokenizer and
inference settings, YaRN's frequency constants (scalars of the rotary table), and the host
buffers of layer-level CPU offloading (refused itself)."""

_ARCH = "this architecture change is not modelled yet"
_KERNEL = "this kernel choice keeps different tensors, not modelled yet"
_OFFLOAD = "this activation-offloading setting (megatron-core 0.19) is not modelled yet"

_REASONS_0_19 = {
    _ARCH: """
        --mtp-use-repeated-layer --mtp-detach-heads --mtp-hybrid-override-pattern
        --dsa-indexer-topk-freq --dsa-indexer-skip-topk-offset --dsa-kernel-backend
        --dsa-indexer-rope-interleaved --no-dsa-indexer-rotate-activation
        --no-dsa-indexer-scoring-relu --dsa-indexer-k-norm-epsilon --dsa-indexer-k-norm-fp32
        --hybrid-layer-pattern --mamba-training-ssm-states-dtype
    """,
    "muP's scaled embeddings and logits are not modelled yet": """
        --use-mup --mup-width-mult --mup-base-hidden-size --mup-embedding-mult
        --mup-output-mult --mup-base-head-dim --mup-attn-scale-power
    """,
    "weight sharding over tensor-parallel ranks is not modelled yet": """
        --tensor-parallel-num-weight-shards --expert-tensor-parallel-num-weight-shards
    """,
    (
        "overlapping the dispatch's backward with the experts' weight gradients keeps their "
        "inputs longer, not modelled yet"
    ): """
        --overlap-dispatch-backward-with-experts-wgrad
    """,
    _KERNEL: """
        --flash-attention-version --fused-residual-rmsnorm --use-transformer-engine-op-fuser
        --use-grouped-gemm-for-shared-expert --use-grouped-gemm-for-dense-mlp
        --mlp-chunks-for-training --mla-down-proj-fusion
    """,
    "this low-precision (fp8 / fp4) option is not modelled yet": """
        --fp8-output-proj
    """,
    _OFFLOAD: """
        --delay-offload-until-cuda-graph --delta-offload-bytes-across-pp-ranks
        --activation-offload-fraction --fine-grained-offloading-max-inflight-offloads
    """,
    "Megatron-FSDP's main-parameter, gradient and buffer options (0.19) are not modelled yet": """
        --megatron-fsdp-main-params-dtype --megatron-fsdp-main-grads-dtype
        --megatron-fsdp-grad-comm-dtype --megatron-fsdp-enable-fine-grained-param-gather
        --megatron-fsdp-max-pool-double-buffer --fsdp-db-use-persist-buf-on-alloc-fail
    """,
    "CUDA graphs keep their own static buffers, not modelled yet": """
        --optimizer-cuda-graph --cuda-graph-modules
    """,
    "a batch-size schedule is not modelled yet (give --global-batch-size)": """
        --step-batch-size-schedule
    """,
    "frozen parameters (no gradients or optimizer state) are not modelled yet": """
        --freeze-all-layers
    """,
    "fp32 local gradient accumulation of chosen parameters is not modelled yet": """
        --ddp-param-name-patterns-for-fp32-local-accumulation
    """,
    "the layer-wise optimizers' parameter layout is not modelled yet": """
        --no-use-layer-wise-param-layout
    """,
    "an unpadded vocabulary is not modelled yet (give --vocab-size)": """
        --no-pad-vocab-size
    """,
    "saving or distilling from logits keeps extra logits tensors, not modelled yet": """
        --logits-save-top-k --logits-save-top-p --logits-save-top-p-min-k --logits-save-dir
        --logits-save-dtype --logits-load-dir --logits-load-decode-threads
        --logits-load-prefetch-factor --logits-load-msc-prefetch-depth
        --logits-load-kd-loss-alpha --logits-load-ignore-errors
    """,
}

UNMODELLED_0_19: dict[str, str] = {
    flag: reason for reason, flags in _REASONS_0_19.items() for flag in flags.split()
}
"""New flags that change memory in ways not modelled: refused when not at Megatron-LM's
default."""
