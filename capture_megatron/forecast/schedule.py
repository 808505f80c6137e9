"""The order of forward and backward passes on one pipeline rank, as megatron-core 0.16.1 runs them.

- PP = 1 (forward_backward_no_pipelining): F then B for every micro-batch.
- 1F1B (forward_backward_pipelining_without_interleaving): p - r - 1 warm-up forwards, then one
  forward and one backward alternately, then the remaining backwards; at most min(p - r, m)
  micro-batches are alive on rank r.
- Interleaved 1F1B (VPP v > 1): (micro-batch, chunk) order from get_schedule_table with
  microbatch_group_size_per_vp_stage (default PP); warm-up (p - r - 1) * 2 + (v - 1) * group
  forwards (capped at m * v); a backward of virtual id k runs chunk v - 1 - chunk_table[k].
- With --overlap-moe-expert-parallel-comm (the combined 1F1B schedule, MC
  pipeline_parallel/combined_1f1b.py): interleaving runs one more warm-up forward
  (get_pp_rank_microbatches), and PP = 1 runs micro-batch 0's forward alone, then merges each
  forward with the previous micro-batch's backward; every steady-state (forward, backward) pair
  is one merged step (Event.merged on its forward).
Pure Python (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass

from capture_megatron.errors import CaptureError, require


@dataclass(frozen=True)
class ScheduleSpec:
    """A pipeline schedule: sizes and micro-batches per optimizer step."""

    pp: int
    """Pipeline stages."""
    num_microbatches: int
    """Micro-batches per step on each DP rank (m)."""
    vpp: int = 1
    """Model chunks per pipeline rank (interleaving when > 1)."""
    microbatch_group_size: int = 0
    """Megatron's microbatch_group_size_per_vp_stage; 0 means PP."""
    overlap: bool = False
    """--overlap-moe-expert-parallel-comm: megatron-core's combined 1F1B schedule."""

    def __post_init__(self) -> None:
        p = []
        if self.pp < 1 or self.vpp < 1 or self.num_microbatches < 1:
            p.append(
                f"pp {self.pp}, vpp {self.vpp} and micro-batches {self.num_microbatches} must "
                "be >= 1"
            )
        elif self.vpp > 1:
            if self.pp == 1:
                p.append("virtual pipeline stages need PP > 1")
            group = self.group
            if not self.pp <= group <= self.num_microbatches:
                p.append(
                    f"micro-batch group per virtual stage {group} must lie in [PP {self.pp}, "
                    f"micro-batches {self.num_microbatches}] (interleaving needs at least PP "
                    "micro-batches)"
                )
            rest = self.num_microbatches % group
            if 0 < rest < self.pp:
                p.append(
                    f"{self.num_microbatches} micro-batches leave a last group of {rest} < "
                    f"PP {self.pp}; "
                    f"use a multiple of {group} micro-batches"
                )
        require(p, "pipeline schedule")

    @property
    def group(self) -> int:
        """Contiguous micro-batches per virtual stage."""
        return self.microbatch_group_size or self.pp


@dataclass(frozen=True)
class Event:
    """One forward or backward pass of one micro-batch through one local chunk."""

    kind: str
    """'F' or 'B'."""
    microbatch: int
    """Micro-batch index."""
    chunk: int
    """Local model chunk (virtual stage index on this rank)."""
    merged: bool = False
    """A forward the combined 1F1B schedule merges with the backward that follows it."""


def schedule_table(m: int, v: int, group: int) -> list[tuple[int, int]]:
    """(micro-batch, chunk) per virtual micro-batch id, as megatron's get_schedule_table."""
    table = []
    for start in range(0, m, group):
        end = m if start + group >= m else start + group
        table += [(mb, chunk) for chunk in range(v) for mb in range(start, end)]
    return table


def warmup_count(spec: ScheduleSpec, pp_rank: int) -> int:
    """Forwards before the first backward (megatron's get_pp_rank_microbatches)."""
    total = spec.num_microbatches * spec.vpp
    if spec.pp == 1:
        return min(1, total) if spec.overlap else 0
    if spec.vpp == 1:
        warm = spec.pp - pp_rank - 1
    else:
        warm = (spec.pp - pp_rank - 1) * 2 + (spec.vpp - 1) * spec.group + int(spec.overlap)
    return min(warm, total)


def events(spec: ScheduleSpec, pp_rank: int) -> tuple[Event, ...]:
    """The rank's passes in execution order."""
    if not 0 <= pp_rank < spec.pp:
        raise CaptureError(f"pipeline rank {pp_rank} outside PP {spec.pp}")
    m, v = spec.num_microbatches, spec.vpp
    if spec.pp == 1 and not spec.overlap:
        return tuple(e for mb in range(m) for e in (Event("F", mb, 0), Event("B", mb, 0)))
    table = schedule_table(m, v, spec.group)
    fwd = [Event("F", mb, chunk, spec.overlap) for mb, chunk in table]
    bwd = [Event("B", mb, v - 1 - chunk) for mb, chunk in table]
    warm = warmup_count(spec, pp_rank)
    out = [Event("F", e.microbatch, e.chunk) for e in fwd[:warm]]
    for k in range(len(table) - warm):
        out += [fwd[warm + k], bwd[k]]
    out += bwd[len(table) - warm :]
    return tuple(out)


def live_counts(spec: ScheduleSpec, pp_rank: int) -> tuple[tuple[int, ...], ...]:
    """Micro-batches alive per local chunk after each event."""
    live, out = [0] * spec.vpp, []
    for ev in events(spec, pp_rank):
        live[ev.chunk] += 1 if ev.kind == "F" else -1
        out.append(tuple(live))
    return tuple(out)


def peak_inflight(spec: ScheduleSpec, pp_rank: int) -> int:
    """Most micro-batches alive at once on the rank (1F1B: min(p - r, m))."""
    return max(sum(c) for c in live_counts(spec, pp_rank))
