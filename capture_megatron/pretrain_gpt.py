"""`torchrun -m capture_megatron.pretrain_gpt <Megatron flags>`: the training entry point's stable
module name (docs/ARCHITECTURE.md); the code is capture_megatron.train.entry."""

from capture_megatron.train.entry import end_process, main

if __name__ == "__main__":
    end_process(main())
