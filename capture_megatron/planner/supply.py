"""Supply: the memory model a search needs, grown on demand from a ModelSource (pure Python).

Profiling a (variant, probe shape) pair on the fake CUDA device costs seconds, and a search over
every size touches a few dozen pairs, most of which cannot matter: under the throughput objective
the candidates are visited fastest first and the search stops once the fastest fitting plans are
known. So the search asks the Supply for a plan's pair only when it evaluates that plan; a missing
pair is profiled together with the pairs of the next candidates in line (a batch that doubles each
round, so that a worker start is shared by many probes), and the model is refitted on everything
profiled so far. Predictions at a profiled pair are that pair's exact constants, so plans
evaluated before a refit keep their values.
"""

from __future__ import annotations

from collections.abc import Iterable

from capture_megatron.config import ModelShape, ParallelPlan
from capture_megatron.fit import MemoryModel, ModelSource, Needs, RecordedSource
from capture_megatron.forecast import variants_of
from capture_megatron.records import ProbeShape, Variant

FIRST_BATCH = 4
"""Pairs profiled in the first round of a lazy search (then 8, then LAST_BATCH)."""
LAST_BATCH = 12
"""The most pairs a round profiles beyond those asked for (upcoming candidates' pairs may never be
needed: the search stops once its bound proves the fastest plan)."""

Pair = tuple[Variant, ProbeShape]
"""A (variant, probe shape) pair of a memory model."""


def pairs_of(shape: ModelShape, plan: ParallelPlan) -> tuple[Pair, ...]:
    """The (variant, probe shape) pairs predicting `plan` needs (two when dense and MoE layers are
    mixed: the MoE layers' variant and the dense layers')."""
    probe = ProbeShape.of(shape, plan.tp, plan.micro_batch_size)
    return tuple((v, probe) for v in variants_of(shape, plan))


def needs_of(shape: ModelShape, plans: Iterable[ParallelPlan]) -> Needs:
    """The (variant, probe shape) pairs predicting `plans` needs."""
    return frozenset(p for plan in plans for p in pairs_of(shape, plan))


class Unrecorded(Exception):
    """An offline Supply (Supply.offline) was asked for pairs its source has not recorded."""


class Supply:
    """A memory model that grows on demand: ready (every pair there) or from a ModelSource."""

    def __init__(self, shape: ModelShape, source: ModelSource | MemoryModel) -> None:
        self.shape = shape
        """The model whose plans are predicted."""
        self.source: ModelSource | None = None if isinstance(source, MemoryModel) else source
        """Where missing pairs come from (None: the model is complete)."""
        self.model: MemoryModel | None = source if isinstance(source, MemoryModel) else None
        """The model of the pairs supplied so far."""
        self.have: set[Pair] = set()
        """The pairs supplied so far (from a source)."""
        self.batch = FIRST_BATCH
        """New pairs the next round profiles at least (doubles each round)."""
        self.rounds = 0
        """Rounds of profiling so far."""
        self.wanted: set[Pair] = set()
        """Pairs to profile with the next round (asked for ahead, without a round of their own)."""
        self.offline = False
        """Profile nothing: a round that would raises Unrecorded (a forked search's Supply:
        planner.sidebyside; its parent profiles what it lacks)."""

    def want(self, plans: Iterable[ParallelPlan]) -> None:
        """Profile these plans' pairs with the next round that runs anyway."""
        if self.source is not None:
            self.wanted |= {p for p in self._pairs(plans) if p not in self.have}

    def model_for(
        self, plans: Iterable[ParallelPlan], upcoming: Iterable[ParallelPlan] = ()
    ) -> MemoryModel:
        """A model that predicts `plans`; when pairs are missing, those of the `upcoming` plans
        (in order) are profiled with them, up to this round's batch."""
        if self.source is None:
            assert self.model is not None
            return self.model
        new = {p for p in self._pairs(plans) if p not in self.have}
        if not new and self.model is not None:
            return self.model
        for plan in upcoming:
            if len(new) >= self.batch:
                break
            new |= {p for p in self._pairs([plan]) if p not in self.have}
        return self._grow(new)

    def holds(self, plans: Iterable[ParallelPlan]) -> bool:
        """Whether the model predicts `plans` without profiling."""
        return self.source is None or all(p in self.have for p in self._pairs(plans))

    def go_offline(self) -> None:
        """Profile nothing from now on (Supply.offline)."""
        self.offline = True

    def complete(self, plans: Iterable[ParallelPlan]) -> MemoryModel:
        """A model that predicts every one of `plans` (all their pairs at once)."""
        return self.model_for(plans)  # no upcoming plans: exactly the missing pairs, one round

    def _pairs(self, plans: Iterable[ParallelPlan]) -> Needs:
        return needs_of(self.shape, plans)

    def _grow(self, new: set[Pair]) -> MemoryModel:
        assert self.source is not None
        if self.offline:
            source, needs = self.source, frozenset(self.have | new | self.wanted)
            if not (isinstance(source, RecordedSource) and source.recorded(needs)):
                raise Unrecorded()
        self.have |= new | self.wanted
        self.wanted = set()
        self.model = self.source(frozenset(self.have))
        self.rounds += 1
        self.batch = min(2 * self.batch, LAST_BATCH)
        return self.model
