"""Run megatron-core 0.16.1 on a machine without CUDA (CPU, or the meta/fake device for profiling).

Applied only when CUDA is absent: on a GPU machine ``apply()`` makes only the patches megatron-core
needs there too without Transformer Engine (emulate/te_absent.py), unless forced to a device.
Nothing in site-packages is edited; every patch is made at run time and names the Megatron call
sites it serves:

1. ``torch.cuda.current_device`` returns the host device ("cpu" or "meta"). Served call sites:
   ``distributed/param_and_grad_buffer.py`` (grad buffers), ``utils.GlobalMemoryBuffer`` (attention
   and SP scratch), ``models/common/embeddings/rotary_pos_embedding.py`` (inv_freq),
   ``transformer/transformer_layer.py`` and ``optimizer/grad_scaler.py``.
2. RNG: ``tensor_parallel/random.py`` keeps per-name *CUDA* generator states (attention dropout
   always forks 'model-parallel-rng'; ``CheckpointFunction`` saves and restores them for recompute).
   ``CpuRNGStatesTracker`` keeps the same named states as CPU generator states, and the module's
   ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` helpers read and write the CPU generator.
3. ``CudaDeviceMode`` (a ``TorchFunctionMode``) rewrites ``device="cuda"`` arguments to the host
   device. Served call sites: ``pipeline_parallel/schedules.py`` (total_num_tokens),
   ``optimizer/optimizer.py`` (found_inf, _scale_one), ``optimizer/grad_scaler.py``,
   ``optimizer/clip_grads.py`` (norms), ``transformer/utils.get_default_causal_mask``,
   ``dist_checkpointing/exchange_utils.py`` and ``strategies/state_dict_saver.py``; and drops
   ``pin_memory=True`` (``rope_utils.get_pos_emb_on_this_cp_rank`` pins its CP chunk indices;
   the fake-cuda device's ``CudaTypeMode`` drops it too: pinned host memory is not device memory,
   and the ``.cuda()`` copy that follows is the device tensor a GPU allocates).
4. The same mode answers ``Tensor.type()`` with the CUDA type string (``clip_grads.py`` asserts
   'torch.cuda.FloatTensor'; ``optimizer.py`` / ``distrib_optimizer.py`` dispatch on it) and makes
   ``Tensor.cuda()`` an identity (``language_module.py`` moves tied embeddings before all-reduce).
5. ``torch.cuda.synchronize`` / ``empty_cache`` become no-ops (p2p_communication, DDP, checkpoint
   strategies call them unconditionally).
6. Mixture-of-experts layers: the router's TE GEMM name (on every device without TE), the
   alltoall dispatcher's CUDA stream and
   its split sizes (capture_megatron.emulate.moe_cpu, which lists the call sites); on fake
   tensors, what routing values size (capture_megatron.emulate.moe_fake).
7. CUDA streams: ``distributed/distributed_data_parallel.py`` creates a
   ``torch.cuda.Stream`` for gradient reduction with several distributed-optimizer instances, and
   ``param_and_grad_buffer.py`` (``start_grad_sync`` / ``finish_grad_sync``) waits on it and on
   ``torch.cuda.default_stream()``. On the host everything runs in program order: ``HostStream``
   stands in for a stream (waiting on it is a no-op) and ``torch.cuda.stream(s)`` is a null
   context. A CPU build of torch refuses to create a CUDA stream otherwise.
8. On the cpu device, torch.distributed's blocking collectives return only once gloo's worker
   thread has dropped the tensors they were given (capture_megatron.emulate.gloo_settle): the
   temporaries megatron passes them (the MoE dispatcher's permuted tokens) then die where the
   program drops them, not at a point that races with the next allocations.
9. ``tensor_parallel/random.py``'s ``CheckpointWithoutOutput`` (selective recompute of layernorm,
   moe_act, mla_up_proj) sets ``self.fp8 = fp8 is not None``, so with its default ``fp8=False`` it
   asks Transformer Engine's ``FP8GlobalStateManager`` whether FP8 is on and enters TE's
   ``activation_recompute_forward`` / ``fp8_autocast`` contexts -- names imported only when TE
   is installed (a NameError otherwise). Without TE they answer as TE does for a run without FP8:
   FP8 off, no recipe, contexts that do nothing (``NoFp8``).
10. Optimizer CPU offload (``optimizer/cpu_offloading/hybrid_optimizer.py``): HybridDeviceOptimizer
   moves a parameter slice to the host with ``param.detach().clone().cpu().pin_memory()`` and sorts
   slices into its device and host optimizers by ``param.is_cuda``; it records and waits on events
   of its D2H / H2D streams. On the cpu device every tensor is a host tensor, so while it builds
   its sub-optimizers (``_init_sub_optimizers``) ``HostCopies`` tells them apart as on a GPU: what
   ``.cpu()`` / ``.pin_memory()`` returned, and clones / casts of it, are the host copies
   (``is_cuda`` False, ``pin_memory`` returns the copy: no pinned allocator without CUDA), every
   other tensor is the device's; ``HostStream.record_event`` returns a ``HostEvent`` whose
   ``synchronize`` / ``wait`` do nothing (work is in program order).

Every patch is made through capture_megatron.emulate.patches (the registry): ``patches.revert()``
puts torch and megatron-core back as they were (docs/ARCHITECTURE.md, "Patch registry").

Settings that are not patches but are required for correct results on gloo (enforced by the model
builder): ``batch_p2p_comm=False`` (PP+VPP gives wrong gradients otherwise), no CUDA-only fusions
(gradient_accumulation_fusion, masked_softmax_fusion, apply_rope_fusion, bias fusions).
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

from capture_megatron.emulate import gloo_settle, moe_cpu, moe_fake, patches, te_absent

FAKE_CUDA_CAPABILITY = (9, 0)
"""The compute capability the fake CUDA device reports (Hopper)."""
_CUDA_TYPES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.bool: "torch.cuda.BoolTensor",
    torch.uint8: "torch.cuda.ByteTensor",
}


def _is_cuda(device) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class CudaDeviceMode(TorchFunctionMode):
    """Redirects CUDA device arguments, ``Tensor.cuda()`` and ``Tensor.type()`` to the host
    device."""

    def __init__(self, device: str):
        super().__init__()
        self.device = torch.device(device)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _CUDA_TYPES.get(args[0].dtype, func(*args))
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = dict(kwargs, device=self.device)
        if kwargs.get("pin_memory"):  # no pinned-memory allocator without CUDA
            kwargs = dict(kwargs, pin_memory=False)
        if (
            func in (torch.Tensor.to, torch.empty_like)
            and args
            and len(args) > 1
            and _is_cuda(args[1])
        ):
            args = (args[0], self.device) + tuple(args[2:])
        return func(*args, **kwargs)


class CudaTypeMode(TorchFunctionMode):
    """Answers ``Tensor.type()`` of fake CUDA tensors with the CUDA type string (FakeTensor
    answers 'torch.BFloat16Tensor'; megatron's optimizer dispatches on the CUDA name), and creates
    ``pin_memory=True`` host tensors unpinned: ``rope_utils.get_pos_emb_on_this_cp_rank`` (RoPE
    under context parallelism) pins its two CP chunk indices on the host, which a CPU-only torch
    cannot; pinned host memory is not device memory, and the ``.cuda()`` copy that follows
    allocates the same 16-byte int64 device tensor as on a GPU (counted by the meter)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and args[0].is_cuda:
            return _CUDA_TYPES.get(args[0].dtype, func(*args))
        if kwargs.get("pin_memory"):  # host memory: no pinned allocator in a CPU-only torch
            kwargs = dict(kwargs, pin_memory=False)
        return func(*args, **kwargs)


class CpuRNGStatesTracker:
    """Megatron's CudaRNGStatesTracker, keeping its named states as CPU generator states."""

    def __init__(self, *args, **kwargs):
        self.reset()

    def is_initialized(self) -> bool:
        """Whether a state was added or set."""
        return self._is_initialized

    def reset(self) -> None:
        """Drop every named state."""
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict:
        """A shallow copy of the named states."""
        return dict(self.states_)

    def set_states(self, states: dict) -> None:
        """Replace the named states."""
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        """Track a new generator state seeded with `seed`."""
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        """Run the block with the named state, then store it back and restore the previous state."""
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


class NoFp8:
    """Transformer Engine's FP8GlobalStateManager as it answers a run without FP8 (patch 9)."""

    @staticmethod
    def is_fp8_enabled() -> bool:
        """FP8 is off."""
        return False

    @staticmethod
    def get_fp8_recipe() -> None:
        """No FP8 recipe."""


def _install_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    if not mrandom.HAVE_TE:  # patch 9: CheckpointWithoutOutput's TE names, as without FP8
        why = "patch 9: CheckpointWithoutOutput without TE, as TE answers without FP8"
        patches.patch(mrandom, "FP8GlobalStateManager", NoFp8, why, adds=True)
        nullcontext = lambda **k: contextlib.nullcontext()  # noqa: E731
        patches.patch(mrandom, "activation_recompute_forward", nullcontext, why, adds=True)
        patches.patch(mrandom, "fp8_autocast", nullcontext, why, adds=True)
    why = "patch 2: named RNG states (dropout forks, recompute) as CPU generator states"
    patches.patch(mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state(), why)
    patches.patch(
        mrandom, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state), why
    )
    patches.patch(mrandom, "_CUDA_RNG_STATE_TRACKER", CpuRNGStatesTracker(), why)
    patches.patch(mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True, why)
    patches.patch(torch.cuda, "manual_seed", lambda seed: None, why)
    patches.patch(torch.cuda, "manual_seed_all", lambda seed: None, why)


