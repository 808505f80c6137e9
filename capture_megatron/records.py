"""ProfileRecord: what one probe measured, as plain JSON lines that round-trip exactly.

A probe is one model chunk (the pieces a pipeline stage holds) built by the same builder training
uses, run through megatron-core's own forward_step / backward_step and optimizer step:
- kind 'first'  = embedding + k transformer layers (pipeline stage 0 of PP > 1),
- kind 'middle' = k transformer layers (a stage without the ends),
- kind 'last'   = k transformer layers + final norm + output layer + loss,
- kind 'only'   = embedding + k layers + output layer (PP = 1);
with multi-token prediction (Variant.mtp) the last and only kinds also hold the MTP layers and
the embedding they look tokens up in, as Megatron's last pipeline stage does.
Torch-free: records are written by the profile stage and read by the (pure) fit stage; Variant and
ProbeShape also key the fitted memory model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from capture_megatron.config import ModelShape
from capture_megatron.config.model import tp_head_problems
from capture_megatron.errors import CaptureError, require
from capture_megatron.features.activation_offload import OffloadTensor
from capture_megatron.features.mla import LatentAttention
from capture_megatron.features.moe import Experts
from capture_megatron.features.recompute import check_variant_modules, variant_modules
from capture_megatron.serial import JsonMixin, from_plain, to_plain
from capture_megatron.version import __version__

RECORD_FORMAT = 3
"""Version of the records file layout (the header line says it; 3: the low-precision fields
named generically, issue 54)."""


@dataclass(frozen=True)
class ExpertsProbe(JsonMixin):
    """The MoE layers a probe builds and how they split: fitted per value (categorical), at the
    model's own shapes.

    Routing whose token counts vary (dropless, or a capacity without padding) is probed as its
    bound: every expert padded to a capacity (`bound` says which), so that the bytes are those of
    the most tokens the forecast allows for."""

    experts: Experts
    """The model's MoE settings, with a padded capacity factor where routing is bounded."""
    ep: int
    """Expert-parallel size."""
    etp: int
    """Expert tensor-parallel size."""
    bound: str
    """exact (capacity-padded routing: the bytes are exact), capacity (the capacity factor caps
    the tokens), imbalance (dropless routing at a factor below the worst case: the forecast, its
    planning margin or the user's --moe-imbalance-factor) or worst (every token of the expert's
    ranks routed to it)."""


