"""RoPE under context parallelism on the fake-CUDA device (the GPU kernel set without a GPU):
megatron-core's get_pos_emb_on_this_cp_rank pins its two CP chunk indices on the host and copies
them to the device; a CPU-only torch has no pinned allocator. The fake device creates them unpinned
(host memory is not device memory) and counts the device copy the real kernel allocates."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

ROPE_CP = r"""
import json
from capture_megatron.emulate import fake_cuda
fake_cuda.load()
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank
from capture_megatron.emulate import cpu_compat
from capture_megatron.memory.meter import make_meter

cpu_compat.apply_fake_cuda()
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1)
with FakeTensorMode(allow_non_fake_inputs=True):
    emb = torch.empty(16, 1, 1, 8, device="cuda")  # [s, 1, 1, d] as RotaryEmbedding makes it
    meter = make_meter("fake-cuda")
    before = meter.current()
    meter.reset_peak()
    local = get_pos_emb_on_this_cp_rank(emb, 0, dist.new_group([0]))
    grew, kept = meter.peak() - before, meter.current() - before
    meter.stop()
print(json.dumps({"device": local.device.type, "shape": list(local.shape), "grew": grew,
                  "kept": kept, "emb": emb.numel() * emb.element_size()}))
import os, sys  # as capture_megatron/profile/worker.py: the fake-CUDA process exits without
sys.stdout.flush()  # finalising, whose native threads now and then abort at exit (status -6)
os._exit(0)
"""


@pytest.mark.slow
def test_rope_cp_chunk_indices_on_fake_cuda_are_device_tensors():
    """get_pos_emb_on_this_cp_rank runs on the fake device (no 'Pinned memory requires CUDA'), and
    the meter counts what it allocates on the device: the selected position-embedding rows (with
    CP 1, both chunks: the whole table) and, while they are gathered, the 2 x int64 index copy."""
    done = subprocess.run(
        [sys.executable, "-c", ROPE_CP], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["device"] == "cuda" and out["shape"] == [16, 1, 1, 8]
    assert out["kept"] == out["emb"]  # the selected rows stay
    assert out["grew"] == out["emb"] + 16  # the int64 index pair lived on the device meanwhile
