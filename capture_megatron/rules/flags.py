"""What capture-megatron does with each of Megatron-LM's pretrain_gpt.py arguments (core_v0.16.1,
megatron_args.json, and those core_v0.19.0 added, megatron_args-0.19.json) that none of its own
option classes declares, keyed by the flag's first spelling: the table is data (flags.json, one
entry per flag, each version's with what it was checked against), this module its reader and the
rules that depend on the rest of a command line. Pure Python.

- IGNORED: cannot change a rank's peak of allocated bytes during training iterations (logging,
  paths, data, tokenizer, learning-rate schedules, checkpointing, evaluation, fault tolerance,
  inference-only and RL-only settings, kernels that keep the same tensors). Accepted and ignored.
  `--rampup-batch-size` is here too: the ramp only lowers the micro-batches per step, and the
  micro-batches a pipeline rank holds, min(pp - rank, micro-batches), never fall as they grow, so
  the run's peak is the one at the full --global-batch-size that is predicted.
  IGNORED_REASONS gives the reason of those whose kind does not say it (checked against
  megatron-core 0.16.1's code); RULES are ignored only where the rest of the line allows it
  (--no-position-embedding with RoPE, say), and refused or an error elsewhere.
- UNMODELLED: changes memory in a way the model does not cover yet; refused, with the reason, when
  given with a value other than Megatron-LM's default.
Routing details that choose which experts get tokens but not how many a forecast allows for
(top-k scaling, the expert-bias update rate -- its bias is E floats per layer --, the drop
policy, logging) are IGNORED; group-limited routing is the model's (features.moe: it decides how
many nodes DeepEP sends a token to).
Every argument is in exactly one of: our option classes, IGNORED, UNMODELLED
(tests/unit/test_megatron_policy.py checks the table is complete).

The rules of the command line itself follow the policy: what Megatron-LM's arguments.py asserts
across its flags (fine-grained and layer-level activation offloading, --delay-wgrad-compute,
--tp-comm-overlap; CUDA graphs against the model and plan, cuda_graph_model_problems, which
rules.megatron.cuda_graph_problems runs), and of the run's settings that are not the plan's
(Megatron-FSDP's and Muon's checkpoint formats and overlaps, read by capture_megatron.api.request).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

from capture_megatron.config.ddp import DdpOptions
from capture_megatron.features.activation_offload import OFFLOAD_MODULES, ActivationOffload
from capture_megatron.features.cuda_graphs import CudaGraphs
from capture_megatron.features.fsdp import Fsdp
from capture_megatron.features.optimizers import Optimizer

_TABLE = json.loads(resources.files("capture_megatron.rules").joinpath("flags.json").read_text())
"""flags.json: the flag policy's table."""
_VERSIONS = _TABLE["versions"].values()

IGNORED_PREFIXES = tuple(_TABLE["ignored_prefixes"])
"""Flags with these prefixes are IGNORED (unless UNMODELLED)."""
IGNORED = frozenset(flag for v in _VERSIONS for flag in v["ignored"])
"""Flags that cannot change the peak of allocated bytes in training iterations (flags.json: each
version's "ignored", with why in its "about")."""
IGNORED_REASONS: dict[str, str] = dict(_TABLE["ignored_because"])
"""Ignored flags whose reason is more than their kind (docs/MEGATRON_FLAGS.md lists it)."""

RULES = {
    "--no-position-embedding": (
        "ignored with --position-embedding-type rope: megatron-core's GPT embedding adds a "
        "position table only for learned_absolute and nothing in megatron-core reads "
        "add_position_embedding; without rope Megatron-LM stops ('--no-position-embedding is "
        "deprecated, use --position-embedding-type')"
    ),
    "--use-rotary-position-embeddings": (
        "ignored with --position-embedding-type rope, which it sets (deprecated); without it, "
        "refused: give --position-embedding-type rope"
    ),
}
"""Flags ignored only in the context stated (the rest of the command line decides); outside it
Megatron-LM stops, or the flag is refused. Applied by conditional_verdict."""


