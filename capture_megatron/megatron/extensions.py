"""Which fused kernels a run on a real GPU asks for and whether this machine has them: megatron-core
imports compiled extensions (apex's, Megatron-LM's, Transformer Engine's) deep inside the model
build or the first forward, so a missing one is found here first and refused in one paragraph."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from capture_megatron.config import Kernels

_SOFTMAX, _WGRAD = "masked_softmax_fusion", "gradient_accumulation_fusion"
EXTENSIONS_LOCAL = (
    (_SOFTMAX, "scaled_masked_softmax_cuda", "--no-masked-softmax-fusion"),
    (_SOFTMAX, "scaled_upper_triang_masked_softmax_cuda", "--no-masked-softmax-fusion"),
    (_WGRAD, "fused_weight_gradient_mlp_cuda", "--no-gradient-accumulation-fusion"),
    ("rope_fusion", "transformer_engine", "--no-rope-fusion"),
)
"""(Kernels field, the compiled module megatron-core imports for it under the local spec, the flag
that turns it off): Megatron's fused softmax and apex's fused weight-gradient accumulation are
CUDA extensions built with Megatron-LM or apex, the fused RoPE is Transformer Engine's
(megatron-core 0.16.1: fusions/fused_softmax.py, tensor_parallel/layers.py, TransformerConfig).
Megatron-LM's defaults ask for all three. Under Transformer Engine's spec, TE brings its own."""
EXTENSIONS_ANY = (
    ("cross_entropy_loss_fusion", "transformer_engine", "--cross-entropy-fusion-impl native"),
    ("moe_permute_fusion", "transformer_engine", "no --moe-permute-fusion"),
    ("moe_router_fusion", "transformer_engine", "no --moe-router-fusion"),
)
"""The same for fused kernels only Transformer Engine has, whatever the spec (the fused cross
entropy only with --cross-entropy-fusion-impl te)."""


def missing_extensions(
    kernels: Kernels, impl: str, find: Callable[[str], bool] | None = None
) -> list[str]:
    """What a run on a real GPU with `kernels` under `impl` needs but this machine lacks: one
    "MODULE(S) not installed (give FIX)" per flag that would avoid them, [] when all are there.
    `find` (module name -> found?) defaults to importlib's find_spec."""
    import importlib.util

    def found(module: str) -> bool:
        return find(module) if find else importlib.util.find_spec(module) is not None

    needs = [*(EXTENSIONS_LOCAL if impl == "local" else ()), *EXTENSIONS_ANY]
    te_entropy = kernels.cross_entropy_fusion_impl == "te"
    by_fix: dict[str, list[str]] = {}
    for field, module, fix in needs:
        asked = getattr(kernels, field) and (field != "cross_entropy_loss_fusion" or te_entropy)
        if asked and not found(module):
            by_fix.setdefault(fix, []).append(module)
    return [f"{' and '.join(mods)} not installed (give {fix})" for fix, mods in by_fix.items()]


FUSED_ADAM = ("transformer_engine", "apex.optimizers")
"""The modules whose FusedAdam megatron-core's optimizer imports, in its order (megatron-core
0.16.1 optimizer/__init__.py: TE's, else apex's, else torch.optim.AdamW); apex by its optimizers
package (PyPI's `apex` is another project)."""


def found_module(module: str) -> bool:
    """Whether `module` can be imported here (False when a parent package is missing)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package missing
        return False


def adam_impl(kernels: Kernels, find: Callable[[str], bool] | None = None) -> str:
    """The Adam a run on this GPU machine trains with (Kernels.adam_impl resolved: fused when TE
    or apex is installed, else torch); CaptureError when --adam-impl asks for the other one,
    which megatron-core's import order would not give."""
    from capture_megatron.errors import CaptureError

    installed = [m for m in FUSED_ADAM if (find or found_module)(m)]
    have = "fused" if installed else "torch"
    if kernels.adam_impl not in ("auto", have):
        why = (
            f"{installed[0].split('.')[0]} is installed, so megatron-core trains with its FusedAdam"
            if installed
            else "neither Transformer Engine nor apex is installed, so megatron-core trains with "
            "torch.optim.AdamW"
        )
        raise CaptureError(
            f"--adam-impl {kernels.adam_impl}: {why}; give --adam-impl {have} (or leave it out)."
        )
    return have


def gpu_kernels(kernels: Kernels, impl: str, find: Callable[[str], bool] | None = None) -> Kernels:
    """The kernels a training run or a probe on a real GPU builds with: `impl` (resolve_impl),
    the Adam installed (adam_impl) and the fused kernels asked for; one CaptureError naming every
    fused kernel whose extension is missing (megatron-core would raise inside the model build, or
    at the first forward)."""
    from capture_megatron.errors import CaptureError

    kernels = dataclasses.replace(kernels, adam_impl=adam_impl(kernels, find))
    missing = missing_extensions(kernels, impl, find)
    if missing:
        raise CaptureError(
            f"the fused kernels these flags ask for under --transformer-impl {impl} are not all "
            f"installed on this machine: {'; '.join(missing)}. Megatron-LM's defaults turn them "
            "on; install Transformer Engine / apex / Megatron-LM's fused kernels, or give the "
            "flags named."
        )
    return dataclasses.replace(kernels, transformer_impl=impl)
