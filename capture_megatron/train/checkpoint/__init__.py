"""Checkpoints of a training run: saving and loading them through megatron-core's distributed
checkpointing (save_load), which one a resume trusts and where it lives (directory, verify: the
tracker, the publish note, the SHA-256 manifest), the --save directory held by one run and what it
may write there (lock, claim), reading one without running code from it (trust),
optimizer state across a change of megatron-core's optimizer chain (rechain), and two fixes to
megatron-core 0.16.1's fully reshardable optimizer checkpoints (megatron_fixes)."""
