"""Partition-independent weight initialisation.

Every parameter is drawn as the *whole* (unsharded) tensor from a generator seeded by its checkpoint
key and global layer index, and each rank keeps its own slice (the slice Megatron's sharded state
dict says it owns). The same seed therefore gives the same model under any TP/PP/VPP/layout, which
is what makes parallel runs comparable with a single process and lets a new plan start from the same
weights. Standard deviations follow Megatron: init_method_std for weights, scaled by 1/sqrt(2 *
num_layers) for the output projections of attention and MLP; norms 1, biases 0."""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from capture_megatron.config import ModelShape
from capture_megatron.config.training import BuildOptions

if TYPE_CHECKING:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.models.gpt import GPTModel

_SCALED = ("linear_proj.weight", "linear_fc2.weight")


def _sharded_tensors(sharded_dict: dict[str, Any]) -> Iterator[ShardedTensor]:
    """Yield every ShardedTensor of a model's sharded state dict, expanding factories."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    stack = list(sharded_dict.values())
    while stack:
        item = stack.pop()
        if isinstance(item, ShardedTensor):
            yield item
        elif isinstance(item, ShardedTensorFactory):
            built = item.build()
            stack.extend(
                built.values()
                if isinstance(built, dict)
                else built
                if isinstance(built, (list, tuple))
                else [built]
            )
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


def _full_value(
    key: str,
    shape: tuple[int, ...],
    seed: int,
    std: float,
    num_layers: int,
    device: torch.device | str,
) -> torch.Tensor:
    """The whole tensor for `key`, reproducible from (seed, key)."""
    if key.endswith("bias"):
        return torch.zeros(shape, device=device)
    if (
        key.endswith("norm_weight")
        or key.endswith("layernorm.weight")
        or key.endswith("norm.weight")
    ):
        return torch.ones(shape, device=device)
    if key.endswith(_SCALED):
        std = std / math.sqrt(2.0 * num_layers)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return torch.randn(shape, generator=gen, device=device) * std


def _state_dict(model: GPTModel) -> dict[str, Any]:
    """The model's sharded state dict. A last stage with multi-token prediction and tied
    embeddings (PP > 1) holds megatron-core 0.16.1's output-layer weight that its forward never
    uses (GPTModel allocates it unless the stage also holds the embedding, then computes the logits
    with the embedding copy MTP needs there), and LanguageModule.sharded_state_dict asserts that no
    such weight exists; the weight is left out here (keeping megatron's own initial values)."""

    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    if not getattr(model, "mtp_process", False):
        return model.sharded_state_dict()
    # GPTModel's MTP branch reads metadata['dp_cp_group'] without the default the base class gives
    metadata = ensure_metadata_has_dp_cp_group(None)
    if not (model.share_embeddings_and_output_weights and model.post_process) or model.pre_process:
        return model.sharded_state_dict(metadata=metadata)
    weight = model.output_layer.weight
    model.output_layer.weight = None  # type: ignore[assignment]  # put back below
    try:
        return model.sharded_state_dict(metadata=metadata)
    finally:
        model.output_layer.weight = weight


def init_weights(model: GPTModel, shape: ModelShape, opts: BuildOptions, seed: int) -> None:
    """Fill `model`'s parameters in place with the partition-independent initial values."""
    with torch.no_grad():
        for st in _sharded_tensors(_state_dict(model)):
            if st.data is None or st.data.dtype not in (
                torch.float32,
                torch.bfloat16,
                torch.float16,
            ):
                continue
            pre = st.prepend_axis_num
            layer_index = tuple(st.global_offset[:pre])
            key_seed = zlib.crc32(f"{seed}/{st.key}/{layer_index}".encode())
            full = _full_value(
                st.key,
                tuple(st.global_shape[pre:]),
                key_seed,
                opts.init_method_std,
                shape.num_layers,
                st.data.device,
            )
            local = st.data
            index = tuple(slice(o, o + n) for o, n in zip(st.global_offset[pre:], local.shape))
            local.copy_(full[index].to(local.dtype))
