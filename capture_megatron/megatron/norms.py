"""Norm layer for Megatron's local spec that also works with sequence parallelism.

Megatron's WrappedTorchNorm (the local spec's norm without apex) asserts ``not sequence_parallel``.
Under SP every TP rank normalises a different slice of the sequence, so the norm's gradients must be
all-reduced over the TP group; Megatron's finalize_model_grads does that for parameters carrying
``sequence_parallel=True``. This class builds torch's LayerNorm/RMSNorm and sets that attribute.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import TransformerConfig


class LocalNorm:
    """Factory with WrappedTorchNorm's signature returning torch.nn.LayerNorm or
    torch.nn.RMSNorm."""

    def __new__(  # type: ignore[misc]  # a factory: returns torch's norm, not a LocalNorm
        cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused: Any
    ) -> torch.nn.Module:
        """Build config's torch norm, its parameters marked with config.sequence_parallel."""
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(normalized_shape=hidden_size, eps=eps, dtype=config.params_dtype)
        for param in norm.parameters():
            # megatron-core's marker attribute on parameters (read by finalize_model_grads)
            param.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]
        return norm
