"""megatron-core's calls whose signature or behaviour differs between the supported series
(0.16.1 through 0.19.x, capture_megatron.config.versions): the adapter's one place for them.

Each function names the series where megatron-core changed; the rest of the adapter, profile/ and
train/ call these instead of megatron-core directly where it differs.
"""

from __future__ import annotations

from typing import Any

from capture_megatron.config import versions


def backward_step(input_tensor: Any, output: Any, output_grad: Any, config: Any) -> Any:
    """megatron-core's pipeline backward_step: 0.16 takes a model_type (unused for GPT, None
    here) before the config; 0.17 dropped it."""
    from megatron.core.pipeline_parallel import schedules

    if versions.current() == versions.V0_16:
        return schedules.backward_step(input_tensor, output, output_grad, None, config)
    return schedules.backward_step(input_tensor, output, output_grad, config)


def mla_q_norm_needs_lora() -> bool:
    """Whether megatron-core refuses a query layernorm in MLA's spec without a query LoRA rank
    (0.19's MLASelfAttention: "`q_layernorm` is non-trivial, but `q_lora_rank is None`"); 0.16
    builds it and never calls it."""
    return versions.current() >= versions.V0_19


def offload_group_end() -> str:
    """The name of the fine-grained activation-offloading interface's call that ends a group:
    0.16's static ``group_commit(tensor, name, forced_released_tensors)``, 0.17's method
    ``group_offload(tensor, forced_released_tensors, delay_offload)`` (the group's name is the
    interface's)."""
    return "group_commit" if versions.current() == versions.V0_16 else "group_offload"
