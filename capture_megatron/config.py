"""The objects that pass between stages: ModelShape, Recompute, ParallelPlan, Cluster.

Frozen dataclasses, validated at construction (a CaptureError naming every offending factor) and
round-tripped exactly through JSON. Pure Python: no torch import here.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from capture_megatron.errors import require
from capture_megatron.layout import format_layout
from capture_megatron.serial import JsonMixin

GIB = 1 << 30
DTYPES = ("fp32", "bf16", "fp16")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDINGS = ("learned_absolute", "rope")
RECOMPUTE_GRANULARITIES = ("none", "selective", "full")
RECOMPUTE_METHODS = ("block", "uniform")


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a ModelShape dtype name."""
    return 4 if dtype == "fp32" else 2


@dataclass(frozen=True)
class ModelShape(JsonMixin):
    """A GPT model's architecture, in Megatron's terms (flag names in parentheses)."""

    num_layers: int
    """Transformer (decoder) layers (--num-layers)."""
    hidden_size: int
    """Model width h (--hidden-size)."""
    num_attention_heads: int
    """Attention heads a (--num-attention-heads)."""
    seq_length: int
    """Training sequence length s (--seq-length)."""
    vocab_size: int
    """Tokenizer vocabulary before Megatron's padding (--vocab-size)."""
    ffn_hidden_size: int = 0
    """MLP width (--ffn-hidden-size); 0 means Megatron's default 4h."""
    num_query_groups: int = 0
    """Key/value groups for GQA (--num-query-groups); 0 means one per head (plain MHA)."""
    kv_channels: int = 0
    """Per-head width (--kv-channels); 0 means h / a."""
    max_position_embeddings: int = 0
    """Learned position table size (--max-position-embeddings); 0 means seq_length."""
    make_vocab_size_divisible_by: int = 128
    """Megatron pads the vocabulary to a multiple of this times TP."""
    swiglu: bool = False
    """Gated SiLU MLP (--swiglu)."""
    normalization: str = "LayerNorm"
    """LayerNorm or RMSNorm (--normalization)."""
    untie_embeddings_and_output_weights: bool = False
    """Separate output layer weights (--untie-embeddings-and-output-weights)."""
    position_embedding_type: str = "learned_absolute"
    """learned_absolute or rope (--position-embedding-type)."""
    add_bias_linear: bool = True
    """Biases in linear layers (off with --disable-bias-linear)."""
    hidden_dropout: float = 0.1
    """Dropout after attention and MLP (--hidden-dropout)."""
    attention_dropout: float = 0.1
    """Dropout on attention probabilities (--attention-dropout)."""
    dtype: str = "fp32"
    """Parameter/activation precision: fp32, bf16 (--bf16) or fp16 (--fp16)."""

    def __post_init__(self) -> None:
        p: list[str] = []
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size"):
            if getattr(self, name) <= 0:
                p.append(f"{name} {getattr(self, name)} must be positive")
        if self.num_attention_heads > 0 and self.kv_channels == 0 and self.hidden_size % self.num_attention_heads:
            p.append(f"hidden {self.hidden_size} not divisible by heads {self.num_attention_heads} (set --kv-channels)")
        if self.num_query_groups and self.num_attention_heads % self.num_query_groups:
            p.append(f"heads {self.num_attention_heads} not divisible by query groups {self.num_query_groups}")
        if self.dtype not in DTYPES:
            p.append(f"dtype {self.dtype!r} not one of {DTYPES}")
        if self.normalization not in NORMALIZATIONS:
            p.append(f"normalization {self.normalization!r} not one of {NORMALIZATIONS}")
        if self.position_embedding_type not in POSITION_EMBEDDINGS:
            p.append(f"position embedding {self.position_embedding_type!r} not one of {POSITION_EMBEDDINGS}")
        if self.max_position_embeddings and self.position_embedding_type == "learned_absolute" \
                and self.max_position_embeddings < self.seq_length:
            p.append(f"max_position_embeddings {self.max_position_embeddings} < seq_length {self.seq_length}")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                p.append(f"{name} {getattr(self, name)} not in [0, 1)")
        require(p, "model shape")

    @property
    def ffn(self) -> int:
        """MLP width with Megatron's default applied."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def groups(self) -> int:
        """Key/value groups with the MHA default applied."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        """Per-head width with the h / a default applied."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def max_positions(self) -> int:
        """Position table size with the seq_length default applied."""
        return self.max_position_embeddings or self.seq_length

    def padded_vocab(self, tp: int) -> int:
        """Vocabulary padded as Megatron does: to a multiple of make_vocab_size_divisible_by * tp."""
        multiple = self.make_vocab_size_divisible_by * tp
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def replace(self, **changes) -> "ModelShape":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Recompute(JsonMixin):
    """Activation recomputation, possibly different on every pipeline stage."""

    granularity: str = "none"
    """none, selective (attention core only) or full (whole layers)."""
    method: str = "block"
    """For full: block (the first n layers of each model chunk) or uniform (all layers, n at a time)."""
    num_layers: tuple[int, ...] = ()
    """For full: n per pipeline stage (one entry per pp rank, applied to each of its chunks)."""

    def __post_init__(self) -> None:
        p: list[str] = []
        if self.granularity not in RECOMPUTE_GRANULARITIES:
            p.append(f"granularity {self.granularity!r} not one of {RECOMPUTE_GRANULARITIES}")
        if self.method not in RECOMPUTE_METHODS:
            p.append(f"method {self.method!r} not one of {RECOMPUTE_METHODS}")
        if self.granularity == "full" and not self.num_layers:
            p.append("full recompute needs num_layers per stage")
        if self.granularity != "full" and self.num_layers:
            p.append(f"num_layers {list(self.num_layers)} only applies to full recompute")
        if any(n < 0 for n in self.num_layers):
            p.append(f"negative recompute layers {list(self.num_layers)}")
        if self.method == "uniform" and len(set(self.num_layers)) > 1:
            p.append("per-stage recompute counts need method 'block'")
        require(p, "recompute setting")

    def layers_on(self, pp_rank: int) -> int:
        """Full-recompute n of a pipeline stage (0 when not full)."""
        return self.num_layers[pp_rank] if self.granularity == "full" else 0


