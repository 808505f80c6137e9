"""Transformer Engine's FusedAdam, as megatron-core's precision-aware optimizer uses it, for a
machine without TE (the CPU kernel set).

megatron-core 0.16.1 (``optimizer/__init__.py``) builds its Adam from TE's
``transformer_engine.pytorch.optimizers.FusedAdam`` with ``exp_avg_dtype``, ``exp_avg_sq_dtype``,
``master_weights``, ``use_decoupled_grad``, ``master_weight_dtype`` and (TE >= 2.1)
``store_param_remainders``; ``OptimizerConfig`` refuses the precision-aware optimizer when TE does
not import. TE does not install without CUDA, so ``HostFusedAdam`` re-implements TE 2.8's
``FusedAdam`` (``transformer_engine/pytorch/optimizers/fused_adam.py``) for host tensors:

- the same state per parameter: ``exp_avg`` / ``exp_avg_sq`` in their dtypes, ``master_param``
  in fp32 or fp16 -- or, for bf16 parameters with fp32 master weights and
  ``store_param_remainders``, the int16 trailing bits of the fp32 master (the bf16 parameter holds
  the leading ones) -- and an fp32 scale of shape [1] for every state that is not fp32; no step
  tensor (the step is a Python int per group);
- the same step: every non-fp32 state of a parameter group is unscaled to a fresh fp32 copy
  first (TE's ``unscaled_lists``), the update runs, then the copies are scaled back and dropped;
- the update of TE's ``multi_tensor_adam`` kernels (``common/multi_tensor/adam.cu``: AdamW or
  L2 mode, bias correction, the remainder kernel's rounding) on fp32 temporaries one parameter at
  a time (TE's kernel has none).
1-byte states (uint8, TE's Float8Tensor: E4M3 data and fp32 scalars) are torch.float8_e4m3fn tensors
with TE's scale (amax / 448): the same 1 byte per element. Installed in place of megatron's Adam
only for the precision-aware optimizer on a machine without TE (``install``).
"""

from __future__ import annotations

import contextlib

import torch

from capture_megatron.emulate.gpu.common import E4M3_MAX

FP16_RANGE = torch.finfo(torch.float16).max / 2.0
"""The range TE's FusedAdam scales fp16 states to."""


