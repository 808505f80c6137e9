"""Optimizer state and step memory of megatron-core's optimizers besides Adam for one chunk
(capture_megatron.features.optimizers: SGD, Muon, layer-wise distributed Muon). Pure Python.

None of them runs with megatron-core's distributed optimizer, so a chunk's gradient buffers and
parameters are those of plain DDP (forecast.static, unchanged); what differs is the state kept per
parameter, which parameters a layer-wise distributed Muon rank keeps it for, and what the step
allocates."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from capture_megatron.config import DdpOptions
from capture_megatron.config.kernels import FOREACH_ADAM_BYTES
from capture_megatron.features.optimizers import Optimizer, layer_wise_share
from capture_megatron.forecast.layers import Layers
from capture_megatron.forecast.static import LayerRun, StaticBytes


@dataclass(frozen=True)
class Params:
    """A chunk's parameters as the optimizers see them: element counts, whether each is a routed
    expert's (expert-data-parallel) and whether Muon leaves it to Adam (word embedding, output
    layer)."""

    numels: tuple[int, ...]
    """Elements of each parameter."""
    expert: tuple[bool, ...]
    """Per parameter: a routed expert's."""
    adam: tuple[bool, ...]
    """Per parameter: updated by Adam under Muon (the word embedding and the output layer, whose
    size is the vocabulary rows of a TP rank times the hidden size)."""


def chunk_params(
    pre: tuple[int, ...],
    runs: tuple[LayerRun, ...],
    post: tuple[int, ...],
    post_expert: tuple[bool, ...],
    embedding: int,
) -> Params:
    """Params of a chunk laid out as forecast.static.layer_static's arguments (`embedding`:
    elements of the word embedding / output layer weight on a TP rank)."""
    numels = list(pre)
    expert = [False] * len(pre)
    for layer, mask, count in runs:
        numels += list(layer) * count
        expert += list(mask) * count
    numels += list(post)
    expert += list(post_expert or (False,) * len(post))
    ends = set(range(len(pre))) | set(range(len(numels) - len(post), len(numels)))
    adam = tuple(i in ends and n == embedding for i, n in enumerate(numels))
    return Params(tuple(numels), tuple(expert), adam)


@dataclass(frozen=True)
class OptimizerBytes:
    """What a chunk's optimizer keeps and allocates on the most loaded data-parallel rank."""

    static: StaticBytes
    """The chunk's static bytes with this optimizer's state (and gradient copies) in place of
    Adam's."""
    step: int
    """The optimizer step's peak beyond the state and the gradient copies: the largest of the
    temporaries of one parameter (Muon's orthogonalization, torch's SGD; `adam_largest` gives
    the Adam part's)."""
    adam_largest: int
    """Elements of the largest parameter updated by Adam (Muon's embedding and output layer;
    0 for SGD)."""
    gathered: tuple[float, float] = (0.0, 0.0)
    """dist_muon: bytes the all-gather after the step allocates for this chunk's (dense, expert)
    parameters: the rank's own flat copy and one buffer per rank (every parameter); the rank
    adds every chunk's (forecast.ranks)."""


def non_adam_bytes(
    opt: Optimizer,
    st: StaticBytes,
    params: Params,
    dtype: str,
    dp: tuple[int, int],
    tp: int,
    torch_kernels: bool,
) -> OptimizerBytes:
    """The chunk's optimizer bytes with `opt` (not Adam) from its DDP static bytes `st` (laid out
    without the distributed optimizer, as these optimizers run), trained in `dtype` over `dp`
    (data x context-parallel, expert-data-parallel) ranks at TP `tp`."""
    owned = _owned(opt, params, dp)
    total = sum(params.numels) or 1
    elements = sum(params.numels[i] for i in owned)
    state = sum(params.numels[i] * opt.state_bytes(dtype, params.adam[i]) for i in owned)
    adam = [i for i in owned if params.adam[i] and opt.muon]
    state += 4 * len(adam) if opt.muon else 0  # Adam's step counter per parameter
    rest = [params.numels[i] for i in owned if not (params.adam[i] and opt.muon)]
    largest = max(rest, default=0)
    copies = round(st.copies * elements / total)  # fp32 gradient copies of the rank's own
    static = dataclasses.replace(st, optimizer=state, copies=copies, largest=largest)
    gathered = _gathered(params, owned, dtype, dp) if opt.layer_wise else (0.0, 0.0)
    return OptimizerBytes(
        static,
        opt.step_temp(largest, tp, torch_kernels),
        max((params.numels[i] for i in adam), default=0),
        gathered,
    )


def _owned(opt: Optimizer, params: Params, dp: tuple[int, int]) -> list[int]:
    """Indices of the parameters whose state the most loaded data-parallel rank keeps: all of
    them, or with dist_muon its ping-pong share of each group (dense over dp[0], expert over
    dp[1])."""
    if not opt.layer_wise:
        return list(range(len(params.numels)))
    owned = []
    for expert, ranks in ((False, dp[0]), (True, dp[1])):
        group = [i for i, e in enumerate(params.expert) if e == expert]
        share = layer_wise_share([params.numels[i] for i in group], ranks)
        owned += [group[j] for j in share]
    return sorted(owned)


