"""Gradient buffers and optimizer state: their precision, buckets and sharding (DdpOptions), with
Megatron-LM's flags, defaults and rules (core_v0.16.1: megatron/training/arguments.py
validate_args, training.py get_model; megatron-core's DistributedDataParallelConfig and
OptimizerConfig). Pure Python: no torch import here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from capture_megatron.errors import require
from capture_megatron.features.activation_offload import ActivationOffload
from capture_megatron.features.cuda_graphs import CudaGraphs
from capture_megatron.features.fsdp import DEFAULT_FSDP, Fsdp
from capture_megatron.features.optimizer_offload import offload_problems
from capture_megatron.features.optimizers import DEFAULT_OPTIMIZER, Optimizer
from capture_megatron.fields import flag
from capture_megatron.serial import OMIT_DEFAULT, CachedHash, JsonMixin

MAIN_GRADS_DTYPES = ("fp32", "bf16")
"""Megatron-LM's --main-grads-dtype choices."""
MAIN_PARAMS_DTYPES = ("fp32", "fp16")
"""Megatron-LM's --main-params-dtype choices."""
STATE_DTYPES = ("fp32", "fp16", "bf16", "fp8")
"""Megatron-LM's --exp-avg-dtype / --exp-avg-sq-dtype choices (fp8: TE's Float8Tensor, 1 byte)."""
STATE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
"""Bytes per element of an optimizer-state dtype."""