class HostFusedAdam(torch.optim.Optimizer):
    """TE 2.8's FusedAdam (its state layout, step order and arithmetic) on host tensors."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        bias_correction: bool = True,
        adam_w_mode: bool = True,
        master_weights: bool = False,
        master_weight_dtype: torch.dtype = torch.float32,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
        use_decoupled_grad: bool = False,
        store_param_remainders: bool = False,
    ):
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction
        )
        super().__init__(params, defaults)
        self.adam_w_mode = adam_w_mode
        self.master_weights = master_weights
        self.use_decoupled_grad = use_decoupled_grad
        e4m3 = torch.float8_e4m3fn
        self.dtypes = {
            "exp_avg": e4m3 if exp_avg_dtype == torch.uint8 else exp_avg_dtype,
            "exp_avg_sq": e4m3 if exp_avg_sq_dtype == torch.uint8 else exp_avg_sq_dtype,
            "master_param": master_weight_dtype,
        }
        self.store_param_remainders = (
            store_param_remainders and master_weights and master_weight_dtype == torch.float32
        )
        self._scales: dict = {}

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """TE's zero_grad: drop (or zero) .decoupled_grad with use_decoupled_grad."""
        set_to_none = True if set_to_none is None else set_to_none
        if not self.use_decoupled_grad:
            super().zero_grad(set_to_none=set_to_none)
            return
        for group in self.param_groups:
            for p in group["params"]:
                if set_to_none:
                    p.decoupled_grad = None
                elif getattr(p, "decoupled_grad", None) is not None:
                    p.decoupled_grad.zero_()

    def _remainders(self, p: torch.Tensor) -> bool:
        return self.store_param_remainders and p.dtype == torch.bfloat16

    def _init(self, p: torch.Tensor, name: str, zero: bool) -> None:
        dtype = self.dtypes[name]
        if name == "master_param" and self._remainders(p):
            self.state[p][name] = torch.zeros_like(p, dtype=torch.int16)
            return
        data = torch.empty_like(p, dtype=dtype)
        if zero:
            data.zero_()
        self.state[p][name] = data
        if dtype != torch.float32:
            self._scales.setdefault(p, {})[name] = torch.ones([1], dtype=torch.float32)

    def initialize_state(self, p: torch.Tensor, store_param_remainders: bool | None = None) -> None:
        """TE's initialize_state: zero moments, the master weights from the parameter (the
        remainders' use follows the optimizer's setting and the parameter's dtype)."""
        self._init(p, "exp_avg", True)
        self._init(p, "exp_avg_sq", True)
        if self.master_weights:
            self._init(p, "master_param", False)
            if not self._remainders(p):
                self._scale_into(p, "master_param", p.detach().clone().float())

    def _unscaled(self, p: torch.Tensor, name: str) -> torch.Tensor:
        """TE's get_unscaled_state: the fp32 state (or the int16 remainder) itself, or a fresh fp32
        copy."""
        state = self.state[p][name]
        if state.dtype in (torch.float32, torch.int16):
            return state
        out = state.float()
        if state.dtype in (torch.float16, torch.float8_e4m3fn):
            out.mul_(self._scales[p][name])
        return out

    def _scale_into(self, p: torch.Tensor, name: str, unscaled: torch.Tensor) -> None:
        """TE's _apply_scale (or a plain copy for fp32): write `unscaled` into the state."""
        state = self.state[p][name]
        if state.dtype == torch.float32:
            state.copy_(unscaled)
            return
        if state.dtype == torch.bfloat16:
            state.copy_(unscaled.bfloat16())
            return
        top = E4M3_MAX if state.dtype == torch.float8_e4m3fn else FP16_RANGE
        lo, hi = torch.aminmax(unscaled)
        scale = self._scales[p][name]
        torch.div(torch.maximum(-lo, hi).float().view(1), top, out=scale)
        inverse = torch.where(scale > 0, scale.reciprocal(), 0.0)
        unscaled.mul_(inverse)
        state.copy_(unscaled)

    @torch.no_grad()
    def step(self, closure=None):
        """One Adam step over every parameter with a gradient, in TE's order."""
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            if not group["params"]:
                continue
            group["step"] = group.get("step", 0) + 1
            work = []
            for p in group["params"]:
                if len(self.state[p]) == 0:
                    self.initialize_state(p, self._remainders(p))
                g = getattr(p, "decoupled_grad", None) if self.use_decoupled_grad else p.grad
                if g is None:
                    continue
                names = ["exp_avg", "exp_avg_sq"]
                names += ["master_param"] if self.master_weights else []
                work.append((p, g, {n: self._unscaled(p, n) for n in names if n in self.state[p]}))
            for p, g, states in work:
                _adam(self, group, p, g, states)
            for p, _, states in work:
                for name, value in states.items():
                    if value is not self.state[p][name]:
                        self._scale_into(p, name, value)
            del work
        return loss


