"""`capture-megatron plan <model and training flags> --gpus N --gpu-memory-gib G [--objective ...]`.

Parallel sizes given on the command line are fixed, the rest searched; with
--pipeline-model-parallel-layout nothing is searched and the plan is only predicted.
"""
from __future__ import annotations

import dataclasses
import sys

from capture_megatron import presets
from capture_megatron.config import GIB, Cluster, ModelShape
from capture_megatron.costmodel import Hardware
from capture_megatron.errors import CaptureError
from capture_megatron.megatron import args as margs
from capture_megatron.megatron import flags
from capture_megatron.planner import OBJECTIVES, Space

MODEL_FLAGS = {"--num-layers": "num_layers", "--hidden-size": "hidden_size", "--ffn-hidden-size": "ffn_hidden_size",
               "--num-attention-heads": "num_attention_heads", "--num-query-groups": "num_query_groups",
               "--kv-channels": "kv_channels", "--seq-length": "seq_length",
               "--max-position-embeddings": "max_position_embeddings", "--vocab-size": "vocab_size"}


def build_parser() -> flags.FlagParser:
    """Model flags, parallel flags (fixing values) and the plan command's own."""
    p = flags.FlagParser(prog="capture-megatron plan", description=__doc__.splitlines()[0])
    flags.add_model_flags(p)
    flags.add_parallel_flags(p)
    g = p.add_argument_group("planning")
    g.add_argument("--preset", help=f"model shape by name: {', '.join(presets.PRESETS)}")
    g.add_argument("--hf-config", help="a Hugging Face config.json (Llama, Mistral, Qwen2 style)")
    g.add_argument("--gpus", type=int, help="processes/GPUs available (required)")
    g.add_argument("--gpu-memory-gib", type=float, help="memory per GPU (default with --device cpu: this host's)")
    g.add_argument("--gpus-per-node", type=int, default=8)
    g.add_argument("--device", default="", help="memory model device: cpu, cuda or fake (default: cuda if "
                   "available, else cpu for models that fit in host memory, fake otherwise)")
    g.add_argument("--memory-model", default="", help="a fitted memory_model.json (else profile on the spot)")
    g.add_argument("--objective", default="min-peak", choices=OBJECTIVES)
    g.add_argument("--json", default="", help="write the plan JSON here")
    g.add_argument("--png", default="", help="write the per-stage memory breakdown plot here")
    g.add_argument("--top", type=int, default=8, help="plans shown in the table")
    g.add_argument("--reserve-fraction", type=float, default=0.08,
                   help="CUDA: allocator reserve above allocated, as a fraction (calibrate with verify)")
    g.add_argument("--context-gib", type=float, default=2.0, help="CUDA: context + NCCL + workspaces")
    g.add_argument("--mfu", type=float, default=0.4, help="cost model: fraction of peak FLOP/s reached")
    g.add_argument("--no-progress", action="store_true")
    return p


def given(argv: list[str]) -> set[str]:
    """Flags present on the command line."""
    return {a.split("=", 1)[0] for a in argv if a.startswith("--")}


def resolve_shape(ns, argv: list[str]) -> ModelShape:
    """The model: --preset or --hf-config, with any model flag on the command line overriding it."""
    if ns.preset and ns.hf_config:
        raise CaptureError("give --preset or --hf-config, not both")
    if not ns.preset and not ns.hf_config:
        return margs.model_shape(ns)
    base = presets.preset(ns.preset) if ns.preset else presets.from_hf_config(ns.hf_config, ns.seq_length)
    present = given(argv)
    changes = {field: getattr(ns, field) for flag, field in MODEL_FLAGS.items() if flag in present}
    if "--bf16" in present or "--fp16" in present:
        changes["dtype"] = "bf16" if ns.bf16 else "fp16"
    for flag, field in (("--hidden-dropout", "hidden_dropout"), ("--attention-dropout", "attention_dropout")):
        if flag in present:
            changes[field] = getattr(ns, flag[2:].replace("-", "_"))
    return dataclasses.replace(base, **changes)


def resolve_space(ns, shape: ModelShape) -> Space:
    """The search space with the command line's fixed values."""
    space = Space()
    fixed = {}
    if ns.tensor_model_parallel_size:
        fixed["tp"] = (ns.tensor_model_parallel_size,)
    if ns.pipeline_model_parallel_size:
        fixed["pp"] = (ns.pipeline_model_parallel_size,)
    if ns.num_virtual_stages_per_pipeline_rank:
        fixed["vpp"] = (ns.num_virtual_stages_per_pipeline_rank,)
    if ns.micro_batch_size:
        fixed["micro_batch_size"] = (ns.micro_batch_size,)
    if ns.recompute_granularity or ns.recompute_activations:
        fixed["recompute"] = (ns.recompute_granularity or "selective",)
    if ns.sequence_parallel:
        fixed["sequence_parallel"] = (True,)
    if ns.use_distributed_optimizer:
        fixed["distributed_optimizer"] = (True,)
    return dataclasses.replace(space, **fixed)


def cluster_of(ns) -> Cluster:
    """The cluster from --gpus / --gpu-memory-gib / --gpus-per-node / the device."""
    device = "cpu" if ns.device == "cpu" else "cuda"
    if ns.gpus is None:
        raise CaptureError("--gpus is required (how many GPUs or processes the plan may use)")
    memory = ns.gpu_memory_gib
    if memory is None:
        if device != "cpu":
            raise CaptureError("--gpu-memory-gib is required (memory per GPU, e.g. 80)")
        import psutil
        memory = psutil.virtual_memory().total / GIB
    return Cluster(gpus=ns.gpus, gpu_memory_bytes=int(memory * GIB), gpus_per_node=ns.gpus_per_node, device=device)


def main(argv: list[str]) -> int:
    """Entry point."""
    from capture_megatron.plan_run import run_plan

    ns = flags.parse_flags(build_parser(), argv)
    cluster = cluster_of(ns)
    shape = resolve_shape(ns, argv)
    hw = Hardware(efficiency=ns.mfu)
    return run_plan(ns, shape, cluster, resolve_space(ns, shape), hw)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
