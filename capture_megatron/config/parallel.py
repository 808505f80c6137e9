"""Parallel plans: ParallelPlan, Cluster, and ParallelFlags (the sizes a user fixed).

Frozen dataclasses validated at construction (a CaptureError naming every offending factor) and
round-tripped exactly through JSON. Pure Python: no torch import here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from capture_megatron.config.ddp import DdpOptions
from capture_megatron.config.layout import format_layout
from capture_megatron.config.model import GIB, ModelShape, tp_head_problems
from capture_megatron.errors import require
from capture_megatron.features.recompute import (
    RECOMPUTE_GRANULARITIES,
    RECOMPUTE_MODULES,
    Recompute,
)
from capture_megatron.fields import flag, value_problems
from capture_megatron.serial import CachedHash, JsonMixin

CP_COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")
"""Megatron's --cp-comm-type choices."""


@dataclass(frozen=True)
class ParallelPlan(CachedHash, JsonMixin):
    """How a model is split: parallel sizes, batch, the pipeline partition and memory savers."""

    __hash__ = CachedHash.cached_hash  # the planner keys its memos by candidates

    tp: int
    """Tensor-parallel size (--tensor-model-parallel-size)."""
    pp: int
    """Pipeline-parallel size (--pipeline-model-parallel-size)."""
    dp: int
    """Data-parallel size (world size / (tp * pp * cp))."""
    micro_batch_size: int
    """Sequences per micro-batch (--micro-batch-size)."""
    global_batch_size: int
    """Sequences per optimizer step (--global-batch-size)."""
    layers_per_stage: tuple[int, ...]
    """Transformer layers of each virtual stage in model order (pp * vpp entries); stage i sits on
    pipeline rank i % pp. The embedding is on stage 0, the output layer and loss on the last."""
    vpp: int = 1
    """Virtual pipeline stages (model chunks) per pipeline rank."""
    cp: int = 1
    """Context-parallel size (--context-parallel-size): each rank holds 1/cp of every
    sequence."""
    ep: int = 1
    """Expert-parallel size (--expert-model-parallel-size): the routed experts split over ep
    ranks."""
    etp: int = 0
    """Expert tensor-parallel size (--expert-tensor-parallel-size); 0 means the TP size, as
    Megatron's default."""
    cp_comm_type: str = ""
    """Context parallelism's attention communication (--cp-comm-type): p2p, a2a, allgather or
    a2a+p2p; empty when not given (Megatron-LM's p2p with Transformer Engine; the CPU kernel set
    all-gathers)."""
    recompute: Recompute = Recompute()
    """Activation recomputation per pipeline stage."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism over the TP group (--sequence-parallel)."""
    distributed_optimizer: bool = False
    """Shard optimizer state over DP (--use-distributed-optimizer)."""
    microbatch_group_size: int = 0
    """Interleaved schedule: micro-batches per virtual stage in a row; 0 means PP
    (--microbatch-group-size-per-virtual-pipeline-stage)."""
    mtp_layers: int = 0
    """Multi-token prediction layers (the model's --mtp-num-layers), all on the last virtual stage
    after its transformer layers, as Megatron places them ('m' in the layout)."""
    ddp: DdpOptions = DdpOptions()
    """Gradient buffers and optimizer state: precision, buckets, distributed-optimizer instances,
    deferred output-layer weight gradients."""

    def __post_init__(self) -> None:
        sizes = ("tp", "pp", "dp", "cp", "vpp", "ep", "micro_batch_size", "global_batch_size")
        require(value_problems(self, sizes, every_field=True), "parallel plan")  # e.g. tp 2.0
        p: list[str] = []
        for name in ("tp", "pp", "dp", "cp", "vpp", "micro_batch_size", "global_batch_size"):
            if getattr(self, name) < 1:
                p.append(f"{name} {getattr(self, name)} must be >= 1")
        if len(self.layers_per_stage) != self.pp * self.vpp:
            p.append(
                f"{len(self.layers_per_stage)} stage entries for pp {self.pp} x vpp {self.vpp}"
            )
        if any(n < 0 for n in self.layers_per_stage):
            p.append(f"negative layer count in {list(self.layers_per_stage)}")
        if (
            self.micro_batch_size >= 1
            and self.dp >= 1
            and self.global_batch_size % (self.micro_batch_size * self.dp)
        ):
            p.append(
                f"global batch {self.global_batch_size} not divisible by micro-batch "
                f"{self.micro_batch_size} x DP {self.dp}"
            )
        if self.sequence_parallel and self.tp == 1:
            p.append("sequence parallel needs TP > 1")
        if self.recompute.granularity == "full" and len(self.recompute.num_layers) != self.pp:
            p.append(f"{len(self.recompute.num_layers)} recompute entries for pp {self.pp}")
        if self.vpp > 1 and self.pp == 1:
            p.append("virtual pipeline stages need PP > 1")
        if self.mtp_layers < 0:
            p.append(f"MTP layers {self.mtp_layers} must be >= 0")
        p += self._expert_problems()
        p += self.ddp.plan_problems(
            self.pp, self.vpp, self.dp * self.cp, self.expert_dp, self.distributed_optimizer
        )
        require(p, "parallel plan")

    def _expert_problems(self) -> list[str]:
        p: list[str] = []
        if self.ep < 1 or self.etp < 0:
            p.append(f"EP {self.ep} must be >= 1 and ETP {self.etp} >= 1")
        elif min(self.tp, self.cp, self.dp) >= 1 and (self.tp * self.cp * self.dp) % (
            self.ep * self.expert_tp
        ):
            ranks = self.tp * self.cp * self.dp
            p.append(
                f"EP {self.ep} x ETP {self.expert_tp} does not divide the {ranks}"
                f" ranks of a pipeline stage (TP {self.tp} x CP {self.cp} x DP {self.dp}); use an "
                "EP x ETP that divides it"
            )
        if self.cp_comm_type and self.cp_comm_type not in CP_COMM_TYPES:
            p.append(f"--cp-comm-type {self.cp_comm_type!r} not one of {CP_COMM_TYPES}")
        return p

    @property
    def expert_tp(self) -> int:
        """Expert tensor-parallel size with Megatron's default (TP) applied."""
        return self.etp or self.tp

    @property
    def expert_dp(self) -> int:
        """Expert-data-parallel size: the ranks of a pipeline stage over EP x ETP (the expert
        optimizer state shards over them)."""
        return max(self.tp * self.cp * self.dp // (self.ep * self.expert_tp), 1)

    @property
    def world_size(self) -> int:
        """GPUs (processes) the plan uses."""
        return self.tp * self.pp * self.dp * self.cp

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per optimizer step on each DP rank."""
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def num_layers(self) -> int:
        """Total transformer layers placed."""
        return sum(self.layers_per_stage)

    def chunks_of(self, pp_rank: int) -> tuple[int, ...]:
        """Layer counts of the model chunks (virtual stages) held by one pipeline rank."""
        return tuple(self.layers_per_stage[v * self.pp + pp_rank] for v in range(self.vpp))

    def chunk_starts(self, pp_rank: int) -> tuple[int, ...]:
        """Index of the first transformer layer of each chunk one pipeline rank holds."""
        stages = [v * self.pp + pp_rank for v in range(self.vpp)]
        return tuple(sum(self.layers_per_stage[:i]) for i in stages)

    def layers_of(self, pp_rank: int) -> int:
        """Transformer layers held by one pipeline rank."""
        return sum(self.chunks_of(pp_rank))

    @property
    def layout(self) -> str:
        """Megatron's --pipeline-model-parallel-layout for this partition (E, t, m, L; '|' between
        stages)."""
        return format_layout(self.layers_per_stage, self.mtp_layers)

    def replace(self, **changes: Any) -> ParallelPlan:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Cluster(JsonMixin):
    """The machines a plan must fit on."""

    gpus: int
    """Accelerators available (processes for a CPU run)."""
    gpu_memory_bytes: int
    """Usable memory per accelerator; 0 when unknown (a prediction without a fit check)."""
    gpus_per_node: int = 8
    """Accelerators per node; tensor parallelism stays inside a node."""
    device: str = "cuda"
    """cuda or cpu."""

    def __post_init__(self) -> None:
        p: list[str] = value_problems(self, every_field=True)
        if p:
            require(p, "cluster")
        if self.gpus < 1:
            p.append(f"--gpus {self.gpus} must be at least 1")
        if self.gpu_memory_bytes < 0:
            p.append(f"--gpu-memory-gib {self.gpu_memory_bytes / GIB:g} must be positive")
        if self.gpus_per_node < 1:
            p.append(f"--gpus-per-node {self.gpus_per_node} must be at least 1")
        if self.device not in ("cuda", "cpu"):
            p.append(f"device {self.device!r} not cuda or cpu")
        require(p, "cluster")


def tp_fits(shape: ModelShape, tp: int, sequence_parallel: bool) -> bool:
    """Whether Megatron can split `shape` over `tp` tensor-parallel ranks (with or without SP)."""
    ok = not tp_head_problems(shape.num_attention_heads, shape.groups, tp) and shape.ffn % tp == 0
    return ok and (not sequence_parallel or (tp > 1 and shape.seq_length % tp == 0))


@dataclass(frozen=True)
class ParallelFlags:
    """Parallel sizes, batch and memory savers as given on a Megatron command line (None: not
    given; the planner searches what is not given, training uses Megatron's defaults)."""

    tensor_model_parallel_size: int | None = flag("--tensor-model-parallel-size", None)
    """Tensor-parallel size."""
    pipeline_model_parallel_size: int | None = flag("--pipeline-model-parallel-size", None)
    """Pipeline-parallel size."""
    micro_batch_size: int | None = flag("--micro-batch-size", None)
    """Sequences per micro-batch."""
    global_batch_size: int | None = flag("--global-batch-size", None)
    """Sequences per optimizer step."""
    pipeline_model_parallel_layout: str | None = flag("--pipeline-model-parallel-layout", None)
    """Megatron's layout string (E, t, m, L; '|' between stages), e.g. from `capture-megatron
    plan`."""
    microbatch_group_size_per_vp_stage: int | None = flag(
        "--microbatch-group-size-per-virtual-pipeline-stage", None
    )
    """Interleaved schedule: consecutive micro-batches per virtual stage (default: PP)."""
    context_parallel_size: int | None = flag("--context-parallel-size", None)
    """Context-parallel size."""
    cp_comm_type: str | None = flag("--cp-comm-type", None, choices=CP_COMM_TYPES)
    """Context parallelism's attention communication (Megatron's default p2p; CPU runs
    all-gather)."""
    expert_model_parallel_size: int | None = flag("--expert-model-parallel-size", None)
    """Expert-parallel size."""
    expert_tensor_parallel_size: int | None = flag("--expert-tensor-parallel-size", None)
    """Expert tensor-parallel size (default: the TP size)."""
    sequence_parallel: bool | None = flag("--sequence-parallel", None)
    """Megatron sequence parallelism over the TP group."""
    use_distributed_optimizer: bool | None = flag("--use-distributed-optimizer", None)
    """Shard optimizer state over data-parallel ranks."""
    recompute_activations: bool | None = flag("--recompute-activations", None)
    """Megatron's alias for --recompute-granularity selective."""
    recompute_granularity: str | None = flag(
        "--recompute-granularity",
        None,
        choices=RECOMPUTE_GRANULARITIES,
        note="(none: capture-megatron also fixes 'no recompute' for the planner)",
    )
    """Activation recomputation: none, selective (--recompute-modules; default the attention core)
    or full (whole layers)."""
    recompute_method: str | None = flag("--recompute-method", None, choices=("uniform", "block"))
    """Full recompute: block (the first n layers of a chunk) or uniform (n at a time)."""
    recompute_num_layers: int | None = flag("--recompute-num-layers", None)
    """Full recompute: layers recomputed (n)."""
    recompute_num_layers_per_stage: str | None = flag(
        "--recompute-num-layers-per-stage", None, note="(capture-megatron), e.g. 2,1,0,0"
    )
    """Full block recompute count per pipeline stage, comma separated."""
    recompute_modules: tuple[str, ...] | None = flag(
        "--recompute-modules",
        None,
        note=f"(megatron-core 0.16.1: {', '.join(RECOMPUTE_MODULES)}; default core_attn)",
    )
    """Selective recompute: the submodules recomputed in every layer (only selective recompute
    reads them)."""
    moe_layer_recompute: bool | None = flag("--moe-layer-recompute", None)
    """Deprecated Megatron switch: selective recompute with 'moe' added to the modules."""
    num_layers_per_virtual_pipeline_stage: int | None = flag(
        "--num-layers-per-virtual-pipeline-stage", None
    )
    """Transformer layers per virtual pipeline stage (interleaved schedule)."""
    num_virtual_stages_per_pipeline_rank: int | None = flag(
        "--num-virtual-stages-per-pipeline-rank", None
    )
    """Virtual pipeline stages (model chunks) per pipeline rank."""
    decoder_first_pipeline_num_layers: int | None = flag(
        "--decoder-first-pipeline-num-layers", None
    )
    """Transformer layers on the first pipeline stage (the rest split evenly)."""
    decoder_last_pipeline_num_layers: int | None = flag("--decoder-last-pipeline-num-layers", None)
    """Transformer layers on the last pipeline stage (the rest split evenly)."""
    account_for_embedding_in_pipeline_split: bool | None = flag(
        "--account-for-embedding-in-pipeline-split", None
    )
    """Count the embedding as one layer when splitting layers evenly over stages."""
    account_for_loss_in_pipeline_split: bool | None = flag(
        "--account-for-loss-in-pipeline-split", None
    )
    """Count the output layer and loss as one layer when splitting layers evenly over stages."""
