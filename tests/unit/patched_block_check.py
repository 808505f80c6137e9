"""Run with PYTHONPATH=<dir holding a patched megatron/>: prints 'stage-count checkpointed-layers'
per case.

Executed by test_patches.py in a fresh interpreter so the patched megatron-core copy is imported.
"""

import os
import socket
import sys

import megatron.core
import torch
import torch.distributed as dist

assert megatron.core.__file__.startswith(sys.argv[1]), megatron.core.__file__

from capture_megatron.emulate import cpu_compat  # noqa: E402

cpu_compat.apply("cpu")
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")

from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer.transformer_block import TransformerBlock  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

parallel_state.initialize_model_parallel(1, 1)
tensor_parallel.model_parallel_cuda_manual_seed(1)
calls = []
original = tensor_parallel.checkpoint


def counting_checkpoint(*args, **kwargs):
    calls.append(1)
    return original(*args, **kwargs)


tensor_parallel.checkpoint = counting_checkpoint


def config(per_stage):
    return TransformerConfig(
        num_layers=3,
        hidden_size=32,
        num_attention_heads=4,
        recompute_granularity="full",
        recompute_method="block",
        recompute_num_layers=3,
        recompute_num_layers_per_stage=per_stage,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


for count in (0, 1, 2, 3):
    block = TransformerBlock(config([count]), get_gpt_layer_local_spec())
    x = torch.randn(8, 2, 32, requires_grad=True)
    calls.clear()
    mask = torch.triu(
        torch.ones(1, 1, 8, 8, dtype=torch.bool), diagonal=1
    )  # explicit: no CUDA default
    block(x, attention_mask=mask).sum().backward()
    print(count, len(calls), flush=True)
try:
    config([1, 1])
except ValueError as err:
    print("rejected:", err)