def _adam(opt: HostFusedAdam, group: dict, p: torch.Tensor, g: torch.Tensor, st: dict) -> None:
    """TE's multi_tensor_adam (or its param-remainder variant) on one parameter, SLICE elements
    at a time (TE's kernel keeps no temporaries; here they are at most a few slices)."""
    beta1, beta2 = group["betas"]
    step, lr, eps, decay = group["step"], group["lr"], group["eps"], group["weight_decay"]
    c1 = 1 - beta1**step if group["bias_correction"] else 1.0
    c2 = 1 - beta2**step if group["bias_correction"] else 1.0
    remainder = "master_param" in st and st["master_param"].dtype == torch.int16
    master = st.get("master_param") if p.dtype != torch.float32 else None
    flat = {n: t.view(-1) for n, t in (("p", p.data), ("g", g), *st.items())}
    for lo in range(0, p.numel(), SLICE):
        part = {n: t[lo : lo + SLICE] for n, t in flat.items()}
        if remainder:
            weight = _from_remainder(part["p"], part["master_param"])
        elif master is not None:
            weight = part["master_param"]
        else:
            weight = part["p"]  # fp32 parameters are their own master (TE's f32 kernel)
        grad = part["g"]
        if not opt.adam_w_mode and decay:
            grad = grad.float().add_(weight, alpha=decay)
        part["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
        part["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        update = part["exp_avg_sq"].div(c2).sqrt_().add_(eps)
        update = torch.div(part["exp_avg"], update, out=update).div_(c1)
        if opt.adam_w_mode and decay:
            update.add_(weight, alpha=decay)
        weight.add_(update, alpha=-lr)
        if remainder:
            _to_remainder(weight, part["p"], part["master_param"])
        elif weight.data_ptr() != part["p"].data_ptr():
            part["p"].copy_(weight)


SLICE = 4096
"""Elements HostFusedAdam updates at a time (its temporaries are a few fp32 slices)."""


def _from_remainder(p: torch.Tensor, rem: torch.Tensor) -> torch.Tensor:
    """The fp32 master weight from a bf16 parameter (its leading 16 bits, rounded) and the int16
    remainder (TE's AdamFunctorMasterParamRemainder: undo the rounding when the remainder is
    negative)."""
    high = p.view(torch.int16).to(torch.int32) - (rem < 0).to(torch.int32)
    bits = (high << 16) | (rem.to(torch.int32) & 0xFFFF)
    return bits.view(torch.float32)


def _to_remainder(master: torch.Tensor, p: torch.Tensor, rem: torch.Tensor) -> None:
    """Split an fp32 master weight into the bf16 parameter (rounded up when the remainder is
    negative) and the int16 remainder, as TE's kernel does."""
    bits = master.view(torch.int32)
    low = (bits & 0xFFFF).to(torch.int16)  # wraps to the signed remainder
    high = (bits >> 16) + (low < 0).to(torch.int32)
    rem.copy_(low)
    p.view(torch.int16).copy_(high.to(torch.int16))


TE_VERSION = "2.8.0"
"""The Transformer Engine release HostFusedAdam follows; megatron-core's version checks in its
optimizer factory are answered for it (store_param_remainders is passed from TE 2.1 on)."""


@contextlib.contextmanager
def installed():
    """megatron-core builds its precision-aware Adam from HostFusedAdam inside this block (when TE
    is absent): the optimizer factory's module-level Adam is swapped, its TE version check
    (``is_te_min_version``, which fails without TE) answers for TE_VERSION, and the distributed
    optimizer's check that it wraps an Adam (``distrib_optimizer.py``: isinstance of its
    module-level Adam) accepts HostFusedAdam."""
    from megatron.core import optimizer as mo
    from megatron.core.optimizer import distrib_optimizer as do
    from packaging.version import Version

    saved = mo.Adam, mo.USING_PYTORCH_OPTIMIZER, mo.is_te_min_version, do.Adam
    mo.Adam = HostFusedAdam
    mo.USING_PYTORCH_OPTIMIZER = False
    do.Adam = (saved[3], HostFusedAdam)

    def te_min_version(version: str, check_equality: bool = True) -> bool:
        if check_equality:
            return Version(TE_VERSION) >= Version(version)
        return Version(TE_VERSION) > Version(version)

    mo.is_te_min_version = te_min_version
    try:
        yield
    finally:
        mo.Adam, mo.USING_PYTORCH_OPTIMIZER, mo.is_te_min_version, do.Adam = saved
