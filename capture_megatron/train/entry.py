"""`torchrun -m capture_megatron.pretrain_gpt <Megatron flags>`: train a GPT with megatron-core.

Reads torchrun's environment (or Slurm's), builds this rank's model chunks for the plan the flags
describe (any TP/PP/DP/VPP, any --pipeline-model-parallel-layout, per-stage recompute), trains on
real data (--data-path) or MockGPTDataset (--mock-data), checkpoints atomically, and with
--memory-report writes every rank's measured peak memory (the MemoryReport of docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import time
from typing import NoReturn

from capture_megatron.config import TrainConfig
from capture_megatron.errors import CaptureError
from capture_megatron.flags import parser as flags
from capture_megatron.flags.args import data_options, train_config
from capture_megatron.megatron import lifeline, quiet
from capture_megatron.rules.megatron import checkpoint_problem
from capture_megatron.train.dist_env import lost_a_peer, read_env

__all__ = ["LOST_PEER_WAIT", "lost_a_peer", "main", "parse_config", "build_parser"]

PARENT = os.getppid()
"""The process that started this one (torchrun's agent), read at import."""
_IMPORTED_IN = os.getpid()
"""The process that imported this module: torchrun's agent when the rank was forked from it
(train.preloaded), where PARENT is the agent's own parent."""


LOST_PEER_WAIT = 3.0
"""Seconds a torchrun rank waits before raising when a collective failed because a peer process
went away (lost_a_peer). torchrun's agent checks its ranks every 0.1 s and stops them all once one
has ended; it names the first it saw end as the root cause, and with forked ranks (train.preloaded)
only that one. Without the wait, a rank whose peer was killed could end first and be named."""


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
    if forked_rank():
        _undo_the_launchers_state()
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun rank: never outlive torchrun
        lifeline.die_with_parent(_launcher())
        lifeline.forks_die_with_this()  # nor its forked checkpoint writers
    quiet.install()  # before megatron-core is imported: some of its warnings come at import
    env = read_env()
    _eager_on_cpu()  # before parse_config, whose tokenizer imports megatron-core
    try:
        cfg = parse_config(argv, env.world_size)
        from capture_megatron.train.run import run_training

        run_training(cfg, env)
    except RuntimeError as err:
        if "TORCHELASTIC_RUN_ID" in os.environ and lost_a_peer(err):
            time.sleep(LOST_PEER_WAIT)  # torchrun stops it meanwhile, naming the rank that died
        raise
    except CaptureError as err:
        if "TORCHELASTIC_RUN_ID" in os.environ and getattr(err, "lost_peer", False):
            time.sleep(LOST_PEER_WAIT)  # as above: torchrun names the rank that died
        if env.rank == 0:
            print(f"error: {err}", file=sys.stderr, flush=True)
        elif getattr(err, "every_rank", False):  # this rank's own failure (a save)
            print(f"error (rank {env.rank}): {err}", file=sys.stderr, flush=True)
        return 2
    return 0


def forked_rank() -> bool:
    """Whether this rank was forked from the torchrun agent that imported this module
    (train.preloaded) rather than started as a Python of its own."""
    return os.getpid() != _IMPORTED_IN


def _launcher() -> int:
    """The pid of the torchrun agent that started this rank."""
    if not forked_rank():
        return PARENT
    import multiprocessing

    agent = multiprocessing.parent_process()  # known from the fork, not read after it
    return agent.pid if agent is not None and agent.pid is not None else os.getppid()


def _undo_the_launchers_state() -> None:
    """What a forked rank inherits from torchrun's agent and a rank of its own would not have:
    the agent's exit handlers, and its signal handlers (torchrun's, which turn SIGTERM into an
    exception: a rank stopped by SIGTERM would print a traceback instead of ending), and its name
    (the rank is named `rank N` instead)."""
    atexit._clear()
    lifeline.name_this_process(f"rank {os.environ.get('RANK', '?')}")
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def end_process(code: int) -> NoReturn:
    """Exit with `code` without the interpreter's teardown (lifeline.exit_now: threads joined,
    exit handlers run, output flushed; about 1.5 s of CPU a rank on this machine, of a 5-7 s rank;
    a killed run never gets here, and a traceback exits the usual way). A forked rank
    (train.preloaded) raises SystemExit after the same steps instead: torchrun's worker function
    must return its result to the agent, and its process then ends without teardown too."""
    if not forked_rank():
        lifeline.exit_now(code)
    lifeline.finish()
    raise SystemExit(code)