@dataclass(frozen=True)
class Variant(JsonMixin):
    """The categorical settings a fitted model is specific to (one regression per variant)."""

    dtype: str
    """fp32, bf16 or fp16."""
    recompute: str
    """none, selective or full (full: the probe's recompute_layers of its layers)."""
    sequence_parallel: bool
    """Megatron sequence parallelism (only meaningful with TP > 1)."""
    swiglu: bool
    """Gated SiLU MLP."""
    normalization: str
    """LayerNorm or RMSNorm."""
    position_embedding_type: str
    """learned_absolute or rope."""
    add_bias_linear: bool
    """Biases in the linear layers."""
    dropout: bool
    """Any dropout probability > 0 (on CPU dropout saves a mask in the activation dtype)."""
    untied: bool
    """Separate output-layer weights."""
    geglu: bool = False
    """Gated tanh-GELU MLP (GeGLU)."""
    add_qkv_bias: bool = False
    """Biases in the QKV projection (without the other linear biases)."""
    window_size: tuple[int, ...] = ()
    """Sliding-window attention (left, right); empty: full causal attention."""
    moe: ExpertsProbe | None = None
    """MoE layers (None: a dense model)."""
    cp: int = 1
    """Context-parallel size (> 1: fitted per value, at the model's own shapes, like `moe`)."""
    qk_norm: str = ""
    """The norm on each query and key head: layernorm (--qk-layernorm), l2 (--qk-l2-norm) or ''
    (fitted at the model's own shapes: its per-head statistics have no regression term)."""
    mla: LatentAttention | None = None
    """Multi-latent attention's widths and RoPE kind (None: standard attention; fitted at the
    model's own shapes: its latent ranks and head widths are not probe-shape sizes)."""
    mtp: int = 0
    """Multi-token prediction layers (--mtp-num-layers), built into the last / only chunk as
    Megatron places them (> 0: fitted at the model's own shapes, like `moe`)."""
    recompute_modules: tuple[str, ...] = ()
    """Selective recompute's modules (sorted) other than the default core_attn alone, else empty
    (default variants keep their keys; non-empty: fitted at the model's own shapes, like `moe`)."""

    def __post_init__(self) -> None:
        check_variant_modules(self.recompute, self.recompute_modules)

    @property
    def designed(self) -> bool:
        """Whether the variant is fitted over the regression's design shapes too (dense, CP 1,
        standard attention without query/key norms, no MTP, default recompute modules); the others
        are fitted at the model's own shapes only (docs/MEMORY_MODEL.md)."""
        plain = not (self.qk_norm or self.mtp or self.recompute_modules)
        return self.moe is None and self.cp == 1 and self.mla is None and plain

    @classmethod
    def of(
        cls,
        shape: ModelShape,
        recompute: str = "none",
        sequence_parallel: bool = False,
        moe: ExpertsProbe | None = None,
        cp: int = 1,
        modules: tuple[str, ...] = (),
    ) -> Variant:
        """The Variant of a model under a recompute granularity and sequence-parallel setting
        (`moe`: its experts as probed, for a model with experts; `cp`: the context-parallel
        size; `modules`: --recompute-modules as given, empty for the default)."""
        return cls(
            dtype=shape.dtype,
            recompute=recompute,
            recompute_modules=variant_modules(recompute, modules),
            sequence_parallel=sequence_parallel,
            swiglu=shape.swiglu,
            normalization=shape.normalization,
            position_embedding_type=shape.position_embedding_type,
            add_bias_linear=shape.add_bias_linear,
            dropout=shape.hidden_dropout > 0 or shape.attention_dropout > 0,
            untied=shape.untie_embeddings_and_output_weights,
            geglu=shape.geglu,
            add_qkv_bias=shape.add_qkv_bias,
            window_size=shape.window_size,
            moe=moe,
            cp=cp,
            qk_norm=shape.qk_norm,
            mla=shape.mla.shapes_only() if shape.mla.enabled else None,
            mtp=shape.mtp_num_layers,
        )


@dataclass(frozen=True)
class ProbeShape(JsonMixin):
    """The continuous part of a probe: sizes the regression terms are built from."""

    micro_batch_size: int
    """b."""
    seq_length: int
    """s."""
    hidden_size: int
    """h."""
    num_attention_heads: int
    """a."""
    num_query_groups: int
    """g (= a without GQA)."""
    kv_channels: int
    """d, per-head width."""
    ffn_hidden_size: int
    """f."""
    padded_vocab: int
    """V, the vocabulary as Megatron pads it for this TP."""
    tp: int
    """t, tensor-parallel size."""

    def __post_init__(self) -> None:
        t = self.tp
        p = tp_head_problems(self.num_attention_heads, self.num_query_groups, t)
        for name, value in (("ffn", self.ffn_hidden_size), ("padded vocab", self.padded_vocab)):
            if value % t:
                p.append(f"{name} {value} not divisible by TP {t}")
        if self.num_attention_heads % self.num_query_groups:
            p.append(
                f"heads {self.num_attention_heads} not divisible by query groups "
                f"{self.num_query_groups}"
            )
        require(p, "probe shape")

    @classmethod
    def of(cls, shape: ModelShape, tp: int, micro_batch_size: int) -> ProbeShape:
        """The probe shape of a model itself at one TP size and micro-batch size."""
        return cls(
            micro_batch_size=micro_batch_size,
            seq_length=shape.seq_length,
            hidden_size=shape.hidden_size,
            num_attention_heads=shape.num_attention_heads,
            num_query_groups=shape.groups,
            kv_channels=shape.head_dim,
            ffn_hidden_size=shape.ffn,
            padded_vocab=shape.padded_vocab(tp),
            tp=tp,
        )


@dataclass(frozen=True)
class BufferBytes(JsonMixin):
    """One persistent Megatron GlobalMemoryBuffer after the probe."""

    name: str
    """Buffer name ('mpu' is shared by attention scores and SP all-gathers)."""
    dtype: str
    """Element type."""
    nbytes: int
    """Bytes held."""


