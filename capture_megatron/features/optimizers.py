"""megatron-core's optimizers besides Adam (`--optimizer sgd | muon | dist_muon`, core_v0.16.1):
what each keeps per parameter element, what its step allocates, and what megatron-core and
Megatron-LM refuse of them. Pure Python: no torch import here.

- sgd (optimizer/__init__.py:401-408): Transformer Engine's (or apex's) FusedSGD, torch's SGD
  without them, wrapped like Adam (Float16OptimizerWithFloat16Params: an fp32 master copy of every
  16-bit parameter). Its only state is one `momentum_buffer` per parameter in the master's dtype
  (fp32), made at the first step, none at --sgd-momentum 0. The fused kernels allocate nothing at
  the step; torch's single-tensor SGD (the CPU kernel set) makes `grad.add(param, alpha=wd)`, one
  fp32 copy of the parameter it updates (weight decay is never 0 by default). megatron-core's
  DistributedOptimizer asserts Adam (distrib_optimizer.py: 'Only Adam and HybridDeviceOptimizer
  currently supported'), so SGD runs without --use-distributed-optimizer.
- muon (optimizer/muon.py get_megatron_muon_optimizer; Emerging-Optimizers v0.1.0, the version
  Megatron-LM core_v0.16.1 pins): every 2-D parameter but the word embedding and the output layer
  (`is_embedding_or_output_parameter`) goes to TensorParallelMuon, whose state is one fp32
  `momentum_buffer` (of the fp32 master, Float16OptimizerWithFloat16Params); the rest (the
  embedding, the output layer, 1-D norms and biases) to Adam as usual (fp32 master, two fp32
  moments, a step counter). At the step each Muon parameter is orthogonalized in turn
  (OrthogonalizedOptimizer.step, muon_utils.newton_schulz): the momentum normalized to a fresh
  fp32 tensor, cast to bf16 under --muon-fp32-matmul-prec medium (the default; fp32 otherwise),
  five Newton-Schulz steps X' = aX + (bA + cA A) X with A = X X^T on the smaller side (at most
  two X and two [k, k] products alive, k^2 <= elements), back to fp32, then `orth * scale *
  extra_scale` (three fp32 copies at once): MUON_TEMP bytes per element of the largest Muon
  parameter, 4 more with --muon-use-nesterov (`grad.lerp(...)` is a fresh tensor), and with
  --muon-tp-mode duplicated the TP shards gathered whole (tp copies, their concatenation, and the
  orthogonalization of the full tensor). Megatron-LM asserts Muon without
  --overlap-grad-reduce, --overlap-param-gather, the distributed optimizer or FSDP, with
  --ckpt-format torch or torch_dist; megatron-core raises for fp16.
- dist_muon (LayerWiseDistributedOptimizer, optimizer/layer_wise_optimizer.py): the same
  optimizers, each DP rank keeping master weights and state only for the parameters assigned to
  it -- all of a chunk's parameters sorted by size and dealt out ping-pong (0, 1, .., R-1, R-1, ..,
  0) over the data x context-parallel ranks (expert parameters over the expert-data-parallel
  ranks) -- and after the step all-gathering the updated parameters: one flat copy of its own
  parameters and one buffer per rank, every parameter of the group, in the parameters' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from capture_megatron.errors import require
from capture_megatron.fields import flag
from capture_megatron.serial import JsonMixin

OPTIMIZERS = ("adam", "sgd", "muon", "dist_muon")
"""Megatron-LM's --optimizer choices."""
MUON_TP_MODES = ("blockwise", "duplicated", "distributed")
"""Megatron-LM's --muon-tp-mode choices."""
MUON_PRECISIONS = ("low", "medium", "high")
"""Megatron-LM's --muon-fp32-matmul-prec choices."""
MUON_TEMP = 12
"""Bytes per element of the largest Muon parameter its step holds at most beyond its state with
bf16 Newton-Schulz (medium precision): the scaling's three fp32 copies (the orthogonalized update,
`* scale`, `* extra_scale`); the bf16 iteration holds at most 2 x 2 bytes of X and 2 x 2 of
[k, k] products (k^2 <= elements), the normalization 4 + 2."""
MUON_TEMP_FP32 = 16
"""MUON_TEMP with fp32 Newton-Schulz (--muon-fp32-matmul-prec low / high): two fp32 X and two
fp32 [k, k] products."""
SGD_TEMP = 4
"""Bytes per element of the largest parameter torch's single-tensor SGD (the CPU kernel set)
holds at its step: `grad.add(param, alpha=weight_decay)`, one fp32 tensor."""


