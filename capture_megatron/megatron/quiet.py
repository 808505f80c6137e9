"""megatron-core's warnings that do not concern a capture-megatron user, silenced where they arise
(by message, category and the module that warns), each with the reason; and the one line that
says instead which spec and kernels a run uses.

Without this a cold `plan` printed megatron-core's warnings from every profiling process and
`train` eight per rank, several misleading: "Transformer Engine and Apex are not installed.
Falling back to ..." from each of six modules (the fallbacks are what capture-megatron runs and
measures on purpose, and the run's header line names them), "If you are using transformer_engine
... core_attn ..." for probes that model Megatron-LM's own selective recompute, and "Implicit
initialization of Rerun State Machine!". Warnings a user can act on are left alone. The filters
name modules and import nothing.
"""

from __future__ import annotations

import importlib.util
import logging
import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class Silenced:
    """One warning that is not shown, and why."""

    message: str
    """Regular expression matching the start of the warning's text."""
    category: type[Warning]
    """Its category."""
    module: str
    """Regular expression matching the whole name of the module that warns ('' for any)."""
    why: str
    """Why it does not concern the user."""


SILENCED = (
    Silenced(
        r"(Transformer Engine and )?Apex (is|are) not installed",
        UserWarning,
        r"megatron\.core\..*",
        "the fallbacks (torch norms and optimizers, local multi-tensor kernels) are what CPU "
        "training and the memory models use by design; the header line names the spec and "
        "kernels instead (kernels_line)",
    ),
    Silenced(
        r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
        FutureWarning,
        r"torch\.distributed\..*",  # torch warns from its c10d wrapper, on megatron-core's behalf
        "megatron-core 0.16.1 calls torch's old collective names; nothing a user can change",
    ),
    Silenced(
        r"`load_state_dict` is deprecated and will be removed",
        FutureWarning,
        r"megatron\.core\.dist_checkpointing\..*|torch\.distributed\..*",
        "megatron-core 0.16.1's torch_dist loader calls torch's old checkpoint entry point on "
        "every resume; nothing a user can change",
    ),
    Silenced(
        r"Please use DTensor instead and we are deprecating ShardedTensor",
        FutureWarning,
        "",  # raised where megatron-core builds its ShardedTensors while loading
        "megatron-core 0.16.1 loads torch_dist checkpoints through ShardedTensor; nothing a user "
        "can change",
    ),
    Silenced(
        r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed",
        UserWarning,
        # megatron-core's optimizer; on CPU torch attributes it to the function mode in between
        r"megatron\.core\.optimizer\..*|capture_megatron\.emulate\.cpu_compat",
        "megatron-core's distributed optimizer zeroes the .grad of its fp32 shard views (not "
        "leaves; its zero_grad says so: 'throws grad-access warning'); nothing a user can change",
    ),
    Silenced(
        r"apply_rope_fusion for multi-latent attention only supports training",
        UserWarning,
        r"megatron\.core\.transformer\.transformer_config",
        "megatron-core's note that its fused MLA RoPE is experimental and for training; the "
        "memory models and capture-megatron's runs are training, as Megatron-LM's default "
        "(fused RoPE) asks",
    ),
    Silenced(
        r"recompute_method == 'block' is not supported for MTP yet",
        UserWarning,
        r"megatron\.core\.transformer\.multi_token_prediction",
        "repeated every micro-batch: under block recompute megatron-core keeps the MTP layers' "
        "activations, which is what the memory model measures and the plan's notes say once "
        "(plan/emit.py model_notes)",
    ),
    Silenced(
        r"Using a large number of experts \(e\.g\. >=32\) without fp32 routing",
        UserWarning,
        r"megatron\.core\.transformer\.transformer_config",
        "advice on the routing's numerical stability, raised by every model megatron-core builds "
        "(each profiling probe); it changes no memory a plan is about, and Megatron-LM prints it "
        "again when the run itself starts (--moe-router-dtype fp32 is counted where given)",
    ),
)
"""Warnings silenced in every capture-megatron process that imports megatron-core."""


QUIET_LOGGERS = {
    "torch.utils.cpp_extension": (
        "torch's CUDA build on a machine without the CUDA toolkit (the second CI leg, any CPU "
        "host with torch from the package registry) logs 'No CUDA runtime is found' when "
        "megatron-core imports torch.utils.cpp_extension; nothing is compiled with it"
    ),
}
"""Loggers of torch that warn at import about nothing a user can act on: logger -> why (their
errors still show)."""


def install() -> None:
    """Add the filters of SILENCED to this process's warning filters and quiet QUIET_LOGGERS'
    warnings (idempotent)."""
    for item in SILENCED:
        warnings.filterwarnings("ignore", item.message, item.category, item.module)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def initialize_rerun_state_machine() -> None:
    """Initialise megatron-core's rerun state machine explicitly, disabled, as Megatron-LM's
    initialize_megatron does: the schedules otherwise create it on first use with the warning
    "Implicit initialization of Rerun State Machine!". Its own "initialized in mode DISABLED"
    line (a logger warning) is muted: capture-megatron never reruns steps. Idempotent."""
    from megatron.core import rerun_state_machine as rsm

    if rsm._GLOBAL_RERUN_STATE_MACHINE is not None:  # initialised already (this process, again)
        return
    log = logging.getLogger(rsm.__name__)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        rsm.initialize_rerun_state_machine(mode=rsm.RerunMode.DISABLED)
    finally:
        log.setLevel(level)


def kernels_line(impl: str, device: str) -> str:
    """What runs, in place of megatron-core's fallback warnings: the spec, the device and, when
    Transformer Engine (and Apex) are absent, what stands in for them."""
    te, apex = (
        importlib.util.find_spec(name) is not None for name in ("transformer_engine", "apex")
    )
    if te:
        return f"{impl} spec on {device}"
    if apex:
        return f"{impl} spec on {device} (no Transformer Engine)"
    return f"{impl} spec on {device} (no Transformer Engine or Apex: torch norms and optimizers)"
