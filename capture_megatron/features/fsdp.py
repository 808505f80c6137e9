"""Megatron-FSDP (`--use-megatron-fsdp`, megatron-core 0.16.1 megatron/core/distributed/fsdp/): its
options, what each sharding strategy keeps whole or as a 1/R shard, and the rules megatron-core
and Megatron-LM apply to it. Pure Python: no torch import here. The bytes it makes of a chunk are
capture_megatron.forecast.fsdp's.

How megatron-core 0.16.1 lays a chunk out (FullyShardedDataParallel -> MegatronFSDP ->
megatron_fsdp/param_and_grad_buffer.py ParamAndGradBuffer), over R = the data x context-parallel
ranks (the expert-data-parallel ones for routed experts; with several optimizer instances, HSDP,
R is one instance's ranks):

- Parameters are grouped into buckets by (dtype, expert, FSDP unit): with optim_grads_params every
  TransformerLayer is a unit (its dense and its expert parameters one bucket each, gathered
  together); the other parameters (embedding, final norm, output layer, MTP's own) share the
  non-unit buckets, split at --ddp-bucket-size elements (max(4e7, 1e6 x R) with
  --overlap-grad-reduce, on the first model chunk; otherwise one bucket). Every bucket is padded
  to a multiple of R (of R x its parameters' row size, which this model leaves out).
- Per strategy (`_init_each_parameter_group_buffers`): the model weights (param dtype) are the
  module's own with no_shard, a whole buffer with optim and optim_grads, a 1/R shard with
  optim_grads_params; the fp32 main weights (preserve_fp32_weights, always on; fp32 training
  keeps a second fp32 copy) whole with no_shard, a shard otherwise; the gradients (fp32 unless
  --grad-reduce-in-bf16, Megatron-LM's accumulate_allreduce_grads_in_fp32) whole with no_shard and
  optim, a shard with optim_grads and optim_grads_params. The optimizer (Adam on the main-weight
  DTensors) keeps its two fp32 moments per main-weight element; with 16-bit gradients its
  `update_main_grads` makes an fp32 copy of each gradient shard, alive until the next zero_grad.
- Sharded gradients are accumulated per micro-batch in whole temporary buckets (fetched at the
  first gradient of a bucket, `_grad_acc`), reduce-scattered when the bucket (with
  optim_grads_params, the unit's buckets) is complete, and freed once the reduce-scatter queue
  holds more than the communication unit (--suggested-communication-unit-size, by default
  max(1e9, 2 x the average unit's elements)); the rest at the end of every backward.
- With optim_grads_params a unit's buckets are all-gathered whole before its forward and its
  backward (`_pre_forward_param_unshard`, `_pre_backward_param_unshard`), with the next units
  prefetched until the prefetched elements reach half the communication unit
  (`suggested_AG_prefetch_size`), and freed after it; the non-unit buckets, gathered at their
  module's forward, stay whole until the step (`finish_grad_sync`).
- --fsdp-double-buffer (forced by --use-nccl-ub) serves the units of the most common bucket
  layout from two persistent buffers each for weights and gradients (FixedPoolAllocator, size
  2), keeping at most two units gathered or accumulating; other units and the non-unit buckets
  are allocated as they come.
- --use-nccl-ub allocates the same buffers from an NCCL-registered torch.cuda.MemPool, which the
  caching allocator counts like any other (so the allocated peak is unchanged but for the double
  buffering it forces; the same for DDP's buffers without Megatron-FSDP).
"""

from __future__ import annotations

from dataclasses import dataclass

from capture_megatron.errors import require
from capture_megatron.fields import flag
from capture_megatron.serial import JsonMixin

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
"""Megatron-LM's --data-parallel-sharding-strategy choices."""
OUTER_STRATEGIES = ("no_shard", "optim")
"""Megatron-LM's --outer-dp-sharding-strategy choices."""
COMMUNICATION_UNIT = 1_000_000_000
"""megatron-core 0.16.1's floor of the communication unit in elements when
--suggested-communication-unit-size is not given (MegatronFSDP._init_fsdp_param_and_grad_buffer:
`max(1_000_000_000, suggested)`, commented 'Cap to 1B elements')."""


