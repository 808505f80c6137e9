"""Megatron-LM's fine-grained activation offloading flags (core_v0.16.1): where Megatron-LM and
megatron-core stop. Pure Python. The settings are config.act_offload.ActivationOffload; the
forecast capture_megatron.forecast.offload.

`--fine-grained-activation-offloading` turns on megatron-core's
`pipeline_parallel/fine_grained_activation_offload.py`; `--offload-modules` and
`--min-offloaded-tensor-size` are read only with it (every call site tests
`config.fine_grained_activation_offloading` first), so alone they change nothing.
"""

from __future__ import annotations

from capture_megatron.config.act_offload import OFFLOAD_MODULES


def megatron_stops(modules: tuple[str, ...], transformer_impl: str, cpu_layers: int) -> list[str]:
    """Why Megatron-LM core_v0.16.1 stops at --fine-grained-activation-offloading with these
    --offload-modules, --transformer-impl and --cpu-offloading-num-layers (empty: it runs)."""
    why = []
    if transformer_impl != "transformer_engine":
        why.append(
            "'Fine-grained activation offloading is only supported with transformer_engine "
            "implementation' (arguments.py; it hooks Transformer Engine's cpu_offload)"
        )
    if cpu_layers > 0:
        why.append(
            "'fine_grained_activation_offloading cannot be enabled with cpu_offloading' "
            "(--cpu-offloading-num-layers turns cpu_offloading on)"
        )
    if not modules:
        why.append("TransformerConfig asserts --offload-modules names at least one module")
    unknown = sorted(set(modules) - set(OFFLOAD_MODULES))
    if unknown:
        why.append(
            f"'Invalid choices for offload_modules: {unknown}' (allowed: "
            + ", ".join(OFFLOAD_MODULES)
            + ")"
        )
    if "attn_proj" in modules and "core_attn" not in modules:
        why.append(
            "'attn_proj cannot be set to offload_modules alone without core_attn' (its input is "
            "core_attn's output, which core_attn's backward needs)"
        )
    return why


_TC = "megatron-core 0.16.1 transformer/transformer_config.py"


def layer_offload_stops(layers: int, num_layers: int, pp: int, recompute: str | None) -> list[str]:
    """Why Megatron-LM core_v0.16.1 stops at --cpu-offloading-num-layers `layers` (> 0; it sets
    cpu_offloading, arguments.py:1236-1237) on a line of `num_layers` layers (0: not given), `pp`
    pipeline stages and --recompute-granularity `recompute` (empty: it runs; with
    --fine-grained-activation-offloading, megatron_stops says why)."""
    why = []
    if num_layers and not 0 <= layers < num_layers:
        why.append(
            f"'CPU offloading can be done only for layers less than {num_layers}' ({_TC}:1137-1142)"
        )
    if pp > 1:
        why.append(
            "'Currently there is no support for Pipeline parallelism with CPU offloading' "
            f"(PP {pp}; {_TC}:1144-1147)"
        )
    if recompute not in (None, "none"):
        why.append(
            "'CPU offloading does not work when activation recomputation is enabled' "
            f"(--recompute-granularity {recompute}; {_TC}:1149-1152)"
        )
    return why
