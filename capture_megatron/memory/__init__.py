"""Memory measurement: exact live-tensor accounting (CPU, fake tensors) and CUDA allocator
statistics."""