@dataclass(frozen=True)
class Optimizer(JsonMixin):
    """The optimizer megatron-core builds (Megatron flags): Adam, SGD, Muon or layer-wise
    distributed Muon, and the settings that change what they keep or allocate."""

    optimizer: str = flag("--optimizer", "adam", choices=OPTIMIZERS, omit_default=True)
    """adam (Megatron-LM's default), sgd, muon or dist_muon (Muon with each data-parallel rank
    keeping the state of its share of the parameters)."""
    sgd_momentum: float = flag("--sgd-momentum", 0.9, omit_default=True)
    """SGD's momentum factor: 0 keeps no momentum buffer."""
    muon_tp_mode: str = flag(
        "--muon-tp-mode", "blockwise", choices=MUON_TP_MODES, omit_default=True
    )
    """How Muon orthogonalizes tensor-parallel weights: blockwise (each TP shard alone),
    duplicated (the shards all-gathered, the full tensor on every TP rank) or distributed."""
    muon_use_nesterov: bool = flag("--muon-use-nesterov", False, omit_default=True)
    """Nesterov momentum in Muon's inner SGD (one more fp32 copy of the parameter at its step)."""
    muon_fp32_matmul_prec: str = flag(
        "--muon-fp32-matmul-prec", "medium", choices=MUON_PRECISIONS, omit_default=True
    )
    """Newton-Schulz matmul precision: medium iterates in bf16, low and high in fp32."""

    def __post_init__(self) -> None:
        p = []
        if self.optimizer not in OPTIMIZERS:
            p.append(f"--optimizer {self.optimizer!r} not one of {OPTIMIZERS}")
        if self.sgd_momentum < 0:
            p.append(f"--sgd-momentum {self.sgd_momentum} must be >= 0")
        require(p, "optimizer settings")

    @property
    def muon(self) -> bool:
        """Muon, layer-wise distributed or not."""
        return "muon" in self.optimizer

    @property
    def layer_wise(self) -> bool:
        """dist_muon: each data-parallel rank updates its share of the parameters."""
        return self.optimizer == "dist_muon"

    def state_bytes(self, dtype: str, adam: bool) -> int:
        """Bytes the optimizer keeps per element of a parameter (master weights and state) when
        training in `dtype`, without the distributed optimizer; `adam`: a parameter Muon leaves
        to Adam (sgd and adam ignore it)."""
        master = 4 if dtype != "fp32" else 0
        if self.optimizer == "sgd":
            return master + (4 if self.sgd_momentum else 0)
        return master + (8 if adam or not self.muon else 4)

    def step_temp(self, largest: int, tp: int, torch_kernels: bool) -> int:
        """Bytes the optimizer's step allocates at most beyond its state for the largest
        parameter it updates alone (`largest` elements; Muon: its largest Muon parameter), at TP
        size `tp`; `torch_kernels`: torch's optimizers run (the CPU kernel set: SGD's copy)."""
        if self.optimizer == "sgd":
            return SGD_TEMP * largest if torch_kernels else 0
        if not self.muon:
            return 0
        fp32 = self.muon_fp32_matmul_prec != "medium"
        per = MUON_TEMP_FP32 if fp32 else MUON_TEMP
        n = largest * (tp if self.muon_tp_mode == "duplicated" else 1)
        gathered = 8 * n if self.muon_tp_mode == "duplicated" and tp > 1 else 0  # shards + cat
        return per * n + gathered + (4 * largest if self.muon_use_nesterov else 0)


DEFAULT_OPTIMIZER = Optimizer()
"""Megatron-LM's default: Adam."""


def layer_wise_share(numels: list[int], ranks: int) -> list[int]:
    """Indices of `numels` (one group's parameters) that the most loaded of `ranks` data-parallel
    ranks keeps under LayerWiseDistributedOptimizer: parameters sorted by size (stable), dealt
    out in the ping-pong order 0, 1, .., R-1, R-1, .., 0, 0, 1, ..; the rank with the most
    elements."""
    if ranks <= 1:
        return list(range(len(numels)))
    loop = list(range(ranks)) + list(range(ranks))[::-1]
    owned: list[list[int]] = [[] for _ in range(ranks)]
    for i, index in enumerate(sorted(range(len(numels)), key=lambda j: numels[j])):
        owned[loop[i % len(loop)]].append(index)
    return max(owned, key=lambda idx: sum(numels[j] for j in idx))
