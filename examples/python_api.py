"""The Python API, no subprocess: predict a pasted Megatron-LM line, plan a published model for a
cluster, and plan from typed objects instead of flags.

    python examples/python_api.py [OUT_DIR]     (default: a new temporary folder)

1. `capture_megatron.predict`: every pipeline rank's peak of the "GPT-3 Training Example" of
   Megatron-LM's docs (core_v0.16.1, the flags of its `torchrun --nproc_per_node=8` line) on
   8 GPUs of 80 GiB, with the GPU kernel set profiled on a fake CUDA device (no GPU needed).
2. `capture_megatron.plan`: the fastest plan of Llama-2-7B (a preset) at TP 1 and micro-batch 1
   that fits 16 GPUs of 80 GiB, and the Megatron-LM flags that run it; its plan JSON written
   with `result.write`.
3. A Request built from typed objects (ModelShape, Cluster, PlanOptions): the lowest-peak split of
   a small GPT over 4 pipeline stages of CPU processes, on the CPU kernel set.

On this project's 2-core machine with an empty profiling cache it takes a few minutes; the cache
(~/.cache/capture-megatron, or $CAPTURE_MEGATRON_CACHE) makes a second run take seconds.
"""

from __future__ import annotations

import os
import sys
import tempfile

import capture_megatron as cm
from capture_megatron.api import Request
from capture_megatron.config import GIB, Cluster, ModelShape
from capture_megatron.planner import PlanOptions, Space

GPT3_EXAMPLE = """
--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-layers 24
--hidden-size 2048 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024
--micro-batch-size 2 --global-batch-size 16 --train-iters 100000 --lr 1.5e-4 --min-lr 1.0e-5
--lr-decay-style cosine --lr-warmup-iters 1000 --weight-decay 0.1 --clip-grad 1.0 --fp16
--data-path /data/my_text_document --split 949,50,1 --save /data/checkpoints
--load /data/checkpoints
""".split()
"""The pretrain_gpt.py flags of Megatron-LM's docs/user-guide/training-examples.md (core_v0.16.1),
"GPT-3 Training Example", as written (its /path/to/... paths as /data/...)."""


def gib(n: float) -> str:
    """Bytes in GiB, for printing."""
    return f"{n / GIB:.2f} GiB"


def main(out: str) -> None:
    """Run the three examples, printing what each returns."""
    os.makedirs(out, exist_ok=True)
    forecast = cm.predict(GPT3_EXAMPLE, gpus=8, device="fake-cuda")
    print("1. predict, Megatron-LM's GPT-3 example on 8 GPUs:")
    for rank, peak in enumerate(forecast.best.rank_peaks):
        print(f"   pipeline rank {rank}: peak {gib(peak)}")
    origin = forecast.origin
    print(f"   kernel set {origin.kernels}, its memory model profiled on {origin.device}")

    # sizes given are kept, the rest searched: TP 1 and micro-batch 1 keep the first (cold) run
    # to the probes of those sizes; PP, DP, VPP, recompute and the layout are searched
    fixed = ["--tensor-model-parallel-size", "1", "--micro-batch-size", "1"]
    flags = ["--preset", "llama2-7b", *fixed]
    planned = cm.plan(flags, gpus=16, gpu_memory_gib=80, device="fake-cuda")
    best = planned.best
    print("2. plan, Llama-2-7B on 16 x 80 GiB:")
    print(f"   TP {best.plan.tp} PP {best.plan.pp} DP {best.plan.dp}, layout {best.plan.layout}")
    print(f"   worst-rank peak {gib(max(best.rank_peaks))}, step {planned.step.seconds:.2f} s")
    print(f"   why: {planned.reasoning[0]}")
    print(f"   run it with: {' '.join(planned.megatron_args())}")
    path = os.path.join(out, "llama2-7b-plan.json")
    planned.write(path)
    print(f"   plan JSON: {path}")

    small = ModelShape(
        num_layers=8, hidden_size=256, num_attention_heads=8, seq_length=256, vocab_size=1024
    )
    request = Request(
        shape=small,
        cluster=Cluster(gpus=4, gpu_memory_bytes=8 * GIB, device="cpu"),
        options=PlanOptions(objective="min-peak", global_batch_size=16, space=Space(pp=(4,))),
        device="cpu",
    )
    lowest = cm.plan(request)
    print("3. plan from typed objects, a small GPT over 4 pipeline stages (lowest peak):")
    peaks = ", ".join(f"{p / 2**20:.1f}" for p in lowest.best.rank_peaks)
    print(f"   layout {lowest.best.plan.layout}: peaks {peaks} MiB")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="capture-megatron-api-"))
