"""The checkpoint writer's results queue, served by a process that dies with its rank.

megatron-core 0.16.1's torch_dist saves (dist_checkpointing/strategies/filesystem_async.py,
``_get_write_results_queue``) create, on a rank's first save, a ``multiprocessing`` Manager in the
spawn context and keep only its Queue. The Manager's server process lives until the rank exits
normally; when the rank is killed (SIGKILL, an out-of-memory kill, torchrun stopping a failed
job), nothing tells the server, and it stays behind, about 330 MB each here, for good (found
after the kill-during-save tests: one per killed rank, still alive an hour later).

``apply()`` replaces that function with the same Manager and Queue whose server asks the kernel
to kill it when its rank dies (capture_megatron.megatron.lifeline.die_with_parent, run as the
server's initializer). Nothing else changes: the queue is created at the same moment, once per
process, and is the same kind of proxy.
"""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing.managers import SyncManager
from typing import Any

from capture_megatron.emulate import patches
from capture_megatron.megatron import lifeline


def results_queue() -> Any:
    """filesystem_async's results queue: created on the first call, its Manager's server process
    tied to this process's life."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
        manager.start(initializer=lifeline.die_with_parent, initargs=(os.getpid(),))
        queue: Any = manager.Queue()  # the proxy keeps the manager alive
        filesystem_async._results_queue = queue
    return filesystem_async._results_queue


def apply() -> None:
    """Install results_queue in megatron-core's filesystem writer (once per process)."""
    if not patches.first("writer_queue"):
        return
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    why = (
        "checkpoint saves (FileSystemWriterAsync): the results queue's Manager server dies with "
        "its rank instead of outliving a killed one"
    )
    patches.patch(filesystem_async, "_get_write_results_queue", results_queue, why)
