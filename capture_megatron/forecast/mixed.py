"""Activations of a chunk whose transformer layers are of different variants (dense and MoE layers
mixed by --moe-layer-freq), composed layer by layer in their order (pure Python).

Each layer brings its own variant's constants, measured on chunks of one variant: S (what it
saves), R / R2 (what it keeps when recomputed) and the chunk constants of a one-layer chunk (fwd1,
bwd1, fwdrc, bwdrc, bwdmix), which hold the layer's own transient plus the chunk's ends. The
composition follows the one-variant formulas of capture_megatron.forecast.chunks term by term, and
equals them when every layer is of one variant (tests/unit/test_mixed_layers.py):

- saved: the ends' saved bytes, what the recomputed layers keep, and every other layer's S;
- forward: a layer's forward runs on top of what the layers before it saved, so the chunk's peak is
  the largest over its layers of (that layer's one-layer peak + the S of the layers before it);
- backward: a layer's backward runs after the layers after it freed what they saved, so the peak is
  the largest over its layers of (its one-layer peak - the S of the layers after it); a recomputed
  layer's (block method) after every kept layer freed its S;
- uniform recompute: each group of n layers keeps its input and its backward re-creates the group's
  layers at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from capture_megatron.fit import ShapeConstants


class Costs(NamedTuple):
    """A chunk's activation bytes for one micro-batch (what a rank's peak is built from)."""

    input: float
    """Bytes of the activation the chunk receives per micro-batch (ChunkCost.input_bytes)."""
    saved: float
    """Bytes a micro-batch in flight holds beyond its input between its forward and backward."""
    forward: float
    """Forward peak above the live bytes before it, input already received (ChunkCost.forward)."""
    backward: float
    """Backward peak above the live bytes before it (ChunkCost.backward)."""
    recomputed: float
    """Of `backward`: the activations a full-recompute backward re-creates and holds at its
    peak (ChunkCost.recomputed; 0 without recompute)."""


class _Per:
    """Per layer of a chunk: its constants, S, R and R2."""

    def __init__(self, consts: Callable[[bool], ShapeConstants], kind: str, moe: tuple[bool, ...]):
        scs = [consts(m) for m in moe]
        self.c = [sc.chunk(kind) for sc in scs]
        self.s = [sc.layer_saved for sc in scs]
        self.r = [sc.layer_saved_rc or 0.0 for sc in scs]
        self.r2 = [
            r if sc.layer_saved_rc_next is None else sc.layer_saved_rc_next
            for r, sc in zip(self.r, scs)
        ]
        self.ends = self.c[0].saved1 - self.s[0]  # the chunk's own saved bytes beyond its layers

    def again(self, i: int) -> float:
        """What a recomputed layer's backward re-creates: its S less its kept input."""
        return max(self.s[i] - self.r2[i], 0.0)


def block(
    consts: Callable[[bool], ShapeConstants], kind: str, moe: tuple[bool, ...], n: int
) -> Costs:
    """Costs of a chunk with layers of variants `moe` (per layer: an MoE layer?), the first `n`
    fully recomputed (block method; 0: none)."""
    p, k = _Per(consts, kind, moe), len(moe)
    kept = p.r[0] + sum(p.r2[1:n]) if n else 0.0
    saved = p.ends + kept + sum(p.s[n:])
    if n < k:
        fwd = max(p.c[i].fwd1 + kept + sum(p.s[n:i]) for i in range(n, k))
        fwd += p.r2[0] - p.r[0] if n else 0.0
    else:
        fwd = max(p.c[i].forward_recomputed + sum(p.r2[:i]) for i in range(k))
    normal = max((p.c[i].bwd1 - sum(p.s[i + 1 :]), -1) for i in range(n, k)) if n < k else None
    if n == 0:
        bwd, at = normal if normal is not None else (0.0, -1)
    elif n < k:
        freed = sum(p.s[n:])
        redo = max(
            (p.c[i].backward_mixed + p.s[i] - freed - sum(p.r2[i + 1 : n]), i) for i in range(n)
        )
        assert normal is not None
        bwd, at = redo if redo[0] >= normal[0] else normal
    else:
        bwd, at = max((p.c[i].backward_recomputed - sum(p.r2[i + 1 :]), i) for i in range(k))
    redone = p.again(at) if at >= 0 else 0.0
    return Costs(p.c[0].input_bytes, saved, fwd, bwd, min(redone, max(bwd, 0.0)))


def uniform(
    consts: Callable[[bool], ShapeConstants], kind: str, moe: tuple[bool, ...], n: int
) -> Costs:
    """Costs of a chunk with layers of variants `moe`, all recomputed n at a time (--recompute-
    method uniform: groups of n consecutive layers, the last group holding the rest)."""
    p, k = _Per(consts, kind, moe), len(moe)
    groups = [list(range(g, min(g + n, k))) for g in range(0, k, n)]
    firsts = [g[0] for g in groups]
    saved = p.ends + p.r[0] + sum(p.r2[i] for i in firsts[1:])
    fwd = max(
        p.c[i].forward_recomputed + sum(p.r2[j] for j in firsts[1 : g + 1])
        for g, group in enumerate(groups)
        for i in group
    )
    bwd, redone = -float("inf"), 0.0
    for g, group in reversed(list(enumerate(groups))):  # the last group wins ties
        last, final = group[-1], g == len(groups) - 1
        held = sum(p.s[i] for i in group[:-1])
        own = p.c[last].backward_recomputed + held - (0.0 if final else p.r2[group[0]])
        if own > bwd:
            bwd, redone = own, held + p.s[last] - p.r2[group[0]]
    return Costs(p.c[0].input_bytes, saved, fwd, bwd, min(max(redone, 0.0), max(bwd, 0.0)))
