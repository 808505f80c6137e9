"""The schedule model equals megatron-core's own schedules.

megatron-core's forward_backward_pipelining_without_interleaving / _with_interleaving run for real
in this process as pipeline rank r of a fake p-rank process group (collectives complete without
data), driving tiny real modules that log every forward and backward pass. The logged order must
equal capture_megatron.forecast.schedule.events for many (p, m, v) and every rank."""

from __future__ import annotations

import pytest
import torch

from capture_megatron.errors import CaptureError
from capture_megatron.forecast.schedule import (
    Event,
    ScheduleSpec,
    events,
    live_counts,
    peak_inflight,
)


class _Log(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, log, key):
        ctx.log, ctx.key = log, key
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(Event("B", *ctx.key))
        return grad, None, None


class _Chunk(torch.nn.Module):
    def __init__(self, config, vp_stage, log):
        super().__init__()
        from megatron.core.enums import ModelType

        self.config, self.vp_stage, self.log, self.seen = config, vp_stage, log, 0
        self.model_type = ModelType.encoder_or_decoder
        self.linear = torch.nn.Linear(4, 4)
        self.input_tensor = None

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor[0] if isinstance(tensor, list) else tensor

    def forward(self, x):
        key = (self.seen, self.vp_stage or 0)
        self.seen += 1
        self.log.append(Event("F", *key))
        x = self.input_tensor if self.input_tensor is not None else x
        return _Log.apply(self.linear(x), self.log, key)


def _megatron_order(p: int, rank: int, m: int, v: int) -> list[Event]:
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from capture_megatron.emulate import cpu_compat

    cpu_compat.apply("cpu")
    torch.distributed.init_process_group("fake", store=FakeStore(), rank=rank, world_size=p)
    try:
        ps.initialize_model_parallel(
            1,
            p,
            virtual_pipeline_model_parallel_size=v if v > 1 else None,
            create_gloo_process_groups=False,
        )
        config = TransformerConfig(
            num_layers=p * v,
            hidden_size=4,
            num_attention_heads=1,
            pipeline_model_parallel_size=p,
            virtual_pipeline_model_parallel_size=v if v > 1 else None,
            pipeline_dtype=torch.float32,
            batch_p2p_comm=False,
            deallocate_pipeline_outputs=True,
        )
        log: list[Event] = []
        chunks = [_Chunk(config, i if v > 1 else None, log) for i in range(v)]

        def step(data, model):
            out = model(next(data))
            return out, lambda t: (t.sum(), {})

        data = [iter([torch.ones(1, 1, 4)] * m) for _ in range(v)]
        get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=data if v > 1 else data[0],
            model=chunks if v > 1 else chunks[0],
            num_microbatches=m,
            seq_length=1,
            micro_batch_size=1,
            forward_only=False,
        )
        return log
    finally:
        ps.destroy_model_parallel()
        torch.distributed.destroy_process_group()


CASES = [
    (1, 3, 1),
    (2, 1, 1),
    (2, 4, 1),
    (4, 2, 1),
    (4, 8, 1),
    (3, 7, 1),
    (2, 2, 2),
    (2, 4, 2),
    (2, 6, 2),
    (4, 4, 2),
    (4, 8, 2),
    (2, 4, 3),
    (3, 6, 2),
    (4, 12, 3),
]


@pytest.mark.parametrize("p,m,v", CASES)
def test_events_equal_megatron(p, m, v):
    spec = ScheduleSpec(pp=p, num_microbatches=m, vpp=v)
    for rank in range(p):
        assert list(events(spec, rank)) == _megatron_order(p, rank, m, v), (p, m, v, rank)


def test_1f1b_inflight_is_min_of_remaining_stages_and_microbatches():
    for p in range(1, 6):
        for m in range(1, 10):
            for r in range(p):
                assert peak_inflight(ScheduleSpec(p, m), r) == (1 if p == 1 else min(p - r, m))


def test_live_counts_return_to_zero_and_never_negative():
    for p, m, v in CASES:
        for r in range(p):
            counts = live_counts(ScheduleSpec(p, m, v), r)
            assert counts[-1] == (0,) * v and min(min(c) for c in counts) >= 0


def test_invalid_interleaving_names_the_numbers():
    with pytest.raises(CaptureError, match="last group of 1 < PP 2"):
        ScheduleSpec(pp=2, num_microbatches=5, vpp=2, microbatch_group_size=4)
    with pytest.raises(CaptureError, match="micro-batches 1"):
        ScheduleSpec(pp=2, num_microbatches=1, vpp=2)


def test_pruned_moments_keep_every_possible_peak():
    """schedule_states drops dominated moments and (VPP 2) those inside the hull: for random
    activation weights and transients the maximum over the kept moments equals the maximum over
    all. With a deferred output-layer weight gradient the last rank's moments also count the
    output chunk's completed backward passes (and end with the drain)."""
    import random

    from capture_megatron.forecast.moments import schedule_states

    rng = random.Random(0)
    for _ in range(200):
        pp, vpp = rng.choice([2, 3, 4, 8]), rng.choice([1, 2, 3])
        m, r, defer = pp * rng.randint(1, 4), rng.randrange(pp), rng.random() < 0.5
        every, live, held, after, done = [], [0] * vpp, -1, [True] * vpp, 0
        counting = defer and r == pp - 1
        for ev in events(ScheduleSpec(pp=pp, num_microbatches=m, vpp=vpp), r):
            every.append((ev.kind, ev.chunk, tuple(live), held, tuple(after), done))
            live[ev.chunk] += 1 if ev.kind == "F" else -1
            held = ev.chunk if ev.kind == "B" else held
            after[ev.chunk] = ev.kind == "B"
            done += int(counting and ev.kind == "B" and ev.chunk == vpp - 1)
        if counting:
            every.append(("D", vpp - 1, tuple(live), held, tuple(after), done))
            assert done == m
        kept = schedule_states(pp, m, vpp, r, 0, defer)
        assert set(kept) <= set(every)
        for _ in range(10):
            w = [rng.random() for _ in range(vpp)]
            extra = {(s[0], s[1], s[3], s[4], s[5]): rng.random() * 5 for s in every}

            def value(s, w=w, extra=extra):
                return sum(a * b for a, b in zip(s[2], w)) + extra[(s[0], s[1], s[3], s[4], s[5])]

            assert max(map(value, kept)) == pytest.approx(max(map(value, every)), abs=1e-12)
