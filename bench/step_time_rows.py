"""The development rows of the step-time fit as the model sees them: each published H100 step
time (bench/data/step_times_h100_dev.json: dense; bench/data/step_times_h100_moe_dev.json:
mixture-of-experts) with the model, plan and run settings its own recipe config used
(bench/data/step_time_recipes.json). Used by bench/step_time.py and its test."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from capture_megatron.api.args import predict_parser
from capture_megatron.api.request import resolve_shape
from capture_megatron.config import DdpOptions, ModelShape, ParallelFlags, ParallelPlan
from capture_megatron.flags import parser as flags
from capture_megatron.flags.resolve import parallel_plan
from capture_megatron.steptime.settings import StepSettings

HERE = os.path.dirname(os.path.abspath(__file__))
DEV = os.path.join(HERE, "data", "step_times_h100_dev.json")
"""The development set: published H100 BF16 step times, each row with its source (its "about")."""
MOE_DEV = os.path.join(HERE, "data", "step_times_h100_moe_dev.json")
"""The mixture-of-experts development rows (DeepSeek-V3 on 512 and 1024 H100s), a copy of
../shared/step_times_h100_moe_dev.json with each row's source."""
RECIPES = os.path.join(HERE, "data", "step_time_recipes.json")
"""What each row's recipe config says (read from the row's sources)."""
SETTINGS = (
    "tp_comm_overlap",
    "overlap_grad_reduce",
    "overlap_param_gather",
    "deterministic",
    "moe_permute_fusion",
    "moe_shared_expert_overlap",
)
FAMILIES = {
    "gpt3-175b": "GPT-3",
    "llama3.1-8b": "Llama 3.1",
    "llama3.1-70b": "Llama 3.1",
    "llama3.1-405b": "Llama 3.1",
    "mlm-7b": "Megatron-LM 7B",
    "deepseek-v3": "DeepSeek-V3 (MoE)",
}
"""The model family of each model (leave-one-family-out holds out each family)."""


@dataclass(frozen=True)
class Row:
    """One measured step with what the model needs to estimate it."""

    id: str
    """The row's id in the development set."""
    model: str
    """Model (leave-one-model-out holds each out)."""
    family: str
    """Model family (leave-one-family-out holds each out: the Llama 3.1 sizes together)."""
    moe: bool
    """Whether the model has mixture-of-experts layers."""
    measured: float
    """Published seconds per step."""
    shape: ModelShape
    """The model."""
    plan: ParallelPlan
    """Sizes, batch, layout (Megatron's split with the recipe's flags)."""
    settings: StepSettings
    """Overlap and precision of the run."""
    src: str
    """Where the step time was published."""
    recipe: str
    """Where the run's settings were read."""


def _recipe(recipes: dict, row_id: str) -> dict:
    """The row's recipe: by its id, else by the id without its GPU count."""
    return recipes.get(row_id) or recipes[row_id.rsplit("-", 1)[0]]


def _argv(row: dict, recipe: dict, model_flags: list[str]) -> list[str]:
    argv = [*model_flags, *recipe.get("model_flags", ())]
    vpp = recipe.get("vpp", row["vpp"])
    argv += [
        "--tensor-model-parallel-size", str(row["tp"]),
        "--pipeline-model-parallel-size", str(row["pp"]),
        "--context-parallel-size", str(row["cp"]),
        "--expert-model-parallel-size", str(row.get("ep", 1)),
        "--micro-batch-size", str(row["mbs"]),
        "--global-batch-size", str(row["gbs"]),
        "--gpus", str(row["n"]),
    ]  # fmt: skip
    if row.get("etp"):
        argv += ["--expert-tensor-parallel-size", str(row["etp"])]
    if recipe.get("first_last_layers") == "64/pp":  # NeMo's DeepSeek-V3 performance recipe
        middle = 64 // row["pp"]
        argv += [
            "--decoder-first-pipeline-num-layers", str(middle - 1),
            "--decoder-last-pipeline-num-layers", str(middle - 2),
        ]  # fmt: skip
    if vpp > 1:
        argv += ["--num-virtual-stages-per-pipeline-rank", str(vpp)]
    if recipe.get("sequence_parallel", row.get("sequence_parallel")):
        argv.append("--sequence-parallel")
    if recipe.get("distributed_optimizer"):
        argv.append("--use-distributed-optimizer")
    if recipe.get("grad_reduce_in_bf16"):
        argv.append("--grad-reduce-in-bf16")
    split = recipe.get(
        "account_for_embedding_and_loss_in_split",
        row.get("account_for_embedding_and_loss_in_split"),
    )
    if split:
        argv += [
            "--account-for-embedding-in-pipeline-split",
            "--account-for-loss-in-pipeline-split",
        ]
    return argv


def rows(moe: bool = True) -> list[Row]:
    """Every development row (the mixture-of-experts ones too unless `moe` is False), with its
    recipe's settings."""
    with open(DEV) as f:
        dev = json.load(f)
    with open(MOE_DEV) as f:
        moe_dev = json.load(f)
    with open(RECIPES) as f:
        recipes = json.load(f)["recipes"]
    flags_of = {**dev["model_flags"], **moe_dev["model_flags"]}
    out = []
    for row in dev["rows"] + (moe_dev["rows"] if moe else []):
        recipe = _recipe(recipes, row["id"])
        argv = _argv(row, recipe, flags_of[row["model"]])
        ns = flags.parse_flags(predict_parser(), argv)
        shape, _ = resolve_shape(ns)
        ddp = flags.from_namespace(DdpOptions, ns)
        plan = parallel_plan(flags.from_namespace(ParallelFlags, ns), shape, row["n"], ddp)
        settings = StepSettings(**{k: recipe[k] for k in SETTINGS if k in recipe})
        out.append(
            Row(
                row["id"],
                row["model"],
                FAMILIES.get(row["model"], row["model"]),
                shape.moe.enabled,
                row["measured_step_seconds"],
                shape,
                plan,
                settings,
                row["src"],
                recipe["src"],
            )  # fmt: skip
        )
    return out