class HostStream:
    """A CUDA stream on the host: work is already in program order, so waiting does nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        """Nothing to wait for."""

    def wait_event(self, event) -> None:
        """Nothing to wait for."""

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def record_event(self, event=None) -> HostEvent:
        """An event that is already complete."""
        return event or HostEvent()


class HostEvent:
    """A CUDA event on the host (patch 10): the work it marks is done when it is recorded."""

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def wait(self, stream=None) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        """Always complete."""
        return True


_HOST = "_capture_megatron_host_copy"
"""The attribute that marks a tensor as a host copy while HostCopies is active."""


class HostCopies(TorchFunctionMode):
    """Patch 10: marks what ``Tensor.cpu()`` / ``Tensor.pin_memory()`` return, and clones and
    casts of it, as host copies; ``pin_memory`` returns the tensor itself."""

    _PROPAGATE = (torch.Tensor.clone, torch.Tensor.detach, torch.Tensor.float, torch.Tensor.to)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = args[0] if func is torch.Tensor.pin_memory else func(*args, **kwargs)
        host = func in (torch.Tensor.cpu, torch.Tensor.pin_memory)
        if isinstance(out, torch.Tensor) and (
            host or (func in self._PROPAGATE and getattr(args[0], _HOST, False))
        ):
            setattr(out, _HOST, True)
        return out


def _install_hybrid_optimizer() -> None:
    """HybridDeviceOptimizer's sub-optimizers built with HostCopies telling host copies from
    device tensors (patch 10)."""
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer as ho

    if not patches.first("hybrid_optimizer"):  # wraps the original once
        return
    cls = ho.HybridDeviceOptimizer
    init = cls._init_sub_optimizers

    def init_sub_optimizers(self) -> None:
        torch.Tensor.is_cuda = property(lambda t: not getattr(t, _HOST, False))  # type: ignore[assignment]  # a property patched over torch's
        try:
            with HostCopies():
                init(self)
        finally:
            del torch.Tensor.is_cuda

    why = "patch 10: optimizer CPU offload tells host copies from device tensors"
    patches.patch(cls, "_init_sub_optimizers", init_sub_optimizers, why)


def _install_streams() -> None:
    """torch.cuda's stream API answered on the host (patch 7)."""
    why = "patch 7: DDP's gradient-reduction stream; work runs in program order"
    patches.patch(torch.cuda, "Stream", HostStream, why)
    patches.patch(torch.cuda, "default_stream", lambda *a, **k: HostStream(), why)
    patches.patch(torch.cuda, "current_stream", lambda *a, **k: HostStream(), why)
    patches.patch(torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext(), why)


