"""The fitted memory model: per variant, exact constants at the probed shapes (anchors) and their
regressions or replayed timelines across shapes (see capture_megatron.fit.decompose). Pure
Python."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from capture_megatron.errors import CaptureError
from capture_megatron.features.activation_offload import OffloadTensor
from capture_megatron.fit.regression import Regression
from capture_megatron.fit.terms import Sizes
from capture_megatron.fit.timelines.windows import FIELDS, KEPT, LAYER_FIELDS, ProbeWindow, lookup
from capture_megatron.records import ProbeShape, Variant
from capture_megatron.serial import JsonMixin

KINDS = ("first", "middle", "last", "only")
"""Chunk kinds: embedding + layers, layers, layers + head, everything (PP 1)."""
END_KINDS = ("first", "last", "only")
"""Chunk kinds holding an end (embedding or output layer)."""


@dataclass(frozen=True)
class KindConstants(JsonMixin):
    """The decomposition constants of one chunk kind at one shape (bytes; None when not probed)."""

    kind: str
    """first, middle, last or only."""
    input_bytes: float
    """Activation received from the previous stage per micro-batch."""
    saved1: float
    """Saved bytes with one layer."""
    fwd1: float
    """Forward peak with one layer."""
    bwd1: float
    """Backward peak with one layer."""
    step1: float
    """Optimizer-step peak with one layer."""
    saved0: float | None = None
    """Saved bytes without layers (ends only)."""
    fwd0: float | None = None
    """Forward peak without layers."""
    bwd0: float | None = None
    """Backward peak without layers."""
    step0: float | None = None
    """Optimizer-step peak without layers."""
    fwdrc: float | None = None
    """Forward peak with one fully recomputed layer."""
    bwdrc: float | None = None
    """Backward peak with one fully recomputed layer."""
    bwdmix: float | None = None
    """Backward peak with two layers, the first recomputed."""
    end_numels: tuple[int, ...] = ()
    """Element counts of the end parameters (embedding, or final norm + output layer)."""
    buffers1: float = 0.0
    """Persistent buffers (Megatron's global buffers, TE's dummy wgrads) with one layer."""
    buffers0: float | None = None
    """Persistent buffers without layers."""
    ret1: float | None = None
    """Bytes one layer's chunk retains after its backward until its next forward (MoE layers: the
    routing tensors' graph holds the leaves the pass started from and their gradients; 0 for dense
    layers)."""
    retrc: float | None = None
    """Retained bytes with one fully recomputed layer."""
    retmix: float | None = None
    """Retained bytes with two layers, the first recomputed."""
    ret2: float | None = None
    """Retained bytes with two fully recomputed layers (middle chunks; others with MoE layers)."""
    retk2: float | None = None
    """Retained bytes with two layers kept (middle chunks): above ret1 what each further MoE layer
    keeps when selective recompute checkpoints part of it (--recompute-modules moe, layernorm,
    moe_act: the checkpoint's detached input and its gradient); equal to ret1 otherwise."""
    grad1: float | None = None
    """Of ret1, the chunk's input gradient (the tensor the schedule sends back)."""
    state1: float | None = None
    """Bytes one MoE layer's token dispatcher keeps from its last forward for good (routing state,
    ProfileRecord.routing_state_bytes of the one-layer probe; 0 for dense layers)."""
    lbuf1: float | None = None
    """Bytes one layer's registered module buffers hold for good (MLA's YaRN cos/sin tables,
    ProfileRecord.layer_buffer_bytes of the one-layer probe; 0 for standard attention)."""
    gradrc: float | None = None
    """Of retrc, the chunk's input gradient."""
    gradmix: float | None = None
    """Of retmix, the chunk's input gradient."""
    lpstate1: float | None = None
    """Bytes one layer's linear layers keep for good for their low-precision compute (quantized
    weight copies and scaling state, ProfileRecord.low_precision_state_bytes of the one-layer
    probe; 0 in the activation dtype)."""
    bwdrc2: float | None = None
    """Backward peak with two fully recomputed layers (middle chunks; others with MoE layers): a
    further recomputed MoE layer adds the gradient it retains."""
    end_expert: tuple[bool, ...] = ()
    """Per entry of end_numels, whether it is a routed expert's parameter (the MoE experts of
    multi-token prediction layers on a last / only chunk; empty: none is)."""

    def _need(self, name: str) -> float:
        """A constant that only some probes give; CaptureError when absent."""
        value = getattr(self, name)
        if value is None:
            raise CaptureError(
                f"the memory model has no {name} for {self.kind} chunks; profile that variant"
            )
        return float(value)

    @property
    def saved_ends(self) -> float:
        """saved0, required: saved bytes of the chunk's ends alone."""
        return self._need("saved0")

    @property
    def forward_ends(self) -> float:
        """fwd0, required: the forward peak of the ends alone."""
        return self._need("fwd0")

    @property
    def backward_ends(self) -> float:
        """bwd0, required: the backward peak of the ends alone."""
        return self._need("bwd0")

    @property
    def step_ends(self) -> float:
        """step0, required: the optimizer-step peak of the ends alone."""
        return self._need("step0")

    @property
    def buffers_ends(self) -> float:
        """buffers0, required: persistent buffers of the ends alone."""
        return self._need("buffers0")

    @property
    def forward_recomputed(self) -> float:
        """fwdrc, required: the forward peak with one fully recomputed layer."""
        return self._need("fwdrc")

    @property
    def backward_recomputed(self) -> float:
        """bwdrc, required: the backward peak with one fully recomputed layer."""
        return self._need("bwdrc")

    @property
    def backward_mixed(self) -> float:
        """bwdmix, required: the backward peak with two layers, the first recomputed."""
        return self._need("bwdmix")


@dataclass(frozen=True)
class ShapeConstants(JsonMixin):
    """Everything the predictor needs at one shape."""

    sizes: Sizes
    """The shape."""
    layer_saved: float
    """S."""
    layer_saved_rc: float | None
    """R: what the first recomputed layer of a chunk keeps (full recompute only)."""
    layer_numels: tuple[int, ...]
    """One layer's parameter element counts, in module order."""
    chunks: tuple[KindConstants, ...]
    """One per chunk kind."""
    buffers: float
    """Megatron's global buffers with at least one layer."""
    layer_saved_rc_next: float | None = None
    """R2: what each recomputed layer after the first keeps (its input; full recompute only). The
    first recomputed layer of a chunk may keep less (its input is the chunk's input): R."""
    layer_expert: tuple[bool, ...] = ()
    """Per entry of layer_numels, whether it is a routed expert's parameter (empty: none is)."""
    layer_low_precision: tuple[bool, ...] = ()
    """Per entry of layer_numels, whether it is a low-precision parameter (empty: none is)."""
    layer_offload: tuple[OffloadTensor, ...] | None = None
    """What one layer's fine-grained offloading groups save (ProfileRecord.offload_tensors of the
    one-layer middle probe); None where not measured (regressed shapes, older records)."""

    def chunk(self, kind: str) -> KindConstants:
        """The constants of one kind."""
        return next(c for c in self.chunks if c.kind == kind)


SCALAR_CONSTANTS = frozenset(
    f.name
    for f in dataclasses.fields(KindConstants)
    if f.name not in ("kind", "end_numels", "end_expert")
)
"""The KindConstants fields a ChunkModel regresses (one number each)."""


@dataclass(frozen=True)
class ChunkModel(JsonMixin):
    """Regressions of one chunk kind's constants (field names as in KindConstants)."""

    kind: str
    """Chunk kind."""
    fields: tuple[tuple[str, Regression], ...]
    """(KindConstants field, regression) for every probed scalar field."""
    end_numels: tuple[Regression, ...]
    """Regressions of the end parameters' element counts."""
    end_expert: tuple[bool, ...] = ()
    """Per end parameter, whether it is a routed expert's (KindConstants.end_expert)."""

    def __post_init__(self) -> None:
        # a sparse record of KindConstants' scalar fields (only the probed ones are fitted): every
        # name must be one, once, so that a renamed field cannot be fitted and then dropped
        names = [name for name, _ in self.fields]
        unknown = sorted(set(names) - SCALAR_CONSTANTS)
        if unknown or len(set(names)) != len(names):
            raise CaptureError(
                f"memory model chunk {self.kind!r}: fitted constants {sorted(names)} are not "
                f"each one of KindConstants' ({', '.join(sorted(SCALAR_CONSTANTS))}) once; fit "
                "it again with `capture-megatron fit`"
            )

    def at(self, z: Sizes) -> KindConstants:
        """The constants this model predicts at `z`."""
        values = {name: reg.predict(z) for name, reg in self.fields}
        numels = tuple(round(r.predict(z)) for r in self.end_numels)
        expert = self.end_expert
        return KindConstants(kind=self.kind, end_numels=numels, end_expert=expert, **values)


def _replayed(sc: ShapeConstants, windows: tuple[ProbeWindow, ...]) -> ShapeConstants:
    """ShapeConstants `sc` (regressed) with every constant the windows model replaced by its
    replay."""
    value = lookup(windows, sc.sizes)
    chunks = []
    for c in sc.chunks:
        found = {
            name: value(c.kind, *where)
            for name, where in FIELDS.items()
            if getattr(c, name) is not None
        }
        known: dict[str, Any] = {k: v for k, v in found.items() if v is not None}
        chunks.append(dataclasses.replace(c, **known))
    layer: dict[str, Any] = {}
    for name, (plus, minus) in LAYER_FIELDS.items():
        a, b = value("middle", *plus, KEPT), value("middle", *minus, KEPT)
        if getattr(sc, name) is not None and a is not None and b is not None:
            layer[name] = a - b
    return dataclasses.replace(sc, chunks=tuple(chunks), **layer)


def settled(sc: ShapeConstants) -> ShapeConstants:
    """`sc` as measured (anchors, regressions, replays) with the saved bytes and forward peaks
    taken above the state before a forward when its chunk retains nothing.

    A probe's measured iteration starts with what the previous iteration's backward left retained
    (MoE layers: KindConstants.ret1), which its forward releases; so a probe's saved bytes and
    forward peak are net of it. Here they are given back: saved1 / fwd1 / fwdrc gain the one-layer
    probe's retained bytes, S, R and R2 the difference of the retention they measured across. The
    predictor counts a chunk's retained bytes on its own (capture_megatron.forecast.retained)."""
    mid = sc.chunk("middle")
    if not (mid.ret1 or mid.retrc):
        return sc
    chunks = []
    for c in sc.chunks:
        fixed: dict[str, Any] = {}
        if c.ret1:
            fixed.update(saved1=c.saved1 + c.ret1, fwd1=c.fwd1 + c.ret1)
        if c.retrc and c.fwdrc is not None:
            fixed.update(fwdrc=c.fwdrc + c.retrc)
        chunks.append(dataclasses.replace(c, **fixed))
    layer: dict[str, Any] = {}
    if mid.retk2 is not None and mid.ret1 is not None and mid.retk2 != mid.ret1:
        layer["layer_saved"] = sc.layer_saved + mid.retk2 - mid.ret1
    if sc.layer_saved_rc is not None and mid.retmix is not None:
        layer["layer_saved_rc"] = sc.layer_saved_rc + mid.retmix - (mid.ret1 or 0.0)
    if sc.layer_saved_rc_next is not None and mid.ret2 is not None and mid.retrc is not None:
        layer["layer_saved_rc_next"] = sc.layer_saved_rc_next + mid.ret2 - mid.retrc
    return dataclasses.replace(sc, chunks=tuple(chunks), **layer)


@dataclass(frozen=True)
class VariantModel(JsonMixin):
    """Everything fitted for one Variant."""

    variant: Variant
    """The categorical settings."""
    anchors: tuple[ShapeConstants, ...]
    """Exact constants at every probed shape."""
    layer_saved: Regression
    """S over shapes."""
    layer_saved_rc: Regression | None
    """R over shapes (full recompute only)."""
    layer_numels: tuple[Regression, ...]
    """One layer's parameter element counts over shapes."""
    chunks: tuple[ChunkModel, ...]
    """One per chunk kind."""
    buffers: Regression
    """Global buffer bytes over shapes."""
    ranges: tuple[tuple[str, int, int], ...]
    """(size, min, max) over the probes, for extrapolation warnings."""
    layer_saved_rc_next: Regression | None = None
    """R2 over shapes (full recompute only)."""
    workspace_bytes: int = 0
    """GPU-only allocations every process keeps (cuBLAS / TE workspaces; 0 for CPU kernels)."""
    windows: tuple[ProbeWindow, ...] = ()
    """Replayed allocation timelines of the probes' windows (records profiled with timelines); where
    present they give the saved bytes and peaks instead of the regressions."""
    layer_expert: tuple[bool, ...] = ()
    """Per entry of layer_numels, whether it is a routed expert's parameter (empty: none is)."""
    layer_low_precision: tuple[bool, ...] = ()
    """Per entry of layer_numels, whether it is a low-precision parameter (empty: none is)."""

    def constants(self, z: Sizes) -> ShapeConstants:
        """Exact constants when `z` was probed, else the replayed timelines' / regressions'
        prediction (worked out once per shape: a search asks for the same few shapes at every
        chunk it costs)."""
        memo: dict[Sizes, ShapeConstants] | None = self.__dict__.get("_constants")
        if memo is None:
            memo = {}
            object.__setattr__(self, "_constants", memo)  # not a field: not compared or written
        found = memo.get(z)
        if found is None:
            found = memo[z] = self._constants_at(z)
        return found

    def _constants_at(self, z: Sizes) -> ShapeConstants:
        for anchor in self.anchors:
            if anchor.sizes == z:
                return settled(anchor)
        rc = self.layer_saved_rc.predict(z) if self.layer_saved_rc is not None else None
        rc2 = self.layer_saved_rc_next.predict(z) if self.layer_saved_rc_next is not None else None
        regressed = ShapeConstants(
            sizes=z,
            layer_saved=self.layer_saved.predict(z),
            layer_saved_rc=rc,
            layer_numels=tuple(round(r.predict(z)) for r in self.layer_numels),
            chunks=tuple(c.at(z) for c in self.chunks),
            buffers=self.buffers.predict(z),
            layer_saved_rc_next=rc2,
            layer_expert=self.layer_expert,
            layer_low_precision=self.layer_low_precision,
        )
        return settled(_replayed(regressed, self.windows) if self.windows else regressed)


@dataclass(frozen=True)
class MemoryModel(JsonMixin):
    """The fitted memory model of one device / implementation / software stack."""

    device: str
    """Where it was profiled: cpu, fake-cpu, fake-cuda or cuda."""
    kernels: str
    """The kernel set it describes: 'cpu' or 'gpu:' + the GPU kernels' key."""
    versions: tuple[str, str, str]
    """(capture-megatron, torch, megatron-core) of the probes."""
    variants: tuple[VariantModel, ...]
    """One per profiled Variant."""


Needs = frozenset[tuple[Variant, ProbeShape]]
"""The (variant, probe shape) pairs predicting some plans needs from a memory model."""
ModelSource = Callable[[Needs], MemoryModel]
"""Gives a memory model holding (at least) the needed pairs (capture_megatron.profile.memory_source
profiles them on demand)."""


@runtime_checkable
class RecordedSource(Protocol):
    """A ModelSource that also says, without profiling, whether it holds some pairs already (its
    cache: capture_megatron.profile.memory_source)."""

    def __call__(self, needs: Needs) -> MemoryModel:
        """A memory model holding (at least) `needs` (profiled where missing)."""

    def recorded(self, needs: Needs) -> bool:
        """Whether every pair of `needs` is recorded already (asking for them profiles nothing)."""
