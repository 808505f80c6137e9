"""--exit-signal-handler: stop cleanly on a signal, as Megatron-LM does (core_v0.16.1,
megatron/training/dist_signal_handler.py and training.py's checkpoint_and_decide_exit).

Each rank catches --exit-signal and only remembers it; after every iteration the ranks agree
(an all-reduce of the flag: the signal may reach them at different moments, or only some of them)
and, once any rank got it, all of them save a checkpoint (with --save) and leave the loop together.
`capture-megatron launch --requeue` sends SIGUSR1 this way before Slurm's time limit, then requeues
the job, which resumes from that checkpoint."""

from __future__ import annotations

import signal
from types import FrameType

import torch


class ExitSignal:
    """Catches one signal in this process; `received()` is collective over the job."""

    def __init__(self, name: str) -> None:
        self.signal = signal.Signals[name]
        self.caught = False
        # Slurm delivers the signal to every process of the job step. megatron-core's checkpoint
        # writer reports through a Manager process it spawns (a fresh interpreter) at the first
        # save; the signal's default action would kill it and fail the very save the signal asks
        # for. Started here with the signal ignored (an ignored disposition survives exec), it
        # never sees it.
        signal.signal(self.signal, signal.SIG_IGN)
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        filesystem_async._get_write_results_queue()
        signal.signal(self.signal, self._catch)

    def _catch(self, signum: int, frame: FrameType | None) -> None:
        self.caught = True

    def received(self) -> bool:
        """True on every rank once any rank has caught the signal (call on all ranks)."""
        backend = torch.distributed.get_backend()
        device = "cuda" if backend == "nccl" else "cpu"
        flag = torch.tensor([int(self.caught)], dtype=torch.int32, device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())