def _gathered(
    params: Params, owned: list[int], dtype: str, dp: tuple[int, int]
) -> tuple[float, float]:
    """dist_muon's all-gather per group, (own + every parameter) x the parameters' bytes; none
    over a group of one rank (LayerWiseDistributedOptimizer skips it)."""
    size = 4 if dtype == "fp32" else 2
    out = []
    for expert, ranks in ((False, dp[0]), (True, dp[1])):
        group = [i for i, e in enumerate(params.expert) if e == expert]
        mine = sum(params.numels[i] for i in owned if params.expert[i] == expert)
        every = sum(params.numels[i] for i in group)
        out.append(float(size * (mine + every)) if every and ranks > 1 else 0.0)
    return out[0], out[1]


def chunk_optimizer(
    opt: Optimizer,
    st: StaticBytes,
    step: float,
    params: Params,
    dtype: str,
    dp: tuple[int, int],
    tp: int,
    adam_temp: int,
) -> tuple[StaticBytes, float, tuple[float, float]]:
    """(static bytes, the step's peak beyond the copies, dist_muon's gathers) of a chunk whose
    DDP static bytes are `st` and whose step without the optimizer's temporaries is `step`;
    `adam_temp`: bytes per element of the largest parameter torch's Adam holds at its step (0
    where Transformer Engine's fused Adam runs), which Muon's Adam part adds after Muon's own."""
    ob = non_adam_bytes(opt, st, params, dtype, dp, tp, torch_kernels=adam_temp > 0)
    temp = max(ob.step, adam_temp * ob.adam_largest)  # one optimizer of the chain at a time
    return ob.static, max(step + temp, 0.0), ob.gathered


def chunk_state(
    opt: Optimizer,
    st: StaticBytes,
    step: float,
    parts: tuple[tuple[int, ...], tuple[LayerRun, ...], tuple[int, ...], tuple[bool, ...]],
    shape: tuple[str, int, int],
    dp: tuple[int, int],
    adam_temp: int,
) -> tuple[StaticBytes, float, tuple[float, float]]:
    """chunk_optimizer of a chunk given as (pre, runs, post, which of post are routed experts')
    for a model `shape` = (dtype, TP size, elements of the word embedding on a TP rank)."""
    dtype, tp, embedding = shape
    params = chunk_params(*parts, embedding)
    return chunk_optimizer(opt, st, step, params, dtype, dp, tp, adam_temp)


ADAM_TEMP = 12
"""Bytes per element of the largest parameter slice a rank updates that torch's Adam (the CPU
kernel set's optimizer: megatron-core falls back to torch.optim.AdamW without TE or apex) holds at
its step's peak: its single-tensor loop builds each denominator as `exp_avg_sq.sqrt() /
bias_correction2_sqrt` (two fp32 temporaries) while the previous parameter's denominator is still
bound (one more): 4 n_prev + 8 n, at most 12 x the largest slice -- exactly that when the two
largest follow one another, as a layer's fc1 and fc2 do (measured: the probes' step timelines)."""


def fused_adam_step(ddp: DdpOptions, largest: int, cpu: bool) -> tuple[float, float]:
    """(step peak beside the copies, step peak without them) of the precision-aware optimizer:
    Transformer Engine's FusedAdam keeps no temporaries besides its fp32 state copies
    (StaticBytes.copies), except that writing a bf16 state back makes a bf16 copy of one
    parameter's state (`_apply_scale`: `unscaled_state.bfloat16()`); on the CPU kernel set
    megatron's local multi-tensor fallback scales a clipped gradient into a fresh fp32 copy
    (`utils.local_multi_tensor_scale`: `src * scale`) before the step, where TE / apex scale in
    place. The probes' measured step (torch's Adam) does not apply."""
    bf16 = "bf16" in (ddp.exp_avg_dtype, ddp.exp_avg_sq_dtype)
    return (2.0 * largest if bf16 else 0.0), (4.0 * largest if cpu else 0.0)


def adam_step(
    ddp: DdpOptions, st: StaticBytes, step: float, layers: Layers
) -> tuple[float, float, float]:
    """(the step's peak, the fused step's peak without the copies, the rank's foreach temporaries)
    of Adam on a chunk: TE's precision-aware FusedAdam (fused_adam_step), torch's single-tensor
    AdamW on the CPU kernel set (ADAM_TEMP per element of the largest slice) or torch's foreach
    AdamW on a GPU without TE or apex (one temporary per updated element: one optimizer steps every
    chunk of the rank together), else the measured step."""
    if ddp.use_precision_aware_optimizer:
        return (*fused_adam_step(ddp, st.largest, layers.torch_adam), 0.0)
    if layers.torch_adam:
        return max(step + ADAM_TEMP * st.largest, 0.0), 0.0, 0.0
    if layers.foreach_adam and not ddp.optimizer_cpu_offload:
        return step, 0.0, FOREACH_ADAM_BYTES * st.owned
    return step, 0.0, 0.0
