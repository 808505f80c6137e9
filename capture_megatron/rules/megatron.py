"""What Megatron-LM and megatron-core refuse of a model, a plan and the run's options, one
sentence per rule with the assert or check it comes from (core_v0.16.1). Pure Python.

check_plan_fits_model gathers every rule between a ModelShape and a ParallelPlan (the planner's
search skips the plans it refuses; predict and train refuse them with the reasons); the others are
the rules of single features: expert and context parallelism, multi-token prediction (MTP's
placement, and the checkpoint megatron-core cannot write), the EP all-to-all overlap
(--overlap-moe-expert-parallel-comm: megatron-core's TransformerConfig __post_init__; PP > 1 needing
virtual stages is DdpOptions.plan_problems), selective recompute modules, the flex token dispatcher
(DeepEP / HybridEP), the precision-aware optimizer's gradient dtype, and fine-grained and
layer-level activation offloading (--fine-grained-activation-offloading,
--cpu-offloading-num-layers; --offload-modules and --min-offloaded-tensor-size are read only with
the first, so alone they change nothing).
"""

from __future__ import annotations

from capture_megatron.config.ddp import DdpOptions
from capture_megatron.config.model import ModelShape, tp_head_problems
from capture_megatron.config.parallel import ParallelPlan
from capture_megatron.errors import require
from capture_megatron.features.dispatch import DEEPEP_GROUPS
from capture_megatron.features.fsdp import Fsdp
from capture_megatron.features.moe import Experts
from capture_megatron.features.optimizers import Optimizer
from capture_megatron.rules.flags import cuda_graph_model_problems


def check_plan_fits_model(shape: ModelShape, plan: ParallelPlan) -> None:
    """Raise a CaptureError naming every way `plan` cannot run `shape` in Megatron."""
    p = tp_head_problems(shape.num_attention_heads, shape.groups, plan.tp)
    if shape.ffn % plan.tp:
        p.append(f"ffn hidden {shape.ffn} not divisible by TP {plan.tp}")
    if plan.num_layers != shape.num_layers:
        p.append(
            f"layout {plan.layout!r} places {plan.num_layers} layers but --num-layers is "
            f"{shape.num_layers}"
        )
    if plan.sequence_parallel and shape.seq_length % plan.tp:
        p.append(
            f"seq length {shape.seq_length} not divisible by TP {plan.tp} for sequence parallel"
        )
    for r in range(plan.pp):
        for n in plan.chunks_of(r) if plan.recompute.granularity == "full" else ():
            if plan.recompute.method == "uniform" and n % max(plan.recompute.layers_on(r), 1):
                p.append(
                    f"uniform recompute of {plan.recompute.layers_on(r)} does not divide {n} layers"
                )
    p += expert_problems(shape, plan) + context_problems(shape, plan) + mtp_problems(shape, plan)
    p += module_problems(shape, plan.recompute.selected)
    p += dtype_problems(plan.ddp, shape.dtype) + moe_overlap_problems(shape, plan)
    p += cuda_graph_problems(shape, plan)
    p += optimizer_problems(shape, plan)
    require(p, "plan for this model")


def optimizer_problems(shape: ModelShape, plan: ParallelPlan) -> list[str]:
    """What megatron-core and Megatron-LM refuse of the plan's optimizer and Megatron-FSDP
    (features.optimizers, features.fsdp) with its other settings."""
    ddp, aware = plan.ddp, plan.ddp.use_precision_aware_optimizer
    p = optimizer_settings_problems(ddp.optimizer, shape.dtype, plan.distributed_optimizer,
                                    ddp.overlap_grad_reduce, ddp.fsdp.enabled, aware)  # fmt: skip
    instances = ddp.num_distributed_optimizer_instances
    moved = ddp.optimizer_cpu_offload
    return p + fsdp_problems(ddp.fsdp, aware, moved, instances, plan.ep > 1)


