"""The physically meaningful regression terms memory is fitted on (pure Python).

b micro-batch, s sequence, h hidden, a heads, g query groups, d head width, f MLP width,
V padded vocabulary, t tensor-parallel size. Activations scale with b*s*(width)/t (or without /t for
tensors every TP rank holds whole, e.g. norms without SP) and b*a*s^2/t (attention scores);
parameters with h^2/t, h*f/t, V*h/t, h.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sizes:
    """The sizes terms are evaluated at."""

    b: int
    """Micro-batch size."""
    s: int
    """Sequence length."""
    h: int
    """Hidden size."""
    a: int
    """Attention heads."""
    g: int
    """Query groups."""
    d: int
    """Head width (kv channels)."""
    f: int
    """MLP width (the up-projection's output per gate: ffn hidden size)."""
    V: int
    """Padded vocabulary."""
    t: int
    """Tensor-parallel size."""


ACTIVATION_TERMS = {
    "1": lambda z: 1.0,
    "b*s": lambda z: z.b * z.s,
    "b*s*h": lambda z: z.b * z.s * z.h,
    "b*s*h/t": lambda z: z.b * z.s * z.h / z.t,
    "b*s*a*d/t": lambda z: z.b * z.s * z.a * z.d / z.t,
    "b*s*g*d/t": lambda z: z.b * z.s * z.g * z.d / z.t,
    "b*s*f/t": lambda z: z.b * z.s * z.f / z.t,
    "b*a*s^2/t": lambda z: z.b * z.a * z.s * z.s / z.t,
    "b*s*V/t": lambda z: z.b * z.s * z.V / z.t,
    "s*d": lambda z: z.s * z.d,
    "s*s": lambda z: z.s * z.s,
}
# With one sequence per micro-batch and one query group per TP rank, torch's reshape of the fused
# QKV output into the query is a view instead of a copy under GQA, so the saved query keeps the
# whole fused [s, b, (a + 2g) d / t] storage alive: 2 g d / t more elements per token (measured;
# MEMORY_MODEL.md).
ACTIVATION_TERMS["[b=1,g=t<a]*b*s*g*d/t"] = lambda z: (
    z.b * z.s * z.g * z.d / z.t if z.b == 1 and z.g == z.t and z.g < z.a else 0.0
)
"""Terms for bytes that scale with the micro-batch (saved activations, transients)."""

PARAMETER_TERMS = {
    "1": lambda z: 1.0,
    "h": lambda z: z.h,
    "h*h": lambda z: z.h * z.h,
    "h*a*d/t": lambda z: z.h * z.a * z.d / z.t,
    "h*g*d/t": lambda z: z.h * z.g * z.d / z.t,
    "h*f/t": lambda z: z.h * z.f / z.t,
    "a*d/t": lambda z: z.a * z.d / z.t,
    "g*d/t": lambda z: z.g * z.d / z.t,
    "f/t": lambda z: z.f / z.t,
    "V*h/t": lambda z: z.V * z.h / z.t,
    "s*h": lambda z: z.s * z.h,
}
"""Terms for parameter element counts (per parameter tensor)."""

STEP_TERMS = {
    "1": lambda z: 1.0,
    "h*f/t": lambda z: z.h * z.f / z.t,
    "h*a*d/t": lambda z: z.h * z.a * z.d / z.t,
    "h*g*d/t": lambda z: z.h * z.g * z.d / z.t,
    "V*h/t": lambda z: z.V * z.h / z.t,
    "h*h": lambda z: z.h * z.h,
    "s*h": lambda z: z.s * z.h,
}
"""Terms for the optimizer step's temporaries (per-tensor Adam on CPU scales with the largest
tensors)."""

BUFFER_TERMS = {
    **ACTIVATION_TERMS,
    **{k: v for k, v in PARAMETER_TERMS.items() if k not in ACTIVATION_TERMS},
}
"""Terms for persistent buffers: Megatron's global buffers (activation-sized: attention scores,
sequence-parallel gathers) and TE's dummy weight gradients (parameter-sized)."""

TERM_SETS = {
    "activation": ACTIVATION_TERMS,
    "parameter": PARAMETER_TERMS,
    "step": STEP_TERMS,
    "buffer": BUFFER_TERMS,
}

TRANSIENT_TERMS = {
    **ACTIVATION_TERMS,
    **{k: v for k, v in PARAMETER_TERMS.items() if k not in ACTIVATION_TERMS},
    "s": lambda z: z.s,
    "b*s*s": lambda z: z.b * z.s * z.s,
    "b*s/t": lambda z: z.b * z.s / z.t,
    "s/t": lambda z: z.s / z.t,
}
"""Terms for one temporary tensor (capture_megatron.fit.timelines.events): activations,
parameter-sized weight gradients before they are added into the gradient buffer, and per-token
statistics (norms)."""