def needed() -> bool:
    """True when this process has no usable CUDA device."""
    return not torch.cuda.is_available()


def _install_runtime(current_device) -> None:
    """Patches 1 and 5: the current device, and no-op synchronize / empty_cache."""
    why = "patch 1: megatron-core allocates on current_device() (grad buffers, scratch, RoPE)"
    patches.patch(torch.cuda, "current_device", current_device, why)
    why = "patch 5: p2p, DDP and checkpoint strategies synchronize unconditionally"
    patches.patch(torch.cuda, "synchronize", lambda *a, **k: None, why)
    patches.patch(torch.cuda, "empty_cache", lambda: None, why)


def apply_fake_cuda() -> None:
    """Patch torch/megatron for the fake-cuda device (capture_megatron.emulate.fake_cuda): CUDA
    tensors stay CUDA tensors; only what needs the CUDA runtime is answered here (the current
    device is 0, synchronize / empty_cache do nothing, RNG states are CPU generator states), and
    the GPU kernel modules are installed (capture_megatron.emulate.gpu). Idempotent."""
    if patches.device() == "fake-cuda":
        return
    from capture_megatron.emulate.gpu.install import install

    _install_runtime(lambda: 0)
    # torch.distributed asks for sm90+ before a broadcast of a CUDA tensor; the GPU kernel set
    # models Hopper (H100 / H200), as Megatron-LM's measured functional tests do
    why = "torch.distributed's sm90 check before broadcasting a CUDA tensor; Hopper modelled"
    patches.patch(torch.cuda, "get_device_capability", lambda *a, **k: FAKE_CUDA_CAPABILITY, why)
    _install_rng()
    install()
    apply_without_te()
    moe_cpu.apply()  # no TE, no CUDA streams on this machine: the same names and streams
    moe_fake.apply()
    patches.exit_modes()
    patches.enter(CudaTypeMode())
    patches.set_device("fake-cuda")


def apply(device: str = "cpu") -> None:
    """Patch torch/megatron for `device` ("cpu" or "meta"); idempotent; where CUDA is usable only
    what megatron-core needs without Transformer Engine (te_absent). ``patches.revert()`` undoes
    it."""
    te_absent.apply()
    if patches.device() == device or (device == "cpu" and not needed()):
        return
    patches.exit_modes()
    # megatron-core passes current_device() on as a device: the host's name stands in for the index
    _install_runtime(lambda: device)
    _install_rng()
    apply_without_te()
    moe_cpu.apply()
    moe_fake.apply()
    if device == "cpu":
        gloo_settle.install()
        _install_streams()
        _install_hybrid_optimizer()
    patches.enter(CudaDeviceMode(device))
    patches.set_device(device)


def apply_without_te() -> None:
    """Without Transformer Engine, megatron-core's MLA module still believes it has it (its
    stand-in classes are mocks) and would test its output projection against one; tell it the
    truth (cpu and fake devices only)."""
    from megatron.core.transformer import multi_latent_attention

    if not isinstance(multi_latent_attention.TELinear, type):
        why = "MLA without TE: its stand-in classes are mocks; no TE output projection check"
        patches.patch(multi_latent_attention, "HAVE_TE", False, why)
