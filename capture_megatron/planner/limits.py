"""Inputs too large to plan, refused at once with what would be planned (not after minutes).

The planner's work grows with the model's layers (the exact min-max partition over every layer
and stage), its experts (their placements) and the micro-batches of a step (megatron-core's
schedule is simulated micro-batch by micro-batch), not with the GPU count alone. Before this, a
`plan` of --num-layers 100000 or --global-batch-size 1e8 on a few GPUs ran for minutes and then
ran out of memory. The limits sit well above every published model (Llama 3.1 405B: 126 layers;
DeepSeek-V3: 256 routed experts) and keep a plan to seconds; measured on a 2-core machine, 400
layers took 26 s and a step of 262,144 micro-batches 30 s. Pure Python.
"""

from __future__ import annotations

from capture_megatron.config import Cluster, ModelShape
from capture_megatron.errors import require

MAX_LAYERS = 512
"""Most transformer layers planned (--num-layers)."""
MAX_EXPERTS = 1024
"""Most routed experts planned (--num-experts)."""
MAX_MICROBATCHES = 65536
"""Most micro-batches per pipeline per step the schedule is simulated for."""
MAX_GPUS = 1 << 20
"""Most GPUs (processes) planned for."""
MAX_WIDTH = 1 << 20
"""Widest hidden, MLP, head and query-group sizes planned (today's widest hidden: 25,600)."""
MAX_VOCAB = 1 << 24
"""Largest vocabulary planned (today's largest: about 256,000 tokens)."""
MAX_SEQ = 1 << 24
"""Longest sequence planned (16M tokens; long-context runs train at 1M)."""


def too_large(shape: ModelShape, cluster: Cluster, global_batch: int, micro_batch: int) -> None:
    """CaptureError naming every input beyond the limits above, with the largest that is
    planned; `micro_batch` is the largest micro-batch size the search may use."""
    p = [
        f"{flag} {value}: at most {limit:,} is planned"
        for flag, value, limit in (
            ("--hidden-size", shape.hidden_size, MAX_WIDTH),
            ("--ffn-hidden-size", shape.ffn, MAX_WIDTH),
            ("--num-attention-heads", shape.num_attention_heads, MAX_WIDTH),
            ("--kv-channels", shape.head_dim, MAX_WIDTH),
            ("--vocab-size", shape.vocab_size, MAX_VOCAB),
            ("--seq-length", shape.seq_length, MAX_SEQ),
        )
        if value > limit
    ]
    if shape.num_layers > MAX_LAYERS:
        p.append(f"--num-layers {shape.num_layers}: at most {MAX_LAYERS} layers are planned")
    if shape.moe.num_experts > MAX_EXPERTS:
        p.append(f"--num-experts {shape.moe.num_experts}: at most {MAX_EXPERTS} are planned")
    if cluster.gpus > MAX_GPUS:
        p.append(f"--gpus {cluster.gpus}: at most {MAX_GPUS:,} GPUs are planned for")
    fewest = -(-global_batch // (min(cluster.gpus, MAX_GPUS) * max(micro_batch, 1)))
    if fewest > MAX_MICROBATCHES:
        largest = MAX_MICROBATCHES * min(cluster.gpus, MAX_GPUS) * max(micro_batch, 1)
        p.append(
            f"--global-batch-size {global_batch}: even at data parallelism "
            f"{min(cluster.gpus, MAX_GPUS)} and micro-batch {micro_batch} a step has {fewest:,} "
            f"micro-batches per pipeline, and at most {MAX_MICROBATCHES:,} are simulated "
            f"(--global-batch-size {largest:,} or less here; memory does not grow with more "
            "micro-batches than pipeline stages)"
        )
    require(p, "input (too large to plan)")
