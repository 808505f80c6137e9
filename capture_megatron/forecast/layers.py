"""Which fitted models a plan's transformer layers are predicted from (pure Python).

A model is one variant (every layer dense, or every layer an MoE layer), or -- with Megatron's
--moe-layer-freq (`2`, `([0]*3+[1]*58)`) -- dense and MoE layers mixed: then the MoE layers come
from the model's variant and the dense layers from the same settings without experts, and each
chunk's layers are composed in their order (capture_megatron.forecast.mixed)."""

from __future__ import annotations

from dataclasses import dataclass

from capture_megatron.config import ModelShape, ParallelPlan, versions
from capture_megatron.errors import CaptureError
from capture_megatron.fit import MemoryModel, Sizes, VariantModel, shape_sizes
from capture_megatron.forecast.support import experts_probe
from capture_megatron.records import ProbeShape, Variant


@dataclass(frozen=True)
class Layers:
    """The fitted models of a plan's transformer layers."""

    main: VariantModel
    """The model's own variant: its MoE layers' for a model with experts, else its layers'."""
    dense: VariantModel | None = None
    """The dense layers' variant of a model that mixes dense and MoE layers (None otherwise)."""
    pattern: tuple[bool, ...] = ()
    """Per transformer layer, whether it is an MoE layer (a mixed model only; else empty)."""
    step_measured: bool = True
    """Whether the probes ran the optimizer step (not on fake tensors, whose step is not run:
    its peak is recorded as 0)."""
    torch_adam: bool = True
    """Whether the probes' optimizer is torch's Adam with megatron's local multi-tensor fallbacks
    (the CPU device: no TE or apex), whose step temporaries depend on the largest parameter slice
    (forecast.optimizers.ADAM_TEMP)."""
    foreach_adam: bool = False
    """Whether the GPU run trains with torch's AdamW (the kernel set's --adam-impl torch: no TE
    or apex), whose foreach step holds an fp32 temporary per updated element
    (config.kernels.FOREACH_ADAM_BYTES)."""
    full_moments: bool = False
    """Whether the GPU run's FusedAdam keeps Megatron-FSDP's Adam moments whole, gathered over
    TP and not sharded (Transformer Engine 2.10 and 2.11: config.versions.te_full_size_moments)."""

    @property
    def mixed(self) -> bool:
        """Whether dense and MoE layers are mixed (chunks differ by where they start)."""
        return self.dense is not None

    @property
    def workspace_bytes(self) -> int:
        """GPU workspaces every process keeps (the largest any of its layers' kernels needs)."""
        return max(self.main.workspace_bytes, self.dense.workspace_bytes if self.dense else 0)

    def model(self, moe: bool) -> VariantModel:
        """The fitted model of an MoE layer (`moe`) or a dense one."""
        if self.dense is not None and not moe:
            return self.dense
        return self.main

    def chunks(
        self, starts: tuple[int, ...] | None, counts: tuple[int, ...]
    ) -> list[tuple[bool, ...]]:
        """Layers.chunk of each of a rank's chunks (`starts` None: layers of one kind)."""
        if not self.mixed:
            moe = self.main.variant.moe is not None
            return [(moe,) * k for k in counts]
        at = starts or (None,) * len(counts)
        return [self.chunk(a, k) for a, k in zip(at, counts)]

    def chunk(self, start: int | None, k: int) -> tuple[bool, ...]:
        """Per layer of a chunk of `k` layers from layer `start`, whether it is an MoE layer."""
        if not self.mixed:
            return (self.main.variant.moe is not None,) * k
        if start is None:
            raise ValueError("a chunk of a model mixing dense and MoE layers needs its start")
        return self.pattern[start : start + k]


def mixed_layers(shape: ModelShape) -> bool:
    """Whether `shape` mixes dense and MoE transformer layers (--moe-layer-freq)."""
    return shape.moe.enabled and not all(shape.moe_layers)


def variant_of(shape: ModelShape, plan: ParallelPlan) -> Variant:
    """The categorical settings of the model's own layers (its MoE layers' with experts)."""
    moe = experts_probe(shape, plan)
    rc = plan.recompute
    return Variant.of(shape, rc.granularity, plan.sequence_parallel, moe, plan.cp, rc.modules)