def expert_problems(shape: ModelShape, plan: ParallelPlan) -> list[str]:
    """Why Megatron cannot split `shape`'s experts as `plan` says (empty: it can)."""
    moe = shape.moe
    if not moe.enabled:
        return (
            [f"EP {plan.ep} needs --num-experts (the model has no experts)"] if plan.ep > 1 else []
        )
    p = []
    if moe.num_experts % plan.ep:
        fits = [e for e in range(1, moe.num_experts + 1) if moe.num_experts % e == 0]
        p.append(
            f"experts {moe.num_experts} not divisible by EP {plan.ep} (EP can be one of "
            f"{', '.join(map(str, fits))})"
        )
    if shape.moe_ffn % plan.expert_tp:
        p.append(f"expert ffn hidden {shape.moe_ffn} not divisible by ETP {plan.expert_tp}")
    if plan.ep == 1 and plan.expert_tp != plan.tp:
        p.append(
            f"ETP {plan.expert_tp} differs from TP {plan.tp} with EP 1: megatron-core 0.16.1 "
            "treats expert weights as ordinary data-parallel weights unless EP > 1 "
            "(tensor_parallel/layers.py marks them allreduce=True), so their gradients are "
            "reduced over the wrong ranks (measured: TP 2 with ETP 1, and ETP 2 with TP 1, "
            "leave the single process's gradients from the first step); use EP > 1 or leave "
            "--expert-tensor-parallel-size at the TP size"
        )
    if plan.tp > 1 and not plan.sequence_parallel:
        p.append(
            f"MoE layers with TP {plan.tp} need --sequence-parallel (megatron-core refuses to "
            "train MoE with TP > 1 without it)"
        )
    return p


def context_problems(shape: ModelShape, plan: ParallelPlan) -> list[str]:
    """Why Megatron cannot split `shape`'s sequences over `plan`'s CP ranks (empty: it can)."""
    if plan.cp == 1:
        return []
    p = []
    if shape.seq_length % (2 * plan.cp):
        p.append(
            f"seq length {shape.seq_length} not divisible by 2 x CP {plan.cp} (causal context "
            "parallelism gives every CP rank two chunks)"
        )
    if plan.sequence_parallel and shape.seq_length % (2 * plan.cp * plan.tp):
        p.append(
            f"seq length {shape.seq_length} not divisible by 2 x CP {plan.cp} x TP {plan.tp} "
            "for sequence parallel"
        )
    return p


def mtp_problems(shape: ModelShape, plan: ParallelPlan) -> list[str]:
    """Why `plan` cannot run `shape`'s multi-token prediction layers as modelled (empty: it can):
    the plan must place the model's MTP layers; megatron-core asserts uniform recompute of one
    layer at a time on their stage, and then recomputes them (the probes recompute by the block
    method, under which megatron-core keeps the MTP layers' activations); context parallelism
    shifts MTP's tokens across CP ranks (not modelled).

    A last stage without decoder layers is forecast: megatron-core then puts the decoder's final
    norm on the stage holding the last decoder layer (TransformerBlock.
    has_final_layernorm_in_this_stage), as the last stage's zero-layer probe has it (no final
    norm). The stage before holds the norm's weight and what it saves of each micro-batch (its
    input, one hidden state, and fp32 statistics per token); that stage's forecast leaves them
    out (docs/MEMORY_MODEL.md, "Multi-token prediction")."""
    mtp = shape.mtp_num_layers
    p = []
    if plan.mtp_layers != mtp:
        p.append(f"the plan places {plan.mtp_layers} MTP layers but --mtp-num-layers is {mtp}")
    if not mtp:
        return p
    if plan.recompute.granularity == "full" and plan.recompute.method == "uniform":
        p.append(
            "--recompute-method uniform with --mtp-num-layers: megatron-core then recomputes the "
            "MTP layers too (and asserts --recompute-num-layers 1), which is not modelled; use "
            "--recompute-method block, under which it keeps their activations"
        )
    if plan.cp > 1:
        p.append(
            f"--context-parallel-size {plan.cp} with --mtp-num-layers is not modelled (MTP shifts "
            "tokens across the CP ranks); leave context parallelism out"
        )
    return p


