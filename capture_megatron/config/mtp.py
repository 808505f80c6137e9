"""What a plan must respect for a model with multi-token prediction (--mtp-num-layers), as
megatron-core 0.16.1 places and runs the MTP layers and as the memory model covers them (pure
Python; no torch import here)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from capture_megatron.config.model import ModelShape
    from capture_megatron.config.parallel import ParallelPlan


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