@dataclass(frozen=True)
class Timeline(JsonMixin):
    """Every allocation and release of one measured window, in order (cpu and fake devices)."""

    window: str
    """forward, backward or step."""
    ops: tuple[str, ...]
    """Per event: '+name' when op `name` allocated a storage, '-name' when a storage it allocated
    died."""
    nbytes: tuple[int, ...]
    """Per event: the storage's bytes."""
    offset: int
    """The record's peak is max(0, largest running sum of the events) + offset (the backward counts
    the gradient it received, which exists before the window starts)."""
    origins: tuple[int, ...] = ()
    """Per event: for a release, the index i of the event that allocated its storage in this window,
    or -2 - i when that was event i of the previous window (the backward releasing what the forward
    saved); -1 for allocations and for storages from earlier."""


@dataclass(frozen=True)
class ProfileRecord(JsonMixin):
    """Measured memory of one chunk probe (all values in bytes, for the TP rank 0 process)."""

    device: str
    """cpu, fake-cpu, fake-cuda or cuda (capture_megatron.profile.options.DEVICES)."""
    kernels: str
    """The kernel set measured: 'cpu', or 'gpu:' + the GPU kernels' key
    (capture_megatron.config.kernels.kernel_set)."""
    versions: tuple[str, str, str]
    """(capture-megatron, torch, megatron-core) versions that measured it."""
    variant: Variant
    """Categorical settings."""
    shape: ProbeShape
    """Sizes."""
    kind: str
    """first, middle, last or only (see the module docstring)."""
    layers: int
    """Transformer layers in the chunk (k)."""
    recompute_layers: int
    """Of those, layers under full recompute (block method: the first n)."""
    dp: int
    """Data-parallel size of the static probe (distributed optimizer shards over it)."""
    distributed_optimizer: bool
    """Whether the optimizer was Megatron's distributed optimizer."""
    param_numels: tuple[int, ...]
    """Element counts of the chunk's parameters in module.parameters() order."""
    param_bytes: int
    """Bytes of the parameters (after DDP wrapping, which may move them into a buffer)."""
    grad_bytes: int
    """Bytes of DDP's gradient buffers (padded with the distributed optimizer)."""
    optimizer_bytes: int
    """Bytes the optimizer holds after a step: Adam moments, fp32 master weights, step counters."""
    input_bytes: int
    """Bytes of the activation tensor received from the previous stage (0 for first/only)."""
    output_bytes: int
    """Bytes of the activation tensor sent to the next stage (0 for last/only)."""
    saved_bytes: int
    """Live bytes a micro-batch adds by its forward and holds until its backward, as the schedule
    holds them: after the output is sent and pseudo-freed; the received input is not included."""
    forward_peak: int
    """Peak during forward above the live bytes before it (input already received)."""
    backward_peak: int
    """Peak during backward above the live bytes before it (the gradient received is included)."""
    residual_bytes: int
    """Live bytes after backward minus before forward (what a micro-batch leaves behind)."""
    step_peak: int
    """Peak during the optimizer step (incl. grad-norm and clipping) above the live bytes before
    it."""
    buffers: tuple[BufferBytes, ...]
    """Megatron's global memory buffers held after the probe."""
    workspace_bytes: int = 0
    """GPU kernel sets: what every training process allocates once and keeps beyond the probe's
    buffers (cuBLAS / TE GEMM workspaces; capture_megatron.config.kernels.Kernels.workspace_bytes);
    0 for CPU kernels."""
    timelines: tuple[Timeline, ...] = ()
    """The forward, backward and step windows event by event, when profiled with timelines
    (cpu/fake)."""
    param_expert: tuple[bool, ...] = ()
    """Per parameter of param_numels, whether it is a routed expert's (in DDP's expert buffer,
    sharded over the expert-data-parallel ranks); empty: none is."""
    retained_bytes: int = 0
    """Bytes the chunk keeps after its backward until its next forward (MoE layers: the routing
    tensors' autograd graph holds the leaves the pass started from and their gradients; 0 for
    dense chunks). The measured iteration starts with them live (the first iteration's), so
    saved_bytes and forward_peak are net of them."""
    retained_grad_bytes: int = 0
    """Of retained_bytes, the chunk's input gradient (the tensor the schedule sends back)."""
    routing_state_bytes: int = 0
    """Bytes the chunk's MoE token dispatchers keep from their last forward for good (routing
    probabilities and map, permutation indices, token counts; capture_megatron.profile.held
    .routing_state_bytes); 0 for dense chunks. Alive from the first forward on, so in none of the
    measured windows."""
    layer_buffer_bytes: int = 0
    """Bytes of the chunk's transformer layers' registered module buffers after the probe (not
    parameters; capture_megatron.profile.held.layer_buffer_bytes): multi-latent attention's YaRN
    cos/sin tables, built with the model and kept for good; 0 for standard attention."""
    low_precision_state_bytes: int = 0
    """Bytes the chunk's linear layers keep for good because they compute in a low precision: the
    quantized copies of their weights (or of low-precision parameters, their other usage) and their
    scaling state (capture_megatron.profile.held.low_precision_state_bytes); 0 in the activation
    dtype. Allocated at each layer's first forward, so in none of the measured windows."""
    param_low_precision: tuple[bool, ...] = ()
    """Per parameter of param_numels, whether it is a low-precision parameter (1 byte, in a DDP
    buffer of its own dtype); empty: none is."""
    offload_tensors: tuple[OffloadTensor, ...] | None = None
    """The one-layer middle probe's storages megatron-core's fine-grained offloading groups would
    move (capture_megatron.profile.offload); None: not measured (other probes, older records)."""

    def timeline(self, window: str) -> Timeline | None:
        """The timeline of one window, if recorded."""
        return next((t for t in self.timelines if t.window == window), None)


