"""The megatron-core adapter: build a rank's GPT chunks on any device (builder, attention, moe, mtp,
init, norms), Megatron-LM's training set-up around megatron-core (training, schedule), the fused
kernels a GPU run needs (extensions), what the optimizer placed under CPU offload
(offload_placed), megatron-core's warnings (quiet) and child-process lifetimes (lifeline).
Checkpoint fixes live with the checkpoints, in capture_megatron.train.checkpoint.

Neighbours: capture_megatron.flags (the command line, pure Python), capture_megatron.emulate
(megatron-core without CUDA: the patch registry, CPU, fake tensors, fake CUDA) and
capture_megatron.megatron_lm (a Megatron-LM checkout's pretrain_gpt.py).

Importing this package does not import torch."""
