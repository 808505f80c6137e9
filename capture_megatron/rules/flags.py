"""What capture-megatron does with each of Megatron-LM's pretrain_gpt.py arguments (core_v0.16.1,
megatron_args.json) that none of its own option classes declares, keyed by the flag's first
spelling. Pure Python.

- IGNORED: cannot change a rank's peak of allocated bytes during training iterations (logging,
  paths, data, tokenizer, learning-rate schedules, checkpointing, evaluation, fault tolerance,
  inference-only and RL-only settings, kernels that keep the same tensors). Accepted and ignored.
  `--rampup-batch-size` is here too: the ramp only lowers the micro-batches per step, and the
  micro-batches a pipeline rank holds, min(pp - rank, micro-batches), never fall as they grow, so
  the run's peak is the one at the full --global-batch-size that is predicted.
  IGNORED_REASONS gives the reason of those whose kind does not say it (checked against
  megatron-core 0.16.1's code); RULES are ignored only where the rest of the line allows it
  (--no-position-embedding with RoPE, say), and refused or an error elsewhere.
- UNMODELLED: changes memory in a way the model does not cover yet; refused, with the reason, when
  given with a value other than Megatron-LM's default.
Routing details that choose which experts get tokens but not how many a forecast allows for
(group-limited routing, top-k scaling, the expert-bias update rate -- its bias is E floats per
layer --, the drop policy, logging) are IGNORED.
Every argument is in exactly one of: our option classes, IGNORED, UNMODELLED
(tests/unit/test_megatron_policy.py checks the table is complete).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from capture_megatron.rules import megatron as offload_rules
from capture_megatron.rules.flags_0_19 import IGNORED_0_19, UNMODELLED_0_19

IGNORED_PREFIXES = tuple(
    """
    --log- --tensorboard --wandb- --timing-log --one-logger --app-tag --inprocess- --ft-
    --straggler --rerun --error-injection --profile --eval- --fim- --tokenizer- --tiktoken-
    --data- --dataloader- --ckpt- --dist-ckpt --non-persistent --save- --load- --lr- --grpo-
    --rl- --langrl- --inference- --dino- --biencoder- --ict- --retriever- --indexer- --vision-
    --swin- --img- --muon- --replication --async- --exit- --manual-gc
    --tp-comm-overlap-rs --no-tp-comm --disable-straggler --no-manual-gc --no-ckpt- --no-log-
    --distributed-timeout --train- --valid- --test- --per-split --per-dataset --mid-level
    --object-storage --sft- --decode- --weight-decay-incr --start-weight
    --end-weight --min-loss --loss-scale --hysteresis