@dataclass(frozen=True)
class LineContext:
    """What the conditional rules read of the rest of a command line."""

    rope: bool
    """--position-embedding-type rope."""
    offload_modules: tuple[str, ...] = ()
    """--offload-modules (read with --fine-grained-activation-offloading)."""
    transformer_impl: str = "transformer_engine"
    """--transformer-impl."""
    cpu_offloading_layers: int = 0
    """--cpu-offloading-num-layers."""
    num_layers: int = 0
    """--num-layers (0: not given)."""
    pp: int = 1
    """--pipeline-model-parallel-size (1 when not given)."""
    recompute: str | None = None
    """--recompute-granularity (None or 'none': no recompute)."""


def conditional_verdict(flag: str, value: Any, line: LineContext) -> tuple[str, str] | None:
    """For a flag given with `value` on a line: None when no rule of the line applies (a flag of
    RULES is then ignored, any other keeps its own kind), else ('refused', why not modelled) or
    ('invalid', why Megatron-LM stops: the rules of RULES' flags and
    --fine-grained-activation-offloading's)."""
    if flag == "--no-position-embedding" and not line.rope:
        return "invalid", (
            "Megatron-LM stops: '--no-position-embedding is deprecated, use "
            "--position-embedding-type' (it is accepted only with --position-embedding-type rope)"
        )
    if flag == "--fine-grained-activation-offloading" and value:
        stops = megatron_stops(
            line.offload_modules, line.transformer_impl, line.cpu_offloading_layers
        )
        if stops:
            return "invalid", "Megatron-LM stops: " + "; ".join(stops)
    if flag == "--cpu-offloading-num-layers" and value:
        stops = layer_offload_stops(value, line.num_layers, line.pp, line.recompute)
        if stops:
            return "invalid", "Megatron-LM stops: " + "; ".join(stops)
    if flag == "--use-rotary-position-embeddings" and not line.rope:
        return "refused", "deprecated; give --position-embedding-type rope, which it means"
    return None


UNMODELLED: dict[str, str] = {
    flag: reason for v in _VERSIONS for reason, flags in v["unmodelled"].items() for flag in flags
}
"""Flags that change memory in ways not modelled: refused when not at Megatron-LM's default."""
UNMODELLED_PREFIXES: dict[str, str] = dict(_TABLE["unmodelled_prefixes"])
"""Flags with these prefixes are UNMODELLED, with the reason (mixture-of-experts options beyond
those the Experts class declares and those IGNORED)."""


def ignored(*spellings: str) -> bool:
    """Whether a Megatron-LM flag (any of its spellings) cannot change the training peak."""
    if unmodelled_reason(*spellings) is not None:
        return False
    named = IGNORED | set(IGNORED_REASONS) | set(RULES)
    return any(f in named or f.startswith(IGNORED_PREFIXES) for f in spellings)


def unmodelled_reason(*spellings: str) -> str | None:
    """Why a non-default value of a Megatron-LM flag (any of its spellings) is refused (None: it
    is not)."""
    for flag in spellings:
        if flag in UNMODELLED:
            return UNMODELLED[flag]
        explained = flag in IGNORED_REASONS or flag in RULES
        for prefix, reason in UNMODELLED_PREFIXES.items():
            if flag.startswith(prefix) and flag not in IGNORED and not explained:
                return reason
    return None


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


def activation_offload_problem(offload: ActivationOffload, kernel_set: str) -> str:
    """Why the kernel set (config.kernels.kernel_set) cannot run these fine-grained activation
    offloading settings ('' when it can): megatron-core hooks Transformer Engine's cpu_offload and
    needs CUDA streams."""
    if not offload.fine_grained_activation_offloading or kernel_set.startswith(
        "gpu:transformer_engine"
    ):
        return ""
    if kernel_set == "cpu":
        return (
            "--fine-grained-activation-offloading needs Transformer Engine, CUDA streams and "
            "pinned host memory (Megatron-LM requires --transformer-impl "
            "transformer_engine), which the CPU kernel set cannot run: predict it with the "
            "GPU kernel set (--device fake)"
        )
    return (
        "Megatron-LM stops: 'Fine-grained activation offloading is only supported with "
        "transformer_engine implementation' (arguments.py; it hooks Transformer Engine's "
        "cpu_offload): give --transformer-impl transformer_engine"
    )


