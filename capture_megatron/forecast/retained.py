"""What a chunk with MoE layers retains from its backward until its next forward, and how that moves
its forward and backward peaks (pure Python).

Megatron's MoE token dispatchers keep the last pass's routing tensors (`probs`, `routing_map`).
After a backward those carry the pass's autograd graph, and the graph holds the leaves it started
from: a recomputed layer's detached input (its storage) and that leaf's gradient, and, for the
layers run with autograd, the chunk's received input and its gradient (the input gradient the
schedule sends back). They stay alive until the layer's next forward replaces its routing tensors.
Measured per probe (ProfileRecord.retained_bytes); per chunk:

- no recomputed layer: the kept layers' retention `ret1` (received input + its gradient on middle /
  last chunks; nothing on first / only chunks, whose graph starts at the embedding), and for each
  further MoE layer `retk2 - ret1` (what selective recompute's checkpoint in it leaves: its
  detached input and gradient; 0 without --recompute-modules moe / layernorm / moe_act);
- each recomputed MoE layer: its input and gradient (`retrc` for the chunk's first layer, whose
  input is the chunk's, `ret2 - retrc` for each further one); with the uniform method, each
  checkpointed group holding an MoE layer;
- kept MoE layers after recomputed ones: `retmix - retrc` when the first layer is a recomputed MoE
  layer (its input storage is counted there), else `ret1`.

A forward starts with its chunk's retention alive and frees it layer by layer, so with recomputed
layers its peak can come at the first layer, with everything still retained: the forward peak is at
least the first layer's (measured from such a start) plus the chunk's retention. A backward of fully
recomputed layers grows by what each further recomputed MoE layer retains (`bwdrc2 - bwdrc`,
measured on two recomputed layers). Dense layers retain nothing (measured: 0).
"""

from __future__ import annotations

from collections.abc import Callable

from capture_megatron.fit import KindConstants, ShapeConstants


def _v(value: float | None) -> float:
    return float(value or 0.0)


def _checkpointed(moe: tuple[bool, ...], n: int, uniform: bool) -> list[int]:
    """Where the checkpointed units holding an MoE layer start: each of the first n layers (block
    method), or each group of n layers (uniform method)."""
    width, span = (n, len(moe)) if uniform else (1, n)
    return [g for g in range(0, span, width) if any(moe[g : g + width])]


def retention(
    consts: Callable[[bool], ShapeConstants],
    kind: str,
    moe: tuple[bool, ...],
    n: int,
    uniform: bool,
) -> tuple[float, float]:
    """(retained bytes, of them the chunk's input gradient) of a chunk whose layers are of
    variants `moe` (per layer: an MoE layer?), the first n fully recomputed (all, n at a time, when
    `uniform`)."""
    if not any(moe):
        return 0.0, 0.0
    sc = consts(True)
    c, mid = sc.chunk(kind), sc.chunk("middle")
    further = _v(mid.ret2) - _v(mid.retrc)
    starts = _checkpointed(moe, n, uniform and bool(n))
    ret = sum(_v(c.retrc) if g == 0 else further for g in starts)
    grad = _v(c.gradrc) if starts and starts[0] == 0 else 0.0
    if not (uniform and n) and any(moe[n:]):  # kept MoE layers
        if n and moe[0]:
            ret += _v(c.retmix) - _v(c.retrc)
            grad += _v(c.gradmix) - _v(c.gradrc)
        else:
            kept = sum(moe[n:]) - 1  # further kept MoE layers: what selective recompute leaves
            ret, grad = (
                ret + _v(c.ret1) + kept * max(_v(mid.retk2) - _v(mid.ret1), 0.0),
                grad + _v(c.grad1),
            )
    return ret, grad


def peaks(
    consts: Callable[[bool], ShapeConstants],
    kind: str,
    moe: tuple[bool, ...],
    n: int,
    uniform: bool,
    ret: float,
) -> tuple[float, float, float]:
    """(the least forward peak, the least backward peak, what the backward peak grows by) of a
    chunk retaining `ret` bytes: a recomputed first layer peaks with the whole retention still
    alive; a backward of only recomputed layers holds what each further recomputed MoE layer
    retains (block method: from the two-layer probe of the chunk's kind on; uniform: added per
    further group)."""
    none = -float("inf")
    if not ret or not n:
        return none, none, 0.0
    first: KindConstants = consts(moe[0]).chunk(kind)
    floor = first.forward_recomputed - _v(first.retrc) + ret
    if n < len(moe) and not uniform:
        return floor, none, 0.0
    own, mid = consts(True).chunk(kind), consts(True).chunk("middle")
    step = max(_v(mid.bwdrc2) - _v(mid.bwdrc), 0.0) if mid.bwdrc2 is not None else 0.0
    count = sum(1 for g in _checkpointed(moe, n, uniform) if g > 0)
    if uniform or not count or own.bwdrc2 is None:
        return floor, none, step * count
    return floor, own.bwdrc2 + (count - 1) * step, 0.0
