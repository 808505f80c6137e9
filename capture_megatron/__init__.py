"""capture-megatron: profile, predict and balance per-GPU peak memory of Megatron-Core training."""

__version__ = "0.6.0"
