"""Megatron-LM's own pretrain() (core_v0.16.x) on a machine without CUDA, so that the wrapper
(capture_megatron.megatron_lm.pretrain_gpt) can be run end to end where there is no GPU (CI, a
laptop). Megatron-LM supports CUDA only; nothing here makes CPU training a supported mode of it.

Applied by the wrapper only when torch sees no CUDA device. On top of megatron-core's CPU patches
(capture_megatron.emulate.cpu_compat: current device, RNG tracker, device="cuda" arguments), each
patch below names the Megatron-LM call that fails without it, in the order a run meets them:

1. megatron/training/initialize.py `initialize_megatron`: `assert torch.cuda.is_available(),
   "Megatron requires CUDA."` -- called with its own `allow_no_cuda=True`.
2. `_initialize_distributed` creates the model-parallel groups only `if device_count > 0`
   (torch.cuda.device_count()), and `_set_random_seed` then fails at
   `mpu.get_pipeline_model_parallel_rank()` -- device_count answers 1, set_device does nothing.
3. `_compile_dependencies` -> megatron/legacy/fused_kernels `load()` runs `$CUDA_HOME/bin/nvcc -V`
   (CUDA_HOME is None: TypeError) and builds nothing else -- skipped.
4. megatron/training/training.py `get_model` creates a side `torch.cuda.Stream()` for DDP set-up
   ("torch.cuda.Stream requires CUDA support") -- a stream that does nothing.
5. megatron/core/rerun_state_machine.py `_save_state` reads `torch.cuda.get_rng_state()` every
   step ("Torch not compiled with CUDA enabled") -- the CPU generator's state.
6. On gloo the interleaved schedule needs p2p neither overlapped nor batched: with
   `overlap_p2p_comm` (Megatron-LM's default under VPP) the first step's grad norm is NaN, with
   `batch_p2p_comm` gradients are wrong (found running the interleaved schedule on gloo) -- both
   off (`gloo_p2p`).

Flags CPU kernels need are appended to the command line (CPU_FLAGS; the last value wins).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from capture_megatron.emulate import cpu_compat

CPU_FLAGS = (
    "--transformer-impl",
    "local",
    "--distributed-backend",
    "gloo",
    "--no-persist-layer-norm",
    "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion",
    "--no-rope-fusion",
)
"""Megatron-LM flags a CPU run needs: the local spec (Transformer Engine needs CUDA), gloo, torch's
LayerNorm (persist_layer_norm is Apex's), and no fused CUDA kernels."""


class _Stream:
    """A CUDA stream that does nothing (CPU work is ordered anyway)."""

    def wait_stream(self, *args: object) -> None:
        """Nothing to wait for."""

    def synchronize(self) -> None:
        """Nothing to synchronize."""


def apply() -> None:
    """Patch torch and Megatron-LM (already on sys.path) for a CPU run (see the module's doc)."""
    cpu_compat.apply("cpu")
    import megatron.legacy.fused_kernels as fused_kernels
    import megatron.training.training as training

    training.initialize_megatron = functools.partial(
        training.initialize_megatron, allow_no_cuda=True
    )
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda *args, **kwargs: None
    fused_kernels.load = lambda args: None
    torch.cuda.Stream = lambda *args, **kwargs: _Stream()  # type: ignore[assignment,misc]  # host stand-ins for torch.cuda
    torch.cuda.current_stream = lambda *args, **kwargs: _Stream()  # type: ignore[assignment]  # as above
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()  # type: ignore[assignment]  # as above
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)


def gloo_p2p(model):
    """The model chunk with pipeline p2p neither overlapped nor batched (item 6)."""
    model.config.overlap_p2p_comm = False
    model.config.batch_p2p_comm = False
    return model
