"""`capture-megatron megatron-lm` on a real Megatron-LM checkout: plan, then Megatron-LM's own
pretrain_gpt.py under torchrun with the balanced --pipeline-model-parallel-layout (interleaved)
and per-stage recompute. Where there is no GPU, Megatron-LM runs on CPU with the shims of
capture_megatron.megatron_lm.cpu. Megatron-LM's own output is checked: the layout it parsed, the
parameters each pipeline rank built, each rank's recompute and three finite training steps.

Skipped unless $CAPTURE_MEGATRON_TEST_MEGATRON_LM names a core_v0.16.x checkout, e.g.
`git -C <NVIDIA/Megatron-LM clone> archive core_v0.16.1 | tar -x -C /tmp/Megatron-LM`, with
Megatron-LM's extra modules installed (the skip reason gives the pip command)."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest

from capture_megatron.megatron_lm import deps as lm_deps

CHECKOUT_ENV = "CAPTURE_MEGATRON_TEST_MEGATRON_LM"
"""Where the checkout is."""
H, VOCAB, SEQ = 64, 640, 64
"""Hidden size, vocabulary as Megatron-LM pads it (NullTokenizer: 512 + EOD -> 640), sequence."""
MODEL = (
    f"--num-layers 8 --hidden-size {H} --num-attention-heads 4 --seq-length {SEQ} "
    f"--max-position-embeddings {SEQ} --vocab-size 512 --micro-batch-size 2 "
    "--global-batch-size 16 --pipeline-model-parallel-size 4 --mock-data --tokenizer-type "
    "NullTokenizer --train-iters 3 --lr 1e-4 --eval-interval 1000 --eval-iters 0 --log-interval 1"
).split()


def _checkout() -> str:
    checkout = os.environ.get(CHECKOUT_ENV, "")
    if not os.path.isfile(os.path.join(checkout, "pretrain_gpt.py")):
        pytest.skip(f"set {CHECKOUT_ENV} to a Megatron-LM core_v0.16.x checkout to run this")
    missing = lm_deps.missing_modules(checkout, run_probe=False)
    if missing:
        pytest.skip(f"Megatron-LM needs: pip install {' '.join(sorted(missing))}")
    return checkout


def expected_parameters(layout: str, pp: int) -> list[int]:
    """Parameters each pipeline rank holds for the layout (GPT, learned positions, tied
    embeddings: the last stage holds its own copy of the output weights)."""
    layer = 12 * H * H + 13 * H  # QKV + projection + MLP (4h) with biases, two LayerNorms
    stages = layout.split("|")
    out = []
    for rank in range(pp):
        mine = "".join(stages[rank::pp])
        out.append(
            mine.count("t") * layer
            + ("E" in mine) * (VOCAB * H + SEQ * H)
            + ("L" in mine) * (2 * H + VOCAB * H)
        )
    return out


def test_megatron_lm_trains_the_balanced_plan(tmp_path):
    checkout = _checkout()
    done = subprocess.run(
        [sys.executable, "-m", "capture_megatron.cli", "megatron-lm", "--megatron-lm", checkout]
        + "--nproc-per-node 4 --plan-device cpu --gpu-memory-gib 0.009 --no-progress".split()
        + ["--master-port", "29517", *MODEL],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(tmp_path),
        env=dict(os.environ, OMP_NUM_THREADS="1", CAPTURE_MEGATRON_CACHE=str(tmp_path / "c")),
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-5000:]
    command = next(line for line in done.stdout.splitlines() if line.startswith("MEGATRON_LM="))
    layout = re.search(r"--pipeline-model-parallel-layout '?([^ ']+)", command).group(1)
    counts = re.search(r"--recompute-num-layers-per-stage ([\d,]+)", command).group(1)
    assert layout.count("|") + 1 in (4, 8) and layout.count("t") == 8, layout
    assert f"Parse pipeline model parallel layout {layout}" in out
    built = re.findall(r"model parallel rank \(0, (\d)\): (\d+)", out)
    assert [n for _, n in sorted(built)] == [str(n) for n in expected_parameters(layout, 4)]
    recomputes = dict(re.findall(r"pipeline rank (\d) recomputes (\d+) layer", out))
    assert [recomputes[str(r)] for r in range(4)] == counts.split(","), out[-5000:]
    steps = re.findall(r"lm loss: ([\d.E+-]+) .* grad norm: ([\d.]+)", out)
    assert len(steps) == 3 and "number of nan iterations:   0" in out
    for loss, norm in steps:  # log(640) = 6.46 at initialisation
        assert 6.0 < float(loss) < 7.0 and math.isfinite(float(norm)), steps
