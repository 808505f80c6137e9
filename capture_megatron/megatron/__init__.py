"""Megatron-Core underneath: run it on CPU and fake tensors (cpu_compat, ckpt_fixes), build a rank's
GPT chunks (builder, init, norms), Megatron-LM's training set-up (training), Megatron-LM's flags
(flags: the parser generated from the config fields; args: parsed flags -> typed objects), and the
wrapper that runs a user's Megatron-LM checkout with per-stage recompute (lm_pretrain_gpt).

Importing this package does not import torch; flags and args never do."""