def delay_wgrad_problem(ddp: DdpOptions, transformer_impl: str) -> str:
    """Megatron-LM's rule for --delay-wgrad-compute: Transformer Engine's layers ('' when met)."""
    if not ddp.delay_wgrad_compute or transformer_impl == "transformer_engine":
        return ""
    return (
        "Megatron-LM stops: 'Delaying wgrad compute is only supported with "
        "transformer_engine implementation' (arguments.py; --delay-wgrad-compute defers "
        "Transformer Engine's weight gradients): give --transformer-impl transformer_engine"
    )


TP_OVERLAP_FIX = "leave out --tp-comm-overlap"
"""The change tp_overlap_stops names first for a line Megatron-LM itself stops at (TP 1 or no
sequence parallelism): without the flag the line runs (bench/inputs.py applies it)."""


def tp_overlap_stops(tp: int, sp: bool) -> str:
    """Megatron-LM's rule for --tp-comm-overlap at TP `tp` with sequence parallelism `sp` (tp 0:
    not known yet; '' when it runs)."""
    if tp != 1 and sp:
        return ""
    return (
        "--tp-comm-overlap needs --sequence-parallel with --tensor-model-parallel-size > 1 "
        "(Megatron-LM asserts it: 'Tensor parallel communication/GEMM overlap can happen "
        "only when sequence parallelism is enabled', and turns sequence parallelism off at "
        f"TP 1), so Megatron-LM would not run this line either: {TP_OVERLAP_FIX}, or give "
        "--tensor-model-parallel-size > 1 with --sequence-parallel"
    )


def fsdp_run_problems(fsdp: Fsdp, ckpt_format: str, weight_hash_interval: bool) -> list[str]:
    """What Megatron-LM (core_v0.16.1 arguments.py) asserts of Megatron-FSDP among the run's
    settings that are not the plan's: --ckpt-format fsdp_dtensor, and no
    --check-weight-hash-across-dp-replicas-interval with optim_grads_params."""
    if not fsdp.enabled:
        return []
    p = []
    if ckpt_format != "fsdp_dtensor":
        p.append(
            f"--use-megatron-fsdp with --ckpt-format {ckpt_format}: Megatron-LM asserts 'Megatron "
            "FSDP only supports fsdp_dtensor checkpoint format'; give --ckpt-format fsdp_dtensor"
        )
    if weight_hash_interval and fsdp.strategy == "optim_grads_params":
        p.append(
            "--check-weight-hash-across-dp-replicas-interval with --data-parallel-sharding-"
            "strategy optim_grads_params: Megatron-LM asserts it is not supported; leave it out"
        )
    return p


def muon_run_problems(opt: Optimizer, overlap_param_gather: bool, ckpt_format: str) -> list[str]:
    """What Megatron-LM asserts of Muon among the run's settings that are not the plan's:
    --overlap-param-gather, and a checkpoint format other than torch or torch_dist."""
    if not opt.muon:
        return []
    lm = f"--optimizer {opt.optimizer}: Megatron-LM asserts Muon"
    p = [f"{lm} without --overlap-param-gather; leave it out"] if overlap_param_gather else []
    if ckpt_format not in ("torch", "torch_dist"):
        p.append(f"{lm} with --ckpt-format torch or torch_dist, not {ckpt_format}")
    return p