@dataclass(frozen=True)
class DdpOptions(CachedHash, JsonMixin):
    """Gradient buffers and optimizer state: precision, buckets, distributed-optimizer instances;
    deferred output-layer weight gradients; the EP all-to-all overlap's combined schedule
    (Megatron flags)."""

    __hash__ = CachedHash.cached_hash  # a key of the planner's memos (steptime.parts)

    overlap_grad_reduce: bool = flag("--overlap-grad-reduce", False)
    """Overlap DP gradient reduce-scatter/all-reduce with backward (the first pipeline stage's
    first chunk then splits its gradient buffer into buckets)."""
    grad_reduce_in_bf16: bool = flag("--grad-reduce-in-bf16", False)
    """bf16 training: keep and reduce gradients in bf16 buffers instead of fp32."""
    accumulate_allreduce_grads_in_fp32: bool = flag("--accumulate-allreduce-grads-in-fp32", False)
    """Keep and reduce gradients in fp32 buffers (set by Megatron-LM for bf16 unless
    --grad-reduce-in-bf16 or --main-grads-dtype bf16; fp16 runs keep fp16 buffers without it)."""
    use_precision_aware_optimizer: bool = flag("--use-precision-aware-optimizer", False)
    """Transformer Engine's FusedAdam keeps the master weights and Adam moments in the dtypes
    below and reads the gradients from the buffers as they are (needs the distributed
    optimizer)."""
    main_grads_dtype: str = flag("--main-grads-dtype", "fp32", choices=MAIN_GRADS_DTYPES)
    """Precision-aware optimizer: dtype of the main gradients (bf16 training: bf16 buffers)."""
    main_params_dtype: str = flag("--main-params-dtype", "fp32", choices=MAIN_PARAMS_DTYPES)
    """Precision-aware optimizer: dtype of the master weights (fp32 with bf16 parameters keeps
    only their 16 trailing bits, TE's store_param_remainders)."""
    exp_avg_dtype: str = flag("--exp-avg-dtype", "fp32", choices=STATE_DTYPES)
    """Precision-aware optimizer: dtype of Adam's first moment."""
    exp_avg_sq_dtype: str = flag("--exp-avg-sq-dtype", "fp32", choices=STATE_DTYPES)
    """Precision-aware optimizer: dtype of Adam's second moment."""
    num_distributed_optimizer_instances: int = flag("--num-distributed-optimizer-instances", 1)
    """Distributed-optimizer copies across the data-parallel ranks: each shards the optimizer
    state over DP x CP / this many ranks (gradients all-reduced between the copies)."""
    ddp_bucket_size: int | None = flag("--ddp-bucket-size", None)
    """Elements per gradient bucket with --overlap-grad-reduce (default max(4e7, 1e6 x DP x
    CP))."""
    ddp_num_buckets: int | None = flag("--ddp-num-buckets", None)
    """Gradient buckets with --overlap-grad-reduce: the bucket size is the rank's parameters
    divided by this."""
    ddp_pad_buckets_for_high_nccl_busbw: bool = flag("--ddp-pad-buckets-for-high-nccl-busbw", False)
    """Distributed optimizer: pad every bucket to a multiple of lcm(DP, 128, 2^16) elements."""
    defer_embedding_wgrad_compute: bool = flag("--defer-embedding-wgrad-compute", False)
    """The last pipeline stage keeps the output layer's inputs and output gradients and computes
    its weight gradient after the schedule's last backward (needs PP > 1 and gradient-accumulation
    fusion)."""
    wgrad_deferral_limit: int = flag("--wgrad-deferral-limit", 0)
    """Micro-batches whose output-layer weight gradient is deferred (0: all of them)."""
    activation_offload: ActivationOffload = ActivationOffload()
    """Fine-grained activation offloading (its own flags, config.act_offload)."""
    cuda_graphs: CudaGraphs = dataclasses.field(default=CudaGraphs(), metadata={OMIT_DEFAULT: True})
    """CUDA graphs (their own flags, capture_megatron.features.cuda_graphs): the static buffers
    the captured graphs keep, a run setting carried with the plan."""
    overlap_moe_expert_parallel_comm: bool = flag("--overlap-moe-expert-parallel-comm", False)
    """Hide the MoE token all-to-alls behind the computation of another micro-batch:
    megatron-core's combined 1F1B schedule runs micro-batch i + 1's forward layer by layer with
    micro-batch i's backward (capture_megatron.forecast.overlap); a schedule setting, carried with
    the plan's other training settings."""
    delay_wgrad_compute: bool = flag("--delay-wgrad-compute", False, omit_default=True)
    """With --overlap-moe-expert-parallel-comm: Transformer Engine's layers compute only input
    gradients in a layer node's backward and their weight gradients in the node's backward_dw,
    holding each node's weight-gradient inputs between the two
    (capture_megatron.features.delay_wgrad)."""
    optimizer_cpu_offload: bool = flag("--optimizer-cpu-offload", False, omit_default=True)
    """megatron-core's HybridDeviceOptimizer: the Adam update of whole parameter slices, up to
    --optimizer-offload-fraction of this rank's elements, runs on the host with their fp32 master
    weights, moments and gradients in host memory (needs --use-precision-aware-optimizer)."""
    optimizer_offload_fraction: float = flag("--optimizer-offload-fraction", 1.0, omit_default=True)
    """With --optimizer-cpu-offload: the fraction of the rank's optimizer elements updated on the
    host (Megatron-LM's default 1.0: all of them). `plan` searches it unless offload or a fraction
    other than 1 is given (0: no offload)."""
    overlap_cpu_optimizer_d2h_h2d: bool = flag(
        "--overlap-cpu-optimizer-d2h-h2d", False, omit_default=True
    )
    """With --optimizer-cpu-offload: one host optimizer per parameter slice, its gradient copy
    and parameter copy-back on their own CUDA streams (time only; the same tensors)."""
    use_torch_optimizer_for_cpu_offload: bool = flag(
        "--use-torch-optimizer-for-cpu-offload", False, omit_default=True
    )
    """With --optimizer-cpu-offload: megatron-core 0.16.1 picks the device optimizer class again
    for Adam right after reading it (optimizer/__init__.py), so it changes nothing."""
    pin_cpu_grads: bool = flag("--no-pin-cpu-grads", True, negate=True, omit_default=True)
    """With --optimizer-cpu-offload: the host gradient copies in pinned memory (host bytes the
    same either way)."""
    pin_cpu_params: bool = flag("--no-pin-cpu-params", True, negate=True, omit_default=True)
    """With --optimizer-cpu-offload: stored by HybridDeviceOptimizer and never read in 0.16.1
    (its host parameter copies are pinned either way)."""
    optimizer: Optimizer = field(default=DEFAULT_OPTIMIZER, metadata={OMIT_DEFAULT: True})
    """The optimizer (its own flags: --optimizer, --sgd-momentum, --muon-*;
    capture_megatron.features.optimizers): Adam unless given."""
    fsdp: Fsdp = field(default=DEFAULT_FSDP, metadata={OMIT_DEFAULT: True})
    """Megatron-FSDP (its own flags: --use-megatron-fsdp, --data-parallel-sharding-strategy, ...;
    capture_megatron.features.fsdp): off unless given."""

    def __post_init__(self) -> None:
        require(self._problems(), "gradient and optimizer-state settings")

    def _problems(self) -> list[str]:
        p = []
        lowered = [
            f"--{name.replace('_', '-')} {getattr(self, name)}"
            for name in (
                "main_grads_dtype",
                "main_params_dtype",
                "exp_avg_dtype",
                "exp_avg_sq_dtype",
            )
            if getattr(self, name) != "fp32"
        ]
        if lowered and not self.use_precision_aware_optimizer:
            p.append(
                f"{', '.join(lowered)} needs --use-precision-aware-optimizer (megatron-core's "
                "OptimizerConfig keeps them fp32 otherwise)"
            )
        if self.accumulate_allreduce_grads_in_fp32 and self.main_grads_dtype != "fp32":
            p.append(
                "--main-grads-dtype can only be fp32 when --accumulate-allreduce-grads-in-fp32 "
                "is set (Megatron-LM)"
            )
        if self.ddp_bucket_size is not None and self.ddp_num_buckets is not None:
            p.append("cannot specify both --ddp-num-buckets and --ddp-bucket-size (Megatron-LM)")
        if self.ddp_num_buckets is not None and self.ddp_num_buckets <= 0:
            p.append(f"--ddp-num-buckets {self.ddp_num_buckets} must be greater than 0")
        if self.ddp_bucket_size is not None and self.ddp_bucket_size <= 0:
            p.append(f"--ddp-bucket-size {self.ddp_bucket_size} must be greater than 0")
        if self.wgrad_deferral_limit < 0:
            p.append(f"--wgrad-deferral-limit {self.wgrad_deferral_limit} must be >= 0")
        if self.num_distributed_optimizer_instances < 1:
            n = self.num_distributed_optimizer_instances
            p.append(f"--num-distributed-optimizer-instances {n} must be at least 1")
        return p + offload_problems(self)

    def grad_dtype(self, dtype: str) -> str:
        """The gradient buffers' dtype when training in `dtype` (Megatron-LM's validate_args:
        bf16 accumulates in fp32 unless --grad-reduce-in-bf16 or --main-grads-dtype bf16; fp16
        only with --accumulate-allreduce-grads-in-fp32; fp32 always)."""
        if dtype == "fp32":
            return "fp32"
        if dtype == "bf16":
            if self.grad_reduce_in_bf16:
                return "bf16"
            fp32 = self.accumulate_allreduce_grads_in_fp32 or self.main_grads_dtype == "fp32"
            return "fp32" if fp32 else "bf16"
        return "fp32" if self.accumulate_allreduce_grads_in_fp32 else dtype

    def plan_problems(
        self, pp: int, vpp: int, dp_cp: int, expert_dp: int, distributed_optimizer: bool
    ) -> list[str]:
        """What megatron-core refuses (or capture-megatron does not model) in these settings for a
        plan of `pp` stages of `vpp` chunks, `dp_cp` data x context-parallel ranks, `expert_dp`
        expert-data-parallel ranks and the distributed optimizer or not (empty: nothing)."""
        p = []
        if self.defer_embedding_wgrad_compute and pp == 1:
            p.append(
                "--defer-embedding-wgrad-compute needs pipeline parallelism (megatron-core's "
                "ModelParallelConfig)"
            )
        if self.use_precision_aware_optimizer and not distributed_optimizer:
            p.append(
                "--use-precision-aware-optimizer needs --use-distributed-optimizer "
                "(megatron-core's OptimizerConfig)"
            )
        n = self.num_distributed_optimizer_instances
        if n > 1 and not distributed_optimizer:
            p.append(f"--num-distributed-optimizer-instances {n} needs --use-distributed-optimizer")
        if n > 1 and (dp_cp % n or expert_dp % n):
            p.append(
                f"--num-distributed-optimizer-instances {n} does not divide the {dp_cp} data x "
                f"context-parallel ranks (and the {expert_dp} expert-data-parallel ranks)"
            )
        p += self._overlap_pp_problems(pp, vpp)
        buckets = self.overlap_grad_reduce and distributed_optimizer
        if buckets and self.ddp_num_buckets is not None and vpp > 1:
            p.append(
                "--ddp-num-buckets with --overlap-grad-reduce, the distributed optimizer and "
                "virtual pipeline stages is not modelled yet (the first chunk's buckets are sized "
                "by every chunk's parameters); give --ddp-bucket-size"
            )
        return p

    def _overlap_pp_problems(self, pp: int, vpp: int) -> list[str]:
        """--overlap-moe-expert-parallel-comm over pipeline stages: megatron-core's rule
        (capture_megatron.config.overlap has the others)."""
        if not self.overlap_moe_expert_parallel_comm or pp == 1 or vpp > 1:
            return []
        return [
            f"--overlap-moe-expert-parallel-comm with PP {pp} needs virtual pipeline stages "
            "(megatron-core's TransformerConfig: 'If enabling EP A2A overlap, "
            "virtual_pipeline_model_parallel_size must be specified when "
            "pipeline_model_parallel_size > 1')"
        ]

    def bucket_size(self, dp_cp: int, rank_params: int) -> int | None:
        """DDP's bucket size as Megatron-LM's get_model sets it for a rank of `rank_params`
        parameters over `dp_cp` data x context-parallel ranks: --ddp-bucket-size, the parameters
        over --ddp-num-buckets, or max(4e7, 1e6 x DP x CP); None (one bucket) without
        --overlap-grad-reduce. megatron-core's DDP uses it on the first pipeline stage's first
        chunk only."""
        if not self.overlap_grad_reduce:
            return None
        if self.ddp_num_buckets is not None:
            return rank_params // self.ddp_num_buckets
        if self.ddp_bucket_size is not None:
            return self.ddp_bucket_size
        return max(40_000_000, 1_000_000 * dp_cp)

    def deferred(self, microbatches: int) -> int:
        """Micro-batches whose output-layer weight gradient the last stage defers."""
        if not self.defer_embedding_wgrad_compute:
            return 0
        limit = self.wgrad_deferral_limit
        return microbatches if limit == 0 else min(limit, microbatches)

    def shard_ranks(self, dp_cp: int) -> int:
        """The ranks one distributed-optimizer instance shards the state over."""
        return max(dp_cp // self.num_distributed_optimizer_instances, 1)


DEFAULT_DDP = DdpOptions()
"""Megatron-LM's defaults (fp32 gradients for bf16, no buckets, one optimizer instance)."""
