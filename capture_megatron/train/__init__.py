"""Train: the torchrun entry point (entry, run as `-m capture_megatron.pretrain_gpt`), the training
loop on megatron-core's schedules (trainer, loop), data (data), checkpoints (checkpoint), the
measured MemoryReport (report), and launching: torchrun (launch), Slurm batch scripts (slurm),
predicted vs measured (compare). Importing this package does not import torch."""