def variants_of(shape: ModelShape, plan: ParallelPlan) -> tuple[Variant, ...]:
    """Every variant a (shape, plan) needs: the model's, and for mixed layers the dense layers'."""
    main = variant_of(shape, plan)
    if not mixed_layers(shape):
        return (main,)
    rc = plan.recompute
    return main, Variant.of(
        shape, rc.granularity, plan.sequence_parallel, None, plan.cp, rc.modules
    )


def sizes_for(shape: ModelShape, plan: ParallelPlan) -> Sizes:
    """Regression sizes of a (shape, plan): those of the model's own probe shape."""
    return shape_sizes(ProbeShape.of(shape, plan.tp, plan.micro_batch_size))


def find_variant(model: MemoryModel, variant: Variant) -> VariantModel:
    """The fitted VariantModel, or a CaptureError naming what is missing."""
    for vm in model.variants:
        if vm.variant == variant:
            return vm
    have = (
        "; ".join(
            f"{v.variant.dtype}/{v.variant.recompute}/sp={v.variant.sequence_parallel}"
            for v in model.variants
        )
        or "none"
    )
    raise CaptureError(
        f"the {model.device} memory model has no fit for {variant.dtype}, recompute "
        f"{variant.recompute}, sequence parallel {variant.sequence_parallel}, swiglu "
        f"{variant.swiglu}, {variant.normalization}, {variant.position_embedding_type}, dropout "
        f"{variant.dropout}, untied {variant.untied}, geglu {variant.geglu}, qkv bias "
        f"{variant.add_qkv_bias}, window {variant.window_size or 'none'}, experts "
        f"{'yes' if variant.moe else 'no'} (fitted: {have}); profile that variant"
    )


def probed_alone(vm: VariantModel) -> int | None:
    """The one micro-batch size a variant was probed at, or None when it was probed at several
    (a fit of one size holds its activations as constants: it predicts no other size)."""
    seen = [(lo, hi) for name, lo, hi in vm.ranges if name == "b"]
    return seen[0][0] if seen and seen[0][0] == seen[0][1] else None


def micro_batch_problem(model: MemoryModel, shape: ModelShape, plan: ParallelPlan) -> str:
    """Why `model` cannot forecast `plan`'s micro-batch size, or '': a variant probed at a single
    micro-batch size fits its activations as constants, so another size would be predicted as that
    one's (a GPU model fitted at micro-batch 4 forecast micro-batch 1 full recompute 10% high)."""
    b = plan.micro_batch_size
    for v in variants_of(shape, plan):
        alone = probed_alone(find_variant(model, v))
        if alone is not None and alone != b:
            return (
                f"the memory model's recompute-{v.recompute} fit was probed at micro-batch "
                f"{alone} only, so micro-batch {b} would be predicted as if it were {alone}: "
                "profile this micro-batch size too (or drop --memory-model to profile on the spot)"
            )
    return ""


def single_micro_batches(
    model: MemoryModel, granularities: tuple[str, ...] = ("none", "selective", "full")
) -> dict[int, tuple[str, ...]]:
    """The micro-batch sizes at which some of `model`'s variants of these recompute
    `granularities` were probed alone (probed_alone), each with those variants' recompute
    settings (empty when every such variant was probed at several sizes)."""
    out: dict[int, tuple[str, ...]] = {}
    for vm in model.variants:
        alone = probed_alone(vm)
        if alone is not None and vm.variant.recompute in granularities:
            out[alone] = (*out.get(alone, ()), f"recompute-{vm.variant.recompute}")
    return dict(sorted(out.items()))


def layers_for(model: MemoryModel, shape: ModelShape, plan: ParallelPlan) -> Layers:
    """The fitted models a (shape, plan) is predicted from (a CaptureError when one is missing)."""
    found = [find_variant(model, v) for v in variants_of(shape, plan)]
    measured, cpu = not model.device.startswith("fake"), model.device == "cpu"
    foreach = not cpu and "/torch-adam" in model.kernels
    full = plan.ddp.fsdp.enabled and not cpu and not foreach and versions.te_full_size_moments()
    pattern = shape.moe_layers if len(found) > 1 else ()
    return Layers(
        found[0],
        found[1] if len(found) > 1 else None,
        pattern,
        step_measured=measured,
        torch_adam=cpu,
        foreach_adam=foreach,
        full_moments=full,
    )
