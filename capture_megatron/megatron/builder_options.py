"""How a model is built beyond its shape and plan (torch-free, so the planner can import it)."""
from __future__ import annotations

from dataclasses import dataclass

from capture_megatron.serial import JsonMixin


@dataclass(frozen=True)
class BuildOptions(JsonMixin):
    """How the model is built beyond its shape and plan."""

    transformer_impl: str = "auto"
    """local, transformer_engine, or auto (TE when importable and CUDA is in use)."""
    init_method_std: float = 0.02
    """Standard deviation of the normal weight initialisation (--init-method-std)."""
    seed: int = 1234
    """Seed of the partition-independent weight initialisation (--seed)."""
    layernorm_epsilon: float = 1e-5
    """Norm epsilon (--norm-epsilon)."""
    rotary_base: int = 10000
    """RoPE base (--rotary-base)."""
