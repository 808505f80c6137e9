"""A collective that fails because the process at the other end ended is recognised as such
(capture_megatron.train.entry.lost_a_peer), from gloo's own words: such a rank waits before raising,
so that torchrun names the rank that ended (tests/dist/test_faults.py shows the report)."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from capture_megatron.train.entry import lost_a_peer

PEER = """
import os, sys
from datetime import timedelta
import torch, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, False, timedelta(seconds=30))
group = dist.ProcessGroupGloo(store, 1, 2)
group.send([torch.ones(4)], 0, 0).wait()
os._exit(0)  # ends with its connection open, as a killed rank does
"""


def test_a_peer_that_ended_is_recognised_in_gloos_error():
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=30), wait_for_workers=False)
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(store.port)])
    try:
        group = dist.ProcessGroupGloo(store, 0, 2)
        got = torch.zeros(4)
        group.recv([got], 1, 0).wait()
        assert got.sum().item() == 4
        assert peer.wait(timeout=60) == 0
        with pytest.raises(RuntimeError) as failed:
            group.recv([got], 1, 0).wait()
    finally:
        peer.kill()
    assert lost_a_peer(failed.value), str(failed.value)
    assert not lost_a_peer(RuntimeError("CUDA out of memory"))
