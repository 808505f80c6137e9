"""One home per Megatron feature: each module declares the feature's flags (the fields of its
option dataclass, capture_megatron.fields), what it keeps in memory and what it costs in time, in
Megatron's and Transformer Engine's terms, from numbers (pure Python, below config: the objects
between stages hold these options). Its support rules are in the rule book
(capture_megatron.rules); where the GPU kernel set emulates it on fake CUDA tensors, in
capture_megatron.emulate.gpu. The other stages reach a feature through its options' generic
properties (e.g. Kernels.low_precision, DdpOptions.fsdp.enabled), not its module's internals.

docs/ARCHITECTURE.md lists the homes ("Homes: features, the rule book, the step-time model": each
module with its options, rules, memory terms, time terms and emulation) and has a worked example
of adding one ("How to add a Megatron feature").
"""
