"""`torchrun -m capture_megatron.pretrain_gpt <Megatron flags>`: train a GPT with megatron-core.

Reads torchrun's environment (or Slurm's), builds this rank's model chunks for the plan the flags
describe (any TP/PP/DP/VPP, any --pipeline-model-parallel-layout, per-stage recompute), trains on
real data (--data-path) or MockGPTDataset (--mock-data), checkpoints atomically, and with
--memory-report writes every rank's measured peak memory (DESIGN.md's MemoryReport).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

from capture_megatron.config import ModelShape, ParallelPlan
from capture_megatron.errors import CaptureError
from capture_megatron.megatron import args as margs
from capture_megatron.megatron import flags
from capture_megatron.megatron.builder_options import BuildOptions
from capture_megatron.train.dist_env import DistEnv, read_env
from capture_megatron.train.options import CheckpointOptions, DataOptions, OptimOptions, RunOptions


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs, validated before any process group starts."""

    shape: ModelShape
    """The model."""
    plan: ParallelPlan
    """Parallel sizes, batch, layout, recompute."""
    optim: OptimOptions
    """Adam / LR schedule / clipping."""
    data: DataOptions
    """Data source and tokenizer."""
    checkpoint: CheckpointOptions
    """Save / resume."""
    run: RunOptions
    """Loop length, logging, measurement."""
    build: BuildOptions
    """Model build options (implementation, init)."""


def build_parser(prog: str = "python -m capture_megatron.pretrain_gpt") -> flags.FlagParser:
    """The training command's parser: Megatron's flag names."""
    parser = flags.FlagParser(prog=prog, description=__doc__.splitlines()[0])
    flags.add_model_flags(parser)
    flags.add_parallel_flags(parser)
    flags.add_training_flags(parser)
    flags.add_data_flags(parser)
    flags.add_checkpoint_flags(parser)
    return parser


def parse_config(argv: list[str], world_size: int) -> TrainConfig:
    """TrainConfig from Megatron flags for a job of `world_size` processes (CaptureError on bad input)."""
    ns = flags.parse_flags(build_parser(), argv)
    data = margs.data_options(ns)
    vocab = None
    if not data.mock_data or ns.vocab_size is None:
        from capture_megatron.train.data import check_data_paths, tokenizer_vocab_size
        if not data.mock_data:
            check_data_paths(data)
        vocab = tokenizer_vocab_size(data)
    shape = margs.model_shape(ns, vocab)
    return TrainConfig(shape=shape, plan=margs.parallel_plan(ns, shape, world_size),
                       optim=margs.optim_options(ns), data=data, checkpoint=margs.checkpoint_options(ns),
                       run=margs.run_options(ns), build=margs.build_options(ns))


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code (2 for bad input, printed once)."""
    argv = sys.argv[1:] if argv is None else argv
    env = read_env()
    try:
        cfg = parse_config(argv, env.world_size)
        from capture_megatron.train.run import run_training
        run_training(cfg, env)
    except CaptureError as err:
        if env.rank == 0:
            print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    return 0


def describe(cfg: TrainConfig, env: DistEnv) -> str:
    """The run's header line."""
    p = cfg.plan
    return (f"capture-megatron: {env.world_size} processes ({env.source}) | TP {p.tp} PP {p.pp} DP {p.dp}"
            + (f" VPP {p.vpp}" if p.vpp > 1 else "") + f" | layout {p.layout} | micro-batch "
            f"{p.micro_batch_size} x {p.num_microbatches} | {cfg.shape.dtype}")


if __name__ == "__main__":
    sys.exit(main())
