"""The flags the planning commands and the API read: the cluster and the model source, the model,
kernel and parallel flags, PlanOptions, and the rest of a Megatron-LM pretrain_gpt.py command line
(every flag, each ignored when it cannot change memory, else refused: capture_megatron.flags.
megatron_lm). `plan_parser` and `predict_parser` build the parsers the API parses a flags list
with; the command line passes its help text (usage, example, essential flags) to the same
builders. Pure argparse: no torch.
"""

from __future__ import annotations

import argparse
from typing import Any

from capture_megatron.config import DataOptions, presets
from capture_megatron.flags import megatron_lm
from capture_megatron.flags import parser as flags
from capture_megatron.planner import PlanOptions
from capture_megatron.steptime.hardware import HardwareFlags


def add_cluster_flags(p: argparse.ArgumentParser) -> None:
    """The model source, the cluster, the memory model and the outputs."""
    g = p.add_argument_group("model source, cluster and outputs")
    g.add_argument("--preset", help=f"model shape by name: {', '.join(presets.PRESETS)}")
    g.add_argument(
        "--hf-config",
        help="a Hugging Face config.json, or the model directory holding it (llama, mistral, "
        "gemma, qwen2, qwen3, olmo2, phi3, mixtral, qwen2_moe, qwen3_moe, deepseek_v2, "
        "deepseek_v3; gemma2 and gemma3_text are read but refused); the sequence length: "
        "--seq-length",
    )
    g.add_argument("--gpus", type=int, help="processes/GPUs available (required)")
    g.add_argument(
        "--gpu-memory-gib",
        type=float,
        help=(
            "GiB one process may take of its GPU; a plan fits when its forecast plus "
            "--reserve-fraction and --context-gib is at most this (default: the --gpu-type's "
            "memory as the driver reports it, 79.65 for an H100 SXM; --device cpu: this host's)"
        ),
    )
    g.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        help="GPUs per node; tensor parallelism stays inside a node (default: the --gpu-type's, "
        "8 for HGX / DGX nodes)",
    )
    g.add_argument(
        "--device",
        default="",
        help="memory model device: cuda (a real GPU), fake-cuda (alias fake: the GPU kernels on "
        "fake CUDA tensors), cpu or fake-cpu (CPU kernels: for CPU runs); default: cuda if "
        "available, else fake-cuda",
    )
    g.add_argument(
        "--memory-model", default="", help="a fitted memory_model.json (else profile on the spot)"
    )
    g.add_argument("--json", default="", help="write the result as JSON here")
    g.add_argument("--png", default="", help="write the per-stage memory breakdown plot here")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    flags.add_fields(p, HardwareFlags, "hardware profile (step-time estimate; capture-megatron)")


def add_plan_flags(p: argparse.ArgumentParser, training: bool = False) -> None:
    """The cluster flags (what a user gives first), then model, kernel and parallel flags and
    PlanOptions (`training`: the kernels' defaults of capture-megatron's own training, for
    commands that train the plan)."""
    add_cluster_flags(p)
    flags.add_model_flags(p)
    flags.add_kernel_flags(p, training=training)
    flags.add_parallel_flags(p)
    flags.add_fields(p, PlanOptions, "planning")


def add_megatron_line(p: argparse.ArgumentParser) -> None:
    """The rest of a Megatron-LM pretrain_gpt.py command line, with Megatron-LM's defaults: the
    training, data and checkpoint flags capture-megatron knows, then every other flag
    (capture_megatron.flags.megatron_lm: ignored when it cannot change memory, else refused);
    --train-iters stays unset unless given (a run of known length: its routers' learning rate,
    capture_megatron.api.request.with_router_lr)."""
    flags.add_training_flags(p, train_iters=None)
    flags.add_fields(
        p, DataOptions, "data (Megatron flags)", defaults={"tokenizer_type": "GPT2BPETokenizer"}
    )
    flags.add_checkpoint_flags(p)
    megatron_lm.add_megatron_lm_flags(p)


def plan_parser(prog: str = "capture_megatron.plan", **presentation: Any) -> flags.FlagParser:
    """The plan command's parser: a whole Megatron-LM command line plus the cluster
    (`presentation`: FlagParser's help text -- usage, description, epilog, example, essential)."""
    p = flags.FlagParser(prog=prog, **presentation)
    add_plan_flags(p)
    add_megatron_line(p)
    return p


def predict_parser(prog: str = "capture_megatron.predict", **presentation: Any) -> flags.FlagParser:
    """The predict command's parser: a whole Megatron-LM command line, the cluster, and the
    memory margins (`presentation` as for plan_parser)."""
    p = flags.FlagParser(prog=prog, **presentation)
    flags.add_model_flags(p)
    flags.add_kernel_flags(p)
    flags.add_parallel_flags(p)
    flags.add_fields(p, PlanOptions, "memory margins", only=("reserve_fraction", "context_gib"))
    add_cluster_flags(p)
    add_megatron_line(p)
    return p