def checkpoint_problem(shape: ModelShape, plan: ParallelPlan) -> str:
    """Why a checkpoint of `shape` trained as `plan` cannot be saved or loaded ('' when it can):
    with MTP layers, tied embeddings and PP > 1 megatron-core 0.16.1's GPTModel keeps an
    output-layer weight on the last stage (its forward computes the logits with the embedding copy
    MTP needs there), and LanguageModule.sharded_state_dict asserts that no such weight exists."""
    if not shape.mtp_num_layers or shape.untie_embeddings_and_output_weights or plan.pp == 1:
        return ""
    return (
        "--save / --load with --mtp-num-layers, tied embeddings and PP > 1: megatron-core 0.16.1 "
        "cannot checkpoint this model (its last stage keeps an output-layer weight that its "
        "sharded_state_dict asserts does not exist); give --untie-embeddings-and-output-weights, "
        "as MTP models (DeepSeek-V3) and Megatron-LM's MTP tests do, or train without checkpoints"
    )


_MC = "megatron-core's TransformerConfig"


def moe_overlap_problems(shape: ModelShape, plan: ParallelPlan) -> list[str]:
    """Why megatron-core refuses `plan` with --overlap-moe-expert-parallel-comm on `shape`, or
    why the forecast does not cover it (empty: it runs and is forecast, or the flag is off);
    --delay-wgrad-compute needs the overlap (TransformerConfig asserts it)."""
    if not plan.ddp.overlap_moe_expert_parallel_comm:
        if plan.ddp.delay_wgrad_compute:
            return [
                "--delay-wgrad-compute needs --overlap-moe-expert-parallel-comm (megatron-core's "
                "TransformerConfig: 'overlap_moe_expert_parallel_comm must be enabled when "
                "enabling delay_wgrad_compute'): give both, or leave it out"
            ]
        return []
    return _megatron_rules(shape, plan)


def _megatron_rules(shape: ModelShape, plan: ParallelPlan) -> list[str]:
    """What megatron-core asserts for the overlap (the flag's name and the rule it breaks)."""
    flag = "--overlap-moe-expert-parallel-comm"
    p = []
    if plan.ep == 1:
        p.append(f"{flag} needs expert parallelism, EP > 1 ({_MC})")
    dispatcher = shape.moe.moe_token_dispatcher_type
    if shape.moe.enabled and dispatcher not in ("alltoall", "flex"):
        p.append(
            f"{flag} needs --moe-token-dispatcher-type alltoall or flex, not {dispatcher} ({_MC})"
        )
    if plan.recompute.granularity == "full":
        p.append(f"{flag} does not allow full recomputation or a recompute method ({_MC})")
    if shape.dtype not in ("bf16", "fp16"):
        p.append(f"{flag} needs --bf16 or --fp16 ({_MC})")
    if shape.mtp_num_layers > 1 or (shape.mtp_num_layers == 1 and plan.pp == 1):
        p.append(f"{flag} allows one MTP layer, and only with PP > 1 ({_MC})")
    return p


def cuda_graph_problems(shape: ModelShape, plan: ParallelPlan) -> list[str]:
    """What Megatron-LM and megatron-core 0.16.1 refuse of `plan`'s CUDA graphs on `shape`
    (arguments.py; TransformerConfig.__post_init__), one sentence each with the change: the
    rules of rules.flags.cuda_graph_model_problems."""
    g, moe, rc = plan.ddp.cuda_graphs, shape.moe, plan.recompute
    if not g.enabled:
        return []
    layers = moe.pattern(shape.num_layers)
    return cuda_graph_model_problems(
        g,
        moe=(moe.enabled, bool(layers) and all(layers), plan.ep),
        routing=(moe.moe_expert_capacity_factor, moe.moe_pad_expert_input_to_capacity),
        alltoall=moe.moe_token_dispatcher_type == "alltoall",
        recompute=(rc.granularity, rc.selected),
        dropout=(shape.attention_dropout, shape.hidden_dropout),
        overlap=plan.ddp.overlap_moe_expert_parallel_comm,
    )