@dataclass(frozen=True)
class Fsdp(JsonMixin):
    """Megatron-FSDP's settings (Megatron flags): on or off, how it shards, its communication
    buffers."""

    use_megatron_fsdp: bool = flag("--use-megatron-fsdp", False, omit_default=True)
    """Wrap every model chunk in megatron-core's Megatron-FSDP instead of its DDP."""
    data_parallel_sharding_strategy: str = flag(
        "--data-parallel-sharding-strategy", "no_shard", choices=STRATEGIES, omit_default=True
    )
    """What Megatron-FSDP shards over the data-parallel ranks: no_shard (nothing), optim (the
    optimizer state and main weights), optim_grads (and the gradients), optim_grads_params (and
    the model weights, gathered per transformer layer)."""
    outer_dp_sharding_strategy: str = flag(
        "--outer-dp-sharding-strategy", "no_shard", choices=OUTER_STRATEGIES, omit_default=True
    )
    """With several distributed-optimizer instances (hybrid sharding): optim also shards the
    optimizer state and main weights across the instances."""
    fsdp_double_buffer: bool = flag("--fsdp-double-buffer", False, omit_default=True)
    """Two persistent buffers each for the gathered weights and the gradients of the transformer
    layers (optim_grads_params), instead of allocating them per layer."""
    suggested_communication_unit_size: int | None = flag(
        "--suggested-communication-unit-size", None, omit_default=True
    )
    """Elements the reduce-scatter queue holds before freeing a gradient bucket; half of it is
    how far the all-gathers prefetch (default: max(1e9, twice the average layer's elements))."""
    nccl_ub: bool = flag("--use-nccl-ub", False, omit_default=True)
    """Allocate the data-parallel buffers from an NCCL-registered memory pool (the same bytes;
    with Megatron-FSDP it turns on --fsdp-double-buffer)."""
    fsdp_manual_registration: bool = flag("--fsdp-manual-registration", False, omit_default=True)
    """Register the FSDP buffers with NCCL by hand (fewer registration calls; the same bytes)."""

    def __post_init__(self) -> None:
        p = [
            f"{flag} {value!r} is not one of {', '.join(allowed)}"
            for flag, value, allowed in (
                (
                    "--data-parallel-sharding-strategy",
                    self.data_parallel_sharding_strategy,
                    STRATEGIES,
                ),
                ("--outer-dp-sharding-strategy", self.outer_dp_sharding_strategy, OUTER_STRATEGIES),
            )
            if value not in allowed
        ]
        size = self.suggested_communication_unit_size
        if size is not None and size < 1:
            p.append(f"--suggested-communication-unit-size {size} must be at least 1")
        if self.fsdp_manual_registration and not (self.use_megatron_fsdp and self.nccl_ub):
            p.append(
                "--fsdp-manual-registration needs --use-megatron-fsdp and --use-nccl-ub "
                "(Megatron-LM asserts it)"
            )
        require(p, "Megatron-FSDP settings")

    @property
    def enabled(self) -> bool:
        """Megatron-FSDP wraps the model."""
        return self.use_megatron_fsdp

    @property
    def strategy(self) -> str:
        """The sharding strategy in effect."""
        return self.data_parallel_sharding_strategy

    @property
    def units(self) -> bool:
        """Transformer layers are FSDP units (their weights gathered per layer)."""
        return self.enabled and self.strategy == "optim_grads_params"

    @property
    def double_buffer(self) -> bool:
        """The units' weights and gradients live in two persistent buffers (--fsdp-double-buffer
        or --use-nccl-ub; megatron-core uses them only when there are units)."""
        return self.units and (self.fsdp_double_buffer or self.nccl_ub)

    def sharded(self) -> tuple[bool, bool, bool]:
        """(model weights, main weights and optimizer state, gradients) kept as 1/R shards."""
        s = self.strategy
        return (
            s == "optim_grads_params",
            s != "no_shard",
            s in ("optim_grads", "optim_grads_params"),
        )

    def communication_unit(self, average_unit: int, bucket_size: int | None) -> int:
        """Elements of the communication unit (the reduce-scatter queue's capacity; the
        all-gathers prefetch half of it): --suggested-communication-unit-size, else
        megatron-core's default from the average unit's elements (optim_grads_params) or the
        bucket size, at least COMMUNICATION_UNIT."""
        if self.suggested_communication_unit_size is not None:
            return self.suggested_communication_unit_size
        if self.units:
            return max(COMMUNICATION_UNIT, 2 * average_unit)
        return max(COMMUNICATION_UNIT, bucket_size or COMMUNICATION_UNIT)


DEFAULT_FSDP = Fsdp()
"""Megatron-LM's default: no Megatron-FSDP."""