def cuda_graph_model_problems(
    g: CudaGraphs,
    moe: tuple[bool, bool, int],
    routing: tuple[float, bool],
    alltoall: bool,
    recompute: tuple[str, tuple[str, ...]],
    dropout: tuple[float, float],
    overlap: bool,
) -> list[str]:
    """What Megatron-LM and megatron-core 0.16.1 refuse of these graphs on a model and plan
    (rules.megatron.cuda_graph_problems): `moe` (has MoE layers, all layers
    are, EP), `routing` (capacity factor, padded), `alltoall` dispatcher, `recompute`
    (granularity, selective modules), `dropout` (attention, hidden), the EP `overlap`."""
    scope, p = g.scopes, []
    if g.impl == "local" and moe[2] > 1 and not g.moe_pad_experts_for_cuda_graph_inference:
        p.append(
            "Megatron-LM stops: '--moe-pad-experts-for-cuda-graph-inference must be set when "
            "using CUDA graphs with expert parallelism' (--cuda-graph-impl local): give it"
        )
    if scope & {"moe", "moe_router"} and not moe[0]:
        p.append("--cuda-graph-scope moe / moe_router needs MoE layers (megatron-core asserts it)")
    if "mlp" in scope and moe[1]:
        p.append(
            "--cuda-graph-scope mlp graphs dense layers, and every layer is an MoE layer "
            "(megatron-core asserts it): give moe_router or moe"
        )
    drop_pad = bool(routing[0]) and routing[1]
    if "moe" in scope and not drop_pad:
        p.append(
            "--cuda-graph-scope moe needs drop-and-pad routing (--moe-expert-capacity-factor "
            "with --moe-pad-expert-input-to-capacity; megatron-core asserts it): give "
            "moe_router"
        )
    if "moe_preprocess" in scope and not drop_pad and alltoall and routing[0]:
        p.append(
            "--cuda-graph-scope moe_preprocess with a capacity factor on the alltoall "
            "dispatcher: megatron-core refuses it (its preprocess copies counts to the host); "
            "leave it out"
        )
    return (
        p + _graph_recompute_problems(g, *recompute, *dropout) + _graph_overlap_problems(g, overlap)
    )


def _graph_recompute_problems(
    g: CudaGraphs, granularity: str, modules: tuple[str, ...], attention: float, hidden: float
) -> list[str]:
    """megatron-core's rules for recomputation inside graphed scopes."""
    scope, p = g.scopes, []
    whole = not scope or "full_iteration" in scope
    if granularity == "full" and scope != {"full_iteration"}:
        p.append(
            "full recompute with CUDA graphs needs --cuda-graph-scope full_iteration "
            "(megatron-core asserts it): use selective recompute, or no graphs"
        )
    if g.impl == "transformer_engine" and "moe" in modules and "moe_router" in scope:
        p.append(
            "--recompute-modules moe with --cuda-graph-scope moe_router on --cuda-graph-impl "
            "transformer_engine: megatron-core refuses it; leave one of them out"
        )
    if attention and (whole or "attn" in scope) and "core_attn" in modules:
        p.append(
            "attention dropout with the attention core recomputed inside a CUDA graph "
            "(megatron-core refuses it): give --attention-dropout 0 or leave core_attn out"
        )
    mlp = ((whole or "mlp" in scope) and "mlp" in modules) or (
        (whole or "moe" in scope) and "moe" in modules
    )
    if hidden and mlp:
        p.append(
            "hidden dropout with an MLP / MoE recomputed inside a CUDA graph (megatron-core "
            "refuses it): give --hidden-dropout 0 or leave mlp / moe out of "
            "--recompute-modules"
        )
    return p


def _graph_overlap_problems(g: CudaGraphs, overlap: bool) -> list[str]:
    """--overlap-moe-expert-parallel-comm with CUDA graphs (megatron-core's rule)."""
    bad = g.impl != "transformer_engine" or not g.scopes or g.scopes & {"moe", "mlp"}
    if overlap and bad:
        return [
            "CUDA graphs with --overlap-moe-expert-parallel-comm need --cuda-graph-impl "
            "transformer_engine and a scope without moe or mlp (megatron-core asserts 'CUDA "
            "graph scope on moe and mlp is not supported with "
            "overlap_moe_expert_parallel_comm')"
        ]
    return []