def module_problems(shape: ModelShape, chosen: tuple[str, ...]) -> list[str]:
    """Why megatron-core 0.16.1 refuses selective recompute of the modules `chosen` for `shape`
    (empty: it takes them)."""
    p = []
    if "moe_act" in chosen and not shape.moe.moe_grouped_gemm:
        p.append(
            "--recompute-modules moe_act needs --moe-grouped-gemm (megatron-core 0.16.1's "
            "TransformerConfig refuses it otherwise: only its grouped experts recompute the "
            "activation)"
        )
    if "mla_up_proj" in chosen and not shape.mla.enabled:
        p.append(
            "--recompute-modules mla_up_proj needs --multi-latent-attention (megatron-core "
            "0.16.1's TransformerConfig refuses it otherwise)"
        )
    return p


CPU_REFUSAL = (
    "--moe-token-dispatcher-type flex runs only on the GPU kernel set: it sends tokens through "
    "DeepEP or HybridEP, CUDA-only libraries; forecast it with the GPU kernel set (--device "
    "fake-cuda, the default without a GPU), or run on the CPU with --moe-token-dispatcher-type "
    "alltoall or allgather"
)
"""The CPU kernel set's refusal (one paragraph)."""


def flex_problems(
    moe: Experts, dtype: str, tp_ep: int, nvlink_domain: int, cpu: bool = False
) -> list[str]:
    """What megatron-core 0.16.1 (or HybridEP) refuses of a flex run, one sentence each: `tp_ep`
    the expert TP x EP group, `nvlink_domain` the GPUs that reach each other over NVLink, `cpu`
    the CPU kernel set. Empty unless the dispatcher is flex."""
    if not moe.enabled or moe.moe_token_dispatcher_type != "flex":
        return []
    if cpu:
        return [CPU_REFUSAL]
    p = []
    if tp_ep < 2:
        p.append(
            "the flex dispatcher needs expert TP x EP > 1 (MoEFlexTokenDispatcher asserts "
            "'Flex token dispatcher requires TPxEP > 1'); give --expert-model-parallel-size > 1 "
            "or use --moe-token-dispatcher-type alltoall"
        )
    if moe.moe_flex_dispatcher_backend == "deepep":
        padded = moe.moe_pad_expert_input_to_capacity
        return p + deepep_problems(tp_ep, dtype, moe.moe_deepep_num_sms, padded)
    if dtype == "fp32":
        p.append(
            "HybridEP moves 16-bit tokens only (combine_with_unpermute asserts a 2-byte element "
            "size, hybrid_ep.cu at DeepEP eb9cee7): give --bf16 or --fp16"
        )
    domain = min(tp_ep, nvlink_domain)
    if tp_ep >= 2 and tp_ep % domain:
        p.append(
            f"HybridEP needs the expert TP x EP group ({tp_ep} GPUs) to be whole NVLink domains "
            f"of {nvlink_domain} GPUs (HybridEPBuffer asserts it)"
        )
    return p


def dtype_problems(ddp: DdpOptions, dtype: str) -> list[str]:
    """What megatron-core refuses in these gradient and optimizer settings when training in
    `dtype`."""
    p = []
    if ddp.use_precision_aware_optimizer and ddp.grad_dtype(dtype) == "fp16":
        p.append(
            "--use-precision-aware-optimizer with fp16 gradient buffers: megatron-core's "
            "gradient clipping takes only fp32 or bf16 gradients from it (clip_grads.py); "
            "add --accumulate-allreduce-grads-in-fp32"
        )
    return p


