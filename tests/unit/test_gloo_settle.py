"""gloo_settle: a blocking collective on a real gloo group returns only once gloo's worker thread
has let go of the tensors it was given, with the same result (a fresh process: it initialises
torch.distributed)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import os, tempfile
    import torch
    import torch.distributed as dist
    from capture_megatron.emulate import gloo_settle

    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    gloo_settle.install()
    gloo_settle.install()  # idempotent: wrapped once
    assert getattr(dist.all_to_all_single, "__wrapped_for_gloo__", False)
    assert not hasattr(dist.all_to_all_single.__wrapped__, "__wrapped_for_gloo__")
    late = 0
    for i in range(300):
        source = torch.arange(64, dtype=torch.float32) + i
        out = torch.empty_like(source)
        before = (source._use_count(), out._use_count())
        dist.all_to_all_single(out, source, [64], [64])
        late += (source._use_count(), out._use_count()) != before
        assert torch.equal(out, source)
        total = source.clone()
        dist.all_reduce(total)
        assert total._use_count() == 1 and torch.equal(total, source)
    work = dist.all_reduce(torch.ones(4), async_op=True)  # asynchronous: a Work, not waited
    work.wait()
    print("late", late)
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_blocking_collectives_return_with_their_tensors_released():
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["late", "0"]


def test_a_collective_whose_tensors_stay_held_is_waited_for_once(monkeypatch):
    """Where something else keeps the tensors (here an autograd graph saving one), the wait ends
    after SETTLE_SECONDS and that collective is not waited for again."""
    import time

    import torch

    from capture_megatron.emulate import gloo_settle

    held = []

    def keeps(tensor, group=None, async_op=False):
        held.append(tensor * tensor)  # its graph holds the tensor, as a slow worker would

    monkeypatch.setattr(gloo_settle, "SETTLE_SECONDS", 0.2)
    call = gloo_settle.settled(keeps)
    t0 = time.monotonic()
    call(torch.ones(4, requires_grad=True))
    first = time.monotonic() - t0
    t0 = time.monotonic()
    for _ in range(5):
        call(torch.ones(4, requires_grad=True))
    later = time.monotonic() - t0
    assert first >= 0.2 and later < 0.2, (first, later)
    assert call(torch.ones(4, requires_grad=True), async_op=True) is None and len(held) == 7
