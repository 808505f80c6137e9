"""Aligning the allocation timelines of several shapes into one union sequence (numpy).

Matching events by op name alone is ambiguous: a window allocates many `clone`s and `mm`s, some only
at some shapes (a transpose that is a view when b = 1, a key/value expansion when g < a), and a
text diff may then pair one shape's first clone with another shape's second. Two events of different
shapes are the same tensor when their op agrees *and* their bytes are the same multiple of one size
term (terms.TRANSIENT_TERMS) at both shapes, e.g. 2 * b*s*h/t. The aligner is a weighted longest
common subsequence (2 for such a pair, 1 for the same op only), each row of the dynamic programme
computed at once with a running maximum, merging the shapes' sequences one by one into the union.

Allocations are aligned first; then every event, with a release named by its allocation's place in
that union (so two releases of the same op are never confused), or by its op for a storage from
before the window.
"""

from __future__ import annotations

import numpy as np

from capture_megatron.fit.terms import TRANSIENT_TERMS, Sizes
from capture_megatron.records import Timeline

TOLERANCE = 1e-9
"""Relative tolerance of 'the same multiple of a term'."""
SAME_TENSOR, SAME_OP = 2.0, 1.0
"""Alignment scores of a pair of events."""


def _ratios(z: Sizes, nbytes: tuple[int, ...] | list[int]) -> np.ndarray:
    """(events, terms): each event's bytes per unit of each term at sizes z (nan where a term is
    0)."""
    terms = np.array([fn(z) for fn in TRANSIENT_TERMS.values()], dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.asarray(nbytes, dtype=np.float64)[:, None] / terms[None, :]
    out[~np.isfinite(out)] = np.nan
    return out.reshape(len(nbytes), len(terms))


class _Union:
    """The union being built: tokens, stable ids, and per entry the ratios of its first sample and
    the terms on which every sample merged so far agreed."""

    def __init__(self, tokens: list[str], ratios: np.ndarray):
        self.tokens, self.ids = list(tokens), list(range(len(tokens)))
        self.ratios, self.agree = ratios, ~np.isnan(ratios)
        self.next_id = len(tokens)

    def _scores(
        self, tokens: list[str], ratios: np.ndarray
    ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        codes = {t: i for i, t in enumerate(sorted(set(self.tokens) | set(tokens)))}
        same_op = (
            np.array([codes[t] for t in self.tokens])[:, None]
            == np.array([codes[t] for t in tokens])[None, :]
        )
        ii, jj = np.nonzero(same_op)
        a, b = self.ratios[ii], ratios[jj]
        agree = self.agree[ii] & (np.abs(a - b) <= TOLERANCE * np.fmax(np.abs(a), np.abs(b)))
        weights = np.full(same_op.shape, -np.inf)
        weights[ii, jj] = np.where(agree.any(axis=1), SAME_TENSOR, SAME_OP)
        return weights, (ii, jj, agree)

    def merge(self, tokens: list[str], ratios: np.ndarray) -> list[int]:
        """Merge one sequence; return the union id of each of its events."""
        weights, (ii, jj, agree) = self._scores(tokens, ratios)
        agreement = {(int(i), int(j)): row for i, j, row in zip(ii, jj, agree)}
        rows, mine = (
            [],
            [0] * len(tokens),
        )  # rows: (token, id, ratios, agreeing terms) of the new union

        def fresh(k: int) -> None:
            mine[k] = self.next_id
            rows.append((tokens[k], self.next_id, ratios[k], ~np.isnan(ratios[k])))
            self.next_id += 1

        a = b = 0
        for ua, lb in _best_pairs(weights) + [(len(self.tokens), len(tokens))]:
            rows += [
                (self.tokens[k], self.ids[k], self.ratios[k], self.agree[k]) for k in range(a, ua)
            ]
            for k in range(b, lb):
                fresh(k)
            if ua < len(
                self.tokens
            ):  # a matched pair: one entry, agreeing where both samples agree
                mine[lb] = self.ids[ua]
                rows.append((self.tokens[ua], self.ids[ua], self.ratios[ua], agreement[(ua, lb)]))
            a, b = ua + 1, lb + 1
        self.tokens = [r[0] for r in rows]
        self.ids = [r[1] for r in rows]
        self.ratios = np.array([r[2] for r in rows]).reshape(len(rows), ratios.shape[1])
        self.agree = np.array([r[3] for r in rows], dtype=bool).reshape(self.ratios.shape)
        return mine


def _best_pairs(weights: np.ndarray) -> list[tuple[int, int]]:
    """Index pairs of the heaviest common subsequence under pair weights (-inf: no pair)."""
    n, m = weights.shape
    table = np.zeros((n + 1, m + 1))
    for i in range(1, n + 1):
        table[i, 1:] = np.maximum.accumulate(
            np.maximum(table[i - 1, 1:], table[i - 1, :-1] + weights[i - 1])
        )
    pairs, i, j = [], n, m
    while i > 0 and j > 0:
        w = weights[i - 1, j - 1]
        if w > -np.inf and table[i, j] == table[i - 1, j - 1] + w:
            pairs.append((i - 1, j - 1))
            i, j = i - 1, j - 1
        elif table[i, j] == table[i - 1, j]:
            i -= 1
        else:
            j -= 1
    return pairs[::-1]


def _align(seqs: list[list[str]], ratios: list[np.ndarray]) -> tuple[list[str], list[list[int]]]:
    """Union tokens and, per sequence, the union position of each of its events (longest first)."""
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    union = _Union(seqs[order[0]], ratios[order[0]])
    maps: list[list[int]] = [[] for _ in seqs]
    maps[order[0]] = list(union.ids)
    for i in order[1:]:
        maps[i] = union.merge(seqs[i], ratios[i])
    position = {uid: p for p, uid in enumerate(union.ids)}
    return union.tokens, [[position[u] for u in m] for m in maps]


Alignment = tuple[list[str], list[str], list[list[int]]]
"""(union op sequence, its alignment tokens, per timeline the union position of each event)."""


def align(
    zs: list[Sizes], lines: list[Timeline], before: list[list[int]] | None = None
) -> Alignment:
    """(union op sequence, its alignment tokens, per timeline the union position of each event).

    Tokens: '+17' an allocation at place 17 of the allocations' union, '-17' its release, '-p5' the
    release of the storage at position 5 of the previous window's union (`before`: per timeline, the
    previous window's union position of each of its events), '-op' any other release."""
    ratios = [_ratios(z, line.nbytes) for z, line in zip(zs, lines)]
    allocs = [[i for i, op in enumerate(line.ops) if op[0] == "+"] for line in lines]
    _, where = _align(
        [[line.ops[i] for i in idx] for line, idx in zip(lines, allocs)],
        [r[idx] for r, idx in zip(ratios, allocs)],
    )
    keys = []
    for n, (line, idx, pos) in enumerate(zip(lines, allocs, where)):
        uid = dict(zip(idx, pos))
        origins = line.origins or (-1,) * len(line.ops)
        keys.append(
            [
                _token(op, o, uid[i] if op[0] == "+" else None, uid, before[n] if before else None)
                for i, (op, o) in enumerate(zip(line.ops, origins))
            ]
        )
    union, maps = _align(keys, ratios)
    names = list(union)
    for line, positions in zip(lines, maps):
        for op, at in zip(line.ops, positions):
            names[at] = op
    return names, union, maps


def _token(
    op: str, origin: int, place: int | None, uid: dict[int, int], before: list[int] | None
) -> str:
    if place is not None:
        return f"+{place}"
    if origin >= 0:
        return f"-{uid[origin]}"
    if origin <= -2 and before is not None:
        return f"-p{before[-2 - origin]}"
    return op