@dataclass(frozen=True)
class Probe:
    """What one probe builds and runs."""

    variant: Variant
    """Categorical settings."""
    shape: ProbeShape
    """Sizes."""
    kind: str
    """first, middle, last or only."""
    layers: int
    """Transformer layers in the chunk."""
    recompute_layers: int = 0
    """Layers under full recompute (variant.recompute == 'full')."""
    dp: int = 1
    """Data-parallel size (for the distributed optimizer's shards)."""
    distributed_optimizer: bool = False
    """Megatron's distributed optimizer."""


def write_records(records: list[ProfileRecord], path: str) -> None:
    """Write records as JSON lines (a header line names the format and versions)."""
    with open(path, "w") as f:
        f.write(
            json.dumps({"capture_megatron_records": RECORD_FORMAT, "version": __version__}) + "\n"
        )
        for rec in records:
            f.write(json.dumps(to_plain(rec)) + "\n")


def read_records(path: str) -> list[ProfileRecord]:
    """Read records written by write_records; CaptureError naming the problem otherwise."""
    try:
        with open(path) as f:
            lines = [line for line in f.read().splitlines() if line.strip()]
    except OSError as err:
        raise CaptureError(f"cannot read records file {path}: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise CaptureError(
            f"records file {path} is not UTF-8 text (byte {err.start}): it is damaged or not a "
            "records file; profile again"
        ) from None
    if not lines:
        raise CaptureError(
            f"records file {path} is empty; run `capture-megatron profile ... --out {path}`"
        )
    try:
        header = json.loads(lines[0])
    except json.JSONDecodeError:
        header = None
    if not isinstance(header, dict) or header.get("capture_megatron_records") != RECORD_FORMAT:
        raise CaptureError(
            f"{path} is not a capture-megatron records file of format {RECORD_FORMAT} "
            f"(first line: {lines[0][:80]!r}); profile again with this version"
        )
    if header.get("version") != __version__:
        raise CaptureError(
            f"{path} was written by capture-megatron {header.get('version')}; this is "
            f"{__version__} and its probes differ: profile again"
        )
    records = []
    for number, line in enumerate(lines[1:], start=2):
        try:
            records.append(from_plain(ProfileRecord, json.loads(line)))
        except (json.JSONDecodeError, TypeError, ValueError, KeyError) as err:
            raise CaptureError(
                f"{path} line {number} is truncated or corrupt ({type(err).__name__}: "
                f"{str(err)[:80]}); profile again"
            ) from None
    if not records:
        raise CaptureError(f"records file {path} holds a header but no records")
    return records