@dataclass(frozen=True)
class ParallelPlan(JsonMixin):
    """How a model is split: parallel sizes, batch, the pipeline partition and memory savers."""

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
    """Context-parallel size (kept at 1 by the planner)."""
    recompute: Recompute = Recompute()
    """Activation recomputation per pipeline stage."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism over the TP group (--sequence-parallel)."""
    distributed_optimizer: bool = False
    """Shard optimizer state over DP (--use-distributed-optimizer)."""

    def __post_init__(self) -> None:
        p: list[str] = []
        for name in ("tp", "pp", "dp", "cp", "vpp", "micro_batch_size", "global_batch_size"):
            if getattr(self, name) < 1:
                p.append(f"{name} {getattr(self, name)} must be >= 1")
        if len(self.layers_per_stage) != self.pp * self.vpp:
            p.append(f"{len(self.layers_per_stage)} stage entries for pp {self.pp} x vpp {self.vpp}")
        if any(n < 0 for n in self.layers_per_stage):
            p.append(f"negative layer count in {list(self.layers_per_stage)}")
        if self.micro_batch_size >= 1 and self.dp >= 1 and self.global_batch_size % (self.micro_batch_size * self.dp):
            p.append(f"global batch {self.global_batch_size} not divisible by micro-batch "
                     f"{self.micro_batch_size} x DP {self.dp}")
        if self.sequence_parallel and self.tp == 1:
            p.append("sequence parallel needs TP > 1")
        if self.recompute.granularity == "full" and len(self.recompute.num_layers) != self.pp:
            p.append(f"{len(self.recompute.num_layers)} recompute entries for pp {self.pp}")
        if self.vpp > 1 and self.pp == 1:
            p.append("virtual pipeline stages need PP > 1")
        require(p, "parallel plan")

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

    def layers_of(self, pp_rank: int) -> int:
        """Transformer layers held by one pipeline rank."""
        return sum(self.chunks_of(pp_rank))

    @property
    def layout(self) -> str:
        """Megatron's --pipeline-model-parallel-layout for this partition (E, t, L; '|' between stages)."""
        return format_layout(self.layers_per_stage)

    def replace(self, **changes) -> "ParallelPlan":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def uniform_layers(num_layers: int, stages: int) -> tuple[int, ...]:
    """Megatron's default even split; a CaptureError when the layers do not divide evenly."""
    if num_layers % stages:
        require([f"{num_layers} layers do not split evenly over {stages} stages"], "uniform split")
    return (num_layers // stages,) * stages


@dataclass(frozen=True)
class Cluster(JsonMixin):
    """The machines a plan must fit on."""

    gpus: int
    """Accelerators available (processes for a CPU run)."""
    gpu_memory_bytes: int
    """Memory per accelerator."""
    gpus_per_node: int = 8
    """Accelerators per node; tensor parallelism stays inside a node."""
    device: str = "cuda"
    """cuda or cpu."""

    def __post_init__(self) -> None:
        p: list[str] = []
        if self.gpus < 1:
            p.append(f"--gpus {self.gpus} must be at least 1")
        if self.gpu_memory_bytes <= 0:
            p.append(f"--gpu-memory-gib {self.gpu_memory_bytes / GIB:g} must be positive")
        if self.gpus_per_node < 1:
            p.append(f"--gpus-per-node {self.gpus_per_node} must be at least 1")
        if self.device not in ("cuda", "cpu"):
            p.append(f"device {self.device!r} not cuda or cpu")
        require(p, "cluster")


def check_plan_fits_model(shape: ModelShape, plan: ParallelPlan) -> None:
    """Raise a CaptureError naming every way `plan` cannot run `shape` in Megatron."""
    p: list[str] = []
    if shape.num_attention_heads % plan.tp:
        p.append(f"heads {shape.num_attention_heads} not divisible by TP {plan.tp}")
    if shape.groups % plan.tp:
        p.append(f"query groups {shape.groups} not divisible by TP {plan.tp}")
    if shape.ffn % plan.tp:
        p.append(f"ffn hidden {shape.ffn} not divisible by TP {plan.tp}")
    if plan.num_layers != shape.num_layers:
        p.append(f"layout {plan.layout!r} places {plan.num_layers} layers but --num-layers is {shape.num_layers}")
    if plan.sequence_parallel and shape.seq_length % plan.tp:
        p.append(f"seq length {shape.seq_length} not divisible by TP {plan.tp} for sequence parallel")
    for r in range(plan.pp):
        for n in plan.chunks_of(r) if plan.recompute.granularity == "full" else ():
            if plan.recompute.method == "uniform" and n % max(plan.recompute.layers_on(r), 1):
                p.append(f"uniform recompute of {plan.recompute.layers_on(r)} does not divide {n} layers")
    require(p, "plan for this model")