def fsdp_problems(
    fsdp: Fsdp,
    precision_aware: bool,
    optimizer_offload: bool,
    instances: int,
    moe: bool,
) -> list[str]:
    """What megatron-core refuses, or this model does not cover, of Megatron-FSDP with these
    settings (empty: nothing)."""
    if not fsdp.enabled:
        return []
    name = "--use-megatron-fsdp"
    p = []
    if precision_aware or optimizer_offload:
        what = "--optimizer-cpu-offload" if optimizer_offload else ""
        what = what or "--use-precision-aware-optimizer"
        p.append(f"{name} with {what} is not modelled yet")
    if instances > 1 and moe:
        p.append(
            f"{name} with --num-distributed-optimizer-instances {instances} and routed "
            "experts: megatron-core 0.16.1's hybrid sharding builds no expert-data-parallel "
            "mesh (FullyShardedDataParallel._init_dist_index), and MegatronFSDP raises "
            "'Megatron Expert Parallelism is enabled, but no expt_dp_group is provided'"
        )
    return p


def optimizer_settings_problems(
    opt: Optimizer,
    dtype: str,
    distributed_optimizer: bool,
    overlap_grad_reduce: bool,
    fsdp: bool,
    precision_aware: bool,
) -> list[str]:
    """What megatron-core or Megatron-LM (core_v0.16.1) refuse of this optimizer with these
    settings (empty: nothing)."""
    name = f"--optimizer {opt.optimizer}"
    p = []
    if opt.optimizer == "sgd" and distributed_optimizer:
        p.append(
            f"{name} with --use-distributed-optimizer: megatron-core's DistributedOptimizer "
            "asserts 'Only Adam and HybridDeviceOptimizer currently supported'; leave out "
            "--use-distributed-optimizer"
        )
    if opt.optimizer == "sgd" and (fsdp or precision_aware):
        p.append(
            f"{name} with "
            + ("--use-megatron-fsdp" if fsdp else "--use-precision-aware-optimizer")
            + " is not modelled (megatron-core runs them with Adam)"
        )
    if not opt.muon:
        return p
    lm = f"{name}: Megatron-LM asserts Muon"
    if distributed_optimizer:
        p.append(f"{lm} without --use-distributed-optimizer ('muon with dist optimizer is "
                 "not supported'); leave it out")  # fmt: skip
    if overlap_grad_reduce:
        p.append(f"{lm} without --overlap-grad-reduce; leave it out")
    if fsdp:
        p.append(f"{lm} without --use-megatron-fsdp; leave it out")
    if dtype == "fp16":
        p.append(f"{name} with --fp16: megatron-core raises 'muon with fp16 is not supported'")
    return p


def deepep_problems(group: int, dtype: str, num_sms: int, padded: bool = False) -> list[str]:
    """What DeepEP eb9cee7 and megatron-core 0.16.1 refuse of a flex run on DeepEP (one sentence
    each, with the change that runs): its group sizes, bfloat16 tokens, an even SM count, padded
    expert inputs (`padded`)."""
    p = []
    if padded:
        p.append(
            "megatron-core 0.16.1 refuses DeepEP with padded expert inputs (TransformerConfig: "
            "'Flex token dispatcher with deepep backend does not support "
            "moe_pad_expert_input_to_capacity'): leave out --moe-pad-expert-input-to-capacity, "
            "or give --moe-flex-dispatcher-backend hybridep"
        )
    if group >= 2 and group not in DEEPEP_GROUPS:
        p.append(
            f"DeepEP runs expert TP x EP groups of {', '.join(map(str, DEEPEP_GROUPS))} GPUs "
            f"only, not {group} (Buffer.get_dispatch_config asserts 'Unsupported number of EP "
            "ranks', its kernels 'Unsupported ranks'): change --expert-model-parallel-size, or "
            "give --moe-flex-dispatcher-backend hybridep"
        )
    if dtype != "bf16":
        p.append(
            "DeepEP combines bfloat16 tokens only (its combine kernels assert CUDA_R_16BF): give "
            "--bf16, or --moe-token-dispatcher-type alltoall"
        )
    if num_sms % 2 or num_sms < 2:
        p.append(
            f"--moe-deepep-num-sms {num_sms}: DeepEP's kernels use two SMs per channel "
            "(they assert an even count): give an even number"
        )
    return p
