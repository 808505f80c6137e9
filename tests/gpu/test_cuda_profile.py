"""On a CUDA machine: `profile --device cuda` measures real Megatron-Core chunks with the caching
allocator's statistics, and its records fit. Skipped where torch sees no CUDA device (CI, this
project's CPU machines); run with `pytest -m gpu` on a GPU machine."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from capture_megatron.fit import fit
from capture_megatron.records import read_records

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MODEL = (
    "--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 512 "
    "--vocab-size 1024 --bf16 --transformer-impl local "
    # the fused kernels Megatron-LM's defaults ask for, absent where TE and apex are not installed
    "--no-gradient-accumulation-fusion --no-rope-fusion --no-masked-softmax-fusion"
).split()


def test_cuda_profile_records_and_fit(tmp_path):
    out = tmp_path / "records.jsonl"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "capture_megatron.cli",
            "profile",
            *MODEL,
            "--device",
            "cuda",
            "--no-design",
            "--no-progress",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = read_records(str(out))
    assert {r.device for r in records} == {"cuda"} and len(records) == 8
    middle = next(r for r in records if (r.kind, r.layers) == ("middle", 2))
    assert middle.saved_bytes > 0 and middle.forward_peak > 0 and middle.backward_peak > 0
    assert fit(records).device == "cuda"
