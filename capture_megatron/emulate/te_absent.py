"""What megatron-core needs when Transformer Engine is not installed, on every device: the
CPU, the fake devices and a GPU alike (a GPU machine without TE trains the local spec).

megatron-core 0.16's ``transformer/moe/moe_utils.py`` defines ``te_general_gemm`` only when TE
imports (0.19 binds it to None itself), but the MoE router's ``RouterGatingLinearFunction.forward``
/ ``backward`` (its gating GEMM) read the name unconditionally and fall back to ``torch.mm`` when it
is None: without TE the router raises NameError at its first forward, on a GPU as on the CPU
(measured on an H200, issue 52). The name is set to None, megatron-core's own "no TE" value. With TE
installed nothing is patched.

Applied by ``cpu_compat.apply`` (training and CPU probes, also where CUDA is usable) and
``cpu_compat.apply_fake_cuda`` (fake-cuda probes), through the patch registry.
"""

from __future__ import annotations

from capture_megatron.emulate import patches


def apply() -> None:
    """Supply the names megatron-core binds only when TE imports (idempotent; nothing with TE)."""
    if not patches.first("te_absent"):
        return
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # 0.19 binds it to None itself without TE
        why = "without TE, every device: the MoE router's TE GEMM name, None = no TE"
        patches.patch(moe_utils, "te_general_gemm", None, why, adds=True, versions="0.16")
