"""Everything that lets megatron-core run without CUDA: one reversible patch registry (patches),
the CPU kernel set (cpu_compat, moe_cpu, gloo_settle, host_adam, cp_attention), fake tensors and
fake CUDA (fake_cuda, moe_fake) and the GPU kernel set emulated on them (gpu/)."""
