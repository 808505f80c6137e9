"""`torchrun -m capture_megatron.pretrain_gpt <Megatron flags>`: train a GPT with megatron-core.

Reads torchrun's environment (or Slurm's), builds this rank's model chunks for the plan the flags
describe (any TP/PP/DP/VPP, any --pipeline-model-parallel-layout, per-stage recompute), trains on
real data (--data-path) or MockGPTDataset (--mock-data), checkpoints atomically, and with
--memory-report writes every rank's measured peak memory (the MemoryReport of docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn

from capture_megatron.config import TrainConfig
from capture_megatron.config.mtp import checkpoint_problem
from capture_megatron.errors import CaptureError
from capture_megatron.flags import parser as flags
from capture_megatron.flags.args import data_options, train_config
from capture_megatron.megatron import lifeline, quiet
from capture_megatron.train.dist_env import read_env

PARENT = os.getppid()
"""The process that started this one (torchrun's agent), read at import."""


def build_parser(
    prog: str = "python -m capture_megatron.pretrain_gpt", description: str = ""
) -> flags.FlagParser:
    """The training command's parser: Megatron's flag names."""
    parser = flags.FlagParser(prog=prog, description=description or flags.summary(__doc__))
    flags.add_model_flags(parser)
    flags.add_kernel_flags(parser, training=True)
    flags.add_parallel_flags(parser)
    flags.add_training_flags(parser)
    flags.add_data_flags(parser)
    flags.add_checkpoint_flags(parser)
    return parser


def parse_config(argv: list[str], world_size: int) -> TrainConfig:
    """TrainConfig from Megatron flags for a job of `world_size` processes (CaptureError on bad
    input)."""
    ns = flags.parse_flags(build_parser(), argv)
    data = data_options(ns)
    vocab = None
    if not data.mock_data or ns.vocab_size is None:
        from capture_megatron.train.data import check_data_paths, tokenizer_vocab_size

        if not data.mock_data:
            check_data_paths(data)
        vocab = tokenizer_vocab_size(data)
    cfg = train_config(ns, world_size, vocab)
    check_context_parallel(cfg)
    unsavable = checkpoint_problem(cfg.shape, cfg.plan)
    if unsavable and (cfg.checkpoint.save or cfg.checkpoint.load):
        raise CaptureError(unsavable)
    return cfg


def check_context_parallel(cfg: TrainConfig) -> None:
    """CaptureError when --cp-comm-type names an algorithm this machine's attention lacks (see
    capture_megatron.config.context): checked before torchrun starts and again on every rank."""
    if cfg.plan.cp == 1:
        return
    import torch

    from capture_megatron.config.context import check_comm_type
    from capture_megatron.megatron.builder import resolve_impl

    uses_te = (
        torch.cuda.is_available()
        and resolve_impl(cfg.kernels.transformer_impl) == "transformer_engine"
    )
    check_comm_type(cfg.plan, uses_te)


def _eager_on_cpu() -> None:
    """Without CUDA, megatron-core's fused functions run eagerly, as the probes measured them
    (capture_megatron.emulate.eager_jit); a GPU rank keeps them compiled."""
    import torch

    if not torch.cuda.is_available():
        from capture_megatron.emulate import eager_jit

        eager_jit.install()


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code (2 for bad input, printed once)."""
    argv = sys.argv[1:] if argv is None else argv
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun rank: never outlive torchrun
        lifeline.die_with_parent(PARENT)
        lifeline.forks_die_with_this()  # nor its forked checkpoint writers
    quiet.install()  # before megatron-core is imported: some of its warnings come at import
    env = read_env()
    _eager_on_cpu()  # before parse_config, whose tokenizer imports megatron-core
    try:
        cfg = parse_config(argv, env.world_size)
        from capture_megatron.train.run import run_training

        run_training(cfg, env)
    except CaptureError as err:
        if env.rank == 0:
            print(f"error: {err}", file=sys.stderr, flush=True)
        elif getattr(err, "every_rank", False):  # this rank's own failure (a save)
            print(f"error (rank {env.rank}): {err}", file=sys.stderr, flush=True)
        return 2
    return 0


def end_process(code: int) -> NoReturn:
    """Exit with `code` as the interpreter would, without its teardown: the threads it would join
    are joined, the exit handlers run (multiprocessing's, whose checkpoint-writer Manager shuts
    down; logging's; temporary files'), stdout and stderr are flushed, and then the process ends
    without freeing its ~300k objects one by one (about 1.5 s of CPU a rank on this machine, of a
    5-7 s rank; a killed run never gets here, and a traceback exits the usual way)."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