""".split()
)
"""Flags with these prefixes are IGNORED (unless UNMODELLED)."""

IGNORED = (
    frozenset(
        """
    --rampup-batch-size
    --adlr-autoresume --adlr-autoresume-interval
    --allow-ambiguous-pad-tokens --apply-layernorm-1p --apply-residual-connection-post-layernorm
    --apply-wd-to-qk-layernorm --auto-detect-ckpt-format --batch-invariant-mode
    --bert-embedder-type --bert-load --bert-no-binary-head --block-data-path --calc-ft-timeouts
    --calculate-per-token-loss --check-for-large-grads --check-for-spiky-loss
    --check-weight-hash-across-dp-replicas-interval --ckpt-convert-format --ckpt-convert-save
    --ckpt-convert-update-legacy-dist-opt-format --classes-fraction
    --config-logger-dir --create-all-gather-group --data-parallel-random-init
    --data-per-class-fraction --dataloader-type --ddp-average-in-collective --decoder-seq-length
    --decoupled-lr --decoupled-min-lr --decrease-batch-size-if-needed
    --disable-bf16-reduced-precision-matmul --disable-chunked-prefill
    --disable-gloo-process-groups --disable-mamba-mem-eff-path --disable-msc
    --distrib-optim-fully-reshardable-mem-efficient --dump-param-to-param-group-map
    --embedding-init-method-std --embedding-path --empty-unused-memory-level
    --enable-chunked-prefill --enable-ft-package --ep-overlap-early-attn-memory-release
    --evidence-data-path --fake-process-group --first-last-layers-bf16 --flash-decode
    --fp4-param-gather --full-validation --glu-linear-offset --head-lr-mult
    --high-priority-stream-groups --ict-load --inference-fuse-tp-communication
    --inference-rng-tracker --init-method-xavier-uniform --init-model-with-meta-device
    --iter-per-epoch --iterations-to-skip --lazy-mpu-init --legacy-tokenizer --local-rank
    --logging-level --mask-factor --mask-prob --mask-type --max-tokens-to-oom
    --memory-snapshot-path --merge-file --mlp-chunks-for-prefill
    --mock-data --multiple-validation-sets --nccl-all-reduce-for-prefill
    --nccl-communicator-config-path --no-align-grad-reduce --no-align-param-gather
    --no-async-tensor-model-parallel-allreduce --no-barrier-with-level-1-timing
    --no-check-for-nan-in-loss-and-grad
    --no-data-sharding --no-gradient-reduce-div-fusion --no-initialization --no-mmap-bin-files
    --no-one-logger --no-overlap-p2p-communication --no-persist-layer-norm
    --no-save-optim --no-save-rng --no-scatter-gather-tensors-in-pipeline
    --no-strict-fsdp-dtensor-load --no-use-tokenizer-model-from-checkpoint-args
    --no-weight-decay-cond-type --num-channels --num-classes --num-dataset-builder-threads
    --num-layers-at-end-in-bf16 --num-layers-at-start-in-bf16 --num-workers --onnx-safe
    --openai-gelu --output-bert-embeddings --overlap-p2p-communication-warmup-flush
    --overlap-param-gather-with-optimizer-step --patch-dim
    --phase-transition-iterations --pipeline-model-parallel-comm-backend --pretrained-checkpoint
    --query-in-block-prob --record-memory-history --refit-method --reset-attention-mask
    --reset-position-ids --result-rejected-tracker-filename
    --rotary-interleaved --rotary-seq-len-interpolation-factor --run-workload-inspector-server
    --sample-rate --sft --sharp-enabled-group --short-seq-prob --skip-train
    --split --te-rng-tracker --test-mode --titles-data-path
    --torch-fsdp2-no-reshard-after-forward --tp-comm-bootstrap-backend
    --train-samples --train-sync-interval --trust-remote-code --use-checkpoint-args
    --use-cpu-initialization --use-dist-ckpt
    --use-legacy-static-engine --use-mcore-models --use-mp-args-from-checkpoint-args
    --use-one-sent-docs --use-persistent-ckpt-worker --use-pytorch-profiler
    --use-ring-exchange-p2p --use-sharp --use-tp-pp-dp-mapping --vocab-file
    --warmup
    --moe-router-topk-scaling-factor
    --moe-router-bias-update-rate --moe-token-drop-policy --moe-per-layer-logging
    --moe-router-enable-expert-bias
    --cache-mla-latents --mtp-loss-scaling-factor
    --fp8-amax-compute-algo --fp8-margin --fp8-interval --no-fp8-wgrad --keep-fp8-transpose-cache
