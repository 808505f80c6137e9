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
import re
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
    Silenced(
        r"absl\.logging is not installed",
        UserWarning,
        r"megatron\.core\.hyper_comm_grid",
        "megatron-core 0.19 asks at import for an optional logging package it falls back from; "
        "nothing capture-megatron logs goes through it",
    ),
    Silenced(
        r"Could not determine rank from torch\.distributed, RANK, or SLURM_PROCID",
        UserWarning,
        r"megatron\.core\._rank_utils",
        "megatron-core 0.19 asks for a rank when a profiling process (one process, no "
        "torch.distributed) logs; rank 0 is what that process is",
    ),
    Silenced(
        r"MimoModelConfig is experimental",
        UserWarning,
        r"megatron\.core\.models\.mimo\..*",
        "megatron-core 0.19 warns when its multimodal package is imported (megatron-core's own "
        "imports load it); capture-megatron builds no multimodal model",
    ),
)
"""Warnings silenced in every capture-megatron process that imports megatron-core."""

QUIET_LOG_LINES = {
    "megatron.core.models.gpt.gpt_model": (
        r"GPTModel IS DEPRECATED",
        "megatron-core 0.19 logs it for every GPTModel built (each probe, each rank): "
        "Megatron-LM's pretrain_gpt.py, whose runs capture-megatron forecasts and trains, builds "
        "GPTModel",
    ),
}
"""Log lines of megatron-core that do not concern the user: logger -> (regular expression
matching the start of the line, why); the logger's other lines still show."""


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
    for name, (pattern, _) in QUIET_LOG_LINES.items():
        log = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in log.filters):
            log.addFilter(_Drop(pattern))


class _Drop(logging.Filter):
    """Drops the log records whose message matches a pattern at its start."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


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
