"""A Megatron-LM checkout run by capture-megatron (`capture-megatron megatron-lm`): its
pretrain_gpt.py with per-stage recompute (pretrain_gpt), what it needs installed (deps), and its
pretrain() on a machine without CUDA (cpu)."""