""".split()
    )
    | IGNORED_0_19
)
"""Flags that cannot change the peak of allocated bytes in training iterations. The FP8 ones:
--fp8-amax-compute-algo (max or most recent over the same amax history), --fp8-margin and
--fp8-interval (values of the scale, not tensors), --no-fp8-wgrad (Megatron passes it as the
recipe's override_linear_precision, which Transformer Engine 5671fd36's modules never read),
--keep-fp8-transpose-cache (only FP8 parameters under Megatron-FSDP have a transpose cache to
keep, and --fp8-param-gather with --use-megatron-fsdp is refused)."""

_IGNORED_BECAUSE = {
    (
        "read only by Megatron's legacy models (megatron/legacy/model/transformer.py), which "
        "--use-legacy-models selects (refused); megatron-core's models choose their attention "
        "kernel with --attention-backend"
    ): "--use-flash-attn",
    (
        "megatron-core 0.16.1 declares no experimental function or class; the flag only swaps "
        "the MoE dispatchers' routing-map padding and multi-hot conversion for fused kernels "
        "when --moe-permute-fusion is given, which is ruled on by its own entry"
    ): "--enable-experimental",
    (
        "inference only: megatron-core's CUDA graphs of decode-only steps (inference engines), "
        "never in training"
    ): "--decode-only-cuda-graphs",
    (
        "nothing in megatron-core 0.16.1 reads it (a field left in ModelParallelConfig)"
    ): "--moe-extended-tp",
    (
        "the streaming multiprocessors HybridEP's dispatch and combine kernels run on "
        "(num_sms_dispatch_api / num_sms_combine_api); DeepEP hybrid-ep eb9cee7 sizes its "
        "buffers and the tensors it returns by tokens, hidden size, experts and ranks only "
        "(hybrid_ep.cu allocate_buffer, executor.cu)"
    ): "--moe-hybridep-num-sms",
    (
        "only chooses how --use-nccl-ub registers its buffers with NCCL (symmetric windows or "
        "not; param_and_grad_buffer.py): the same buffers, the same bytes"
    ): "--disable-symmetric-registration",
    (
        "Megatron-FSDP's gradient scaling fused into the reduce as a ReduceOp, or done in "
        "place (`mul_`) without it: no tensor either way (gradient_reduce_preprocessing)"
    ): "--no-gradient-reduce-div-fusion",
    (
        "nothing in Megatron-LM core_v0.16.1 or megatron-core 0.16.1 reads it (hybrid sharding "
        "across optimizer instances is --outer-dp-sharding-strategy)"
    ): "--enable-full-sharding-in-hsdp",
    (
        "read only by torch FSDP2 (--use-torch-fsdp2, refused); Megatron-LM's DDP and "
        "Megatron-FSDP never read it"
    ): "--torch-fsdp2-no-reshard-after-forward",
}
IGNORED_REASONS: dict[str, str] = {flag: why for why, flag in _IGNORED_BECAUSE.items()}
"""Ignored flags whose reason is more than their kind (docs/MEGATRON_FLAGS.md lists it)."""

RULES = {
    "--no-position-embedding": (
        "ignored with --position-embedding-type rope: megatron-core's GPT embedding adds a "
        "position table only for learned_absolute and nothing in megatron-core reads "
        "add_position_embedding; without rope Megatron-LM stops ('--no-position-embedding is "
        "deprecated, use --position-embedding-type')"
    ),
    "--use-rotary-position-embeddings": (
        "ignored with --position-embedding-type rope, which it sets (deprecated); without it, "
        "refused: give --position-embedding-type rope"
    ),
}
"""Flags ignored only in the context stated (the rest of the command line decides); outside it
Megatron-LM stops, or the flag is refused. Applied by conditional_verdict."""


@dataclass(frozen=True)
class LineContext:
    """What the conditional rules read of the rest of a command line."""

    rope: bool
    """--position-embedding-type rope."""
    offload_modules: tuple[str, ...] = ()
    """--offload-modules (read with --fine-grained-activation-offloading)."""
    transformer_impl: str = "transformer_engine"
    """--transformer-impl."""
    cpu_offloading_layers: int = 0
    """--cpu-offloading-num-layers."""
    num_layers: int = 0
    """--num-layers (0: not given)."""
    pp: int = 1
    """--pipeline-model-parallel-size (1 when not given)."""
    recompute: str | None = None
    """--recompute-granularity (None or 'none': no recompute)."""


def conditional_verdict(flag: str, value: Any, line: LineContext) -> tuple[str, str] | None:
    """For a flag given with `value` on a line: None when no rule of the line applies (a flag of
    RULES is then ignored, any other keeps its own kind), else ('refused', why not modelled) or
    ('invalid', why Megatron-LM stops: the rules of RULES' flags and
    --fine-grained-activation-offloading's)."""
    if flag == "--no-position-embedding" and not line.rope:
        return "invalid", (
            "Megatron-LM stops: '--no-position-embedding is deprecated, use "
            "--position-embedding-type' (it is accepted only with --position-embedding-type rope)"
        )
    if flag == "--fine-grained-activation-offloading" and value:
        stops = offload_rules.megatron_stops(
            line.offload_modules, line.transformer_impl, line.cpu_offloading_layers
        )
        if stops:
            return "invalid", "Megatron-LM stops: " + "; ".join(stops)
    if flag == "--cpu-offloading-num-layers" and value:
        stops = offload_rules.layer_offload_stops(value, line.num_layers, line.pp, line.recompute)
        if stops:
            return "invalid", "Megatron-LM stops: " + "; ".join(stops)
    if flag == "--use-rotary-position-embeddings" and not line.rope:
        return "refused", "deprecated; give --position-embedding-type rope, which it means"
    return None


_MOE = "this mixture-of-experts option is not modelled yet"
_FP8 = "this low-precision (fp8 / fp4) option is not modelled yet"
_FSDP2 = (
    "PyTorch's FSDP2 (fully_shard per transformer layer, with megatron-core's non-distributed "
    "mixed-precision optimizer over its DTensor shards) is not modelled; Megatron-FSDP "
    "(--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params) is"
)
_OFFLOAD = (
    "layer-level CPU offloading (megatron-core's cpu_offload context over the first "
    "--cpu-offloading-num-layers layers' activations and weights) is not modelled yet"
)
_ARCH = "this architecture change is not modelled yet"
_KERNEL = "this kernel choice keeps different tensors, not modelled yet"

_REASONS = {
    "hierarchical context parallelism is not modelled yet": """
        --hierarchical-context-parallel-sizes
    """,
    "dynamic context parallelism is not modelled yet": """
        --max-seqlen-per-dp-cp-rank
    """,
    "hybrid context parallelism is not modelled yet": """
        --hybrid-context-parallel
    """,
    _MOE: """
        --moe-upcycling-granularity --moe-use-upcycling
    """,
    _FP8: """
        --fp4-format --fp4-param-gather --fp4-quantizer-factory --fp4-recipe
        --fp8-quantizer-factory --kitchen-attention-backend --reuse-grad-buf-for-mxfp8-param-ag
        --te-precision-config-file --use-kitchen-attention
    """,
    _FSDP2: """
        --use-torch-fsdp2
    """,
    _OFFLOAD: """
        --cpu-offloading-num-layers
    """,
    "a standalone multi-token-prediction stage is not modelled yet": """
        --mtp-standalone
    """,
    _ARCH: """
        --activation-func-clamp-value --attention-output-gate --decoder-num-layers
        --disable-mamba-mem-eff-path --dsa-indexer-head-dim --dsa-indexer-loss-coeff
        --dsa-indexer-n-heads --dsa-indexer-topk --dsa-indexer-use-sparse-loss
        --encoder-num-layers --experimental-attention-variant
        --heterogeneous-layers-config-encoded-json --heterogeneous-layers-config-path
        --hybrid-attention-ratio --hybrid-mlp-ratio --hybrid-override-pattern --is-hybrid-model
        --linear-attention-freq --linear-conv-kernel-dim --linear-key-head-dim
        --linear-num-key-heads --linear-num-value-heads --linear-value-head-dim --mamba-head-dim
        --mamba-num-groups --mamba-num-heads --mamba-state-dim --mrope-section
        --no-clone-scatter-output-in-embedding --no-rope-freq --qk-clip
        --qk-clip-alpha --qk-clip-threshold --quick-geglu
        --relative-attention-max-distance --relative-attention-num-buckets
        --rotary-percent --spec --squared-relu --use-fused-weighted-squared-relu
        --vocab-extra-ids --window-attn-skip-freq
    """,
    "symmetric-memory all-reduce buffers are not modelled yet": """
        --symmetric-ar-type
    """,
    "distributed saved activations are not modelled yet": """
        --distribute-saved-activations
    """,
    _KERNEL: """
        --ddp-reduce-scatter-with-fp32-accumulation --disable-jit-fuser
        --softmax-type --use-te-activation-func
    """,
    (
        "deprecated: give --moe-token-dispatcher-type flex, which it means (DeepEP is the flex "
        "dispatcher's default backend)"
    ): """
        --moe-enable-deepep
    """,
    "fp32 residual connections are not modelled yet": """
        --fp32-residual-connection
    """,
    "a padded vocabulary given directly is not modelled yet (give --vocab-size)": """
        --padded-vocab-size
    """,
    "give --seq-length": """
        --encoder-seq-length
    """,
    "give --micro-batch-size": """
        --batch-size
    """,
    "give --tensor-model-parallel-size": """
        --model-parallel-size
    """,
    "give --recompute-granularity / --recompute-method": """
        --checkpoint-activations
    """,
    "Megatron's legacy models are not modelled": """
        --use-legacy-models
    """,
    "RL training steps are not modelled": """
        --perform-rl-step
    """,
    "fp16 cross entropy is not modelled yet": """
        --fp16-lm-cross-entropy
    """,
    "a YAML config replaces the command line: give the flags": """
        --yaml-cfg
    """,
}

UNMODELLED: dict[str, str] = {
    flag: reason for reason, flags in _REASONS.items() for flag in flags.split()
} | UNMODELLED_0_19
"""Flags that change memory in ways not modelled: refused when not at Megatron-LM's default."""
UNMODELLED_PREFIXES = ("--moe-",)
"""Flags with these prefixes are UNMODELLED (mixture-of-experts options beyond those the Experts
class declares and those IGNORED)."""


def ignored(*spellings: str) -> bool:
    """Whether a Megatron-LM flag (any of its spellings) cannot change the training peak."""
    if unmodelled_reason(*spellings) is not None:
        return False
    named = IGNORED | set(IGNORED_REASONS) | set(RULES)
    return any(f in named or f.startswith(IGNORED_PREFIXES) for f in spellings)


def unmodelled_reason(*spellings: str) -> str | None:
    """Why a non-default value of a Megatron-LM flag (any of its spellings) is refused (None: it
    is not)."""
    for flag in spellings:
        if flag in UNMODELLED:
            return UNMODELLED[flag]
        explained = flag in IGNORED_REASONS or flag in RULES
        if flag.startswith(UNMODELLED_PREFIXES) and flag not in IGNORED and not explained:
            return _MOE
    return None
