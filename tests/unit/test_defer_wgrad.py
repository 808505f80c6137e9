"""--defer-embedding-wgrad-compute (+ --wgrad-deferral-limit) in the forecast (issue 26): the last
pipeline stage keeps each deferred micro-batch's output-layer input and output gradient from its
backward until the drain after the schedule's last backward (megatron-core 0.16.1
tensor_parallel/layers.py, pipeline_parallel/schedules.py finish_embedding_wgrad_compute), and with
sequence parallelism two global gather buffers. Other stages are unchanged; the CPU kernel set,
which has no gradient-accumulation fusion, refuses it as megatron-core does. Synthetic memory
model (the per-micro-batch bytes come from the shape, not from a fit)."""

from __future__ import annotations

import pytest
from synthetic_memory import SMALL, synthetic_source
from test_cli_errors import TINY, cli, one_error

from capture_megatron.config import DdpOptions, ParallelPlan
from capture_megatron.errors import CaptureError
from capture_megatron.forecast import Layers, rank_memory, variant_of
from capture_megatron.forecast.ranks import deferral
from capture_megatron.records import ProbeShape


def _plan(limit: int | None, sp: bool = True, m: int = 8) -> ParallelPlan:
    ddp = DdpOptions() if limit is None else DdpOptions(
        defer_embedding_wgrad_compute=True, wgrad_deferral_limit=limit
    )  # fmt: skip
    return ParallelPlan(
        tp=2,
        pp=4,
        dp=1,
        micro_batch_size=1,
        global_batch_size=m,
        layers_per_stage=(4, 4, 4, 4),
        sequence_parallel=sp,
        ddp=ddp,
    )


def _layers(plan: ParallelPlan) -> Layers:
    probe = ProbeShape.of(SMALL, plan.tp, plan.micro_batch_size)
    return Layers(synthetic_source(frozenset({(variant_of(SMALL, plan), probe)})).variants[0])


@pytest.mark.parametrize("sp", [True, False], ids=["SP", "no SP"])
@pytest.mark.parametrize("limit", [0, 1, 3, 20])
def test_only_the_last_stage_keeps_the_deferred_micro_batches(limit, sp):
    plain, deferred = _plan(None, sp), _plan(limit, sp)
    layers = _layers(plain)
    for rank in range(3):
        assert rank_memory(layers, SMALL, deferred, rank) == rank_memory(layers, SMALL, plain, rank)
    pair, gathers = deferral(SMALL, deferred, 3)
    tokens, h, v = SMALL.seq_length, SMALL.hidden_size, SMALL.padded_vocab(2)
    assert pair == 2 * ((tokens // 2 if sp else tokens) * h + tokens * v // 2)  # bf16 in + grad
    assert gathers == (2 * 2 * tokens * h if sp else 0)
    kept = min(limit or 8, 8)  # micro-batches deferred (0: all 8)
    before = rank_memory(layers, SMALL, plain, 3)
    after = rank_memory(layers, SMALL, deferred, 3)
    # at the drain every deferred micro-batch is held; before it, all but the last backward's
    assert before.peak + gathers + (kept - 1) * pair <= after.peak
    assert after.peak <= before.peak + gathers + kept * pair
    assert (after.params, after.grads, after.optimizer) == (
        before.params,
        before.grads,
        before.optimizer,
    )


def test_a_lower_limit_never_holds_more():
    layers = _layers(_plan(None))
    peaks = [rank_memory(layers, SMALL, _plan(limit), 3).peak for limit in (1, 2, 4, 8, 0)]
    assert peaks == sorted(peaks) and peaks[0] < peaks[-1]


def test_refused_without_pipeline_parallelism():
    with pytest.raises(CaptureError, match="needs pipeline parallelism"):
        ParallelPlan(
            tp=1,
            pp=1,
            dp=1,
            micro_batch_size=1,
            global_batch_size=1,
            layers_per_stage=(4,),
            ddp=DdpOptions(defer_embedding_wgrad_compute=True),
        )


def test_cpu_kernel_set_refuses_it(tmp_path):
    """megatron-core refuses it without gradient-accumulation fusion, which the CPU kernel set
    lacks: one paragraph naming the flag, exit 2, before any training process starts."""
    args = [*TINY, "--mock-data", "--pipeline-model-parallel-size", "2"]
    done = cli(["train", "--nproc", "2", *args, "--defer-embedding-wgrad-compute"], str(tmp_path))
    assert "--defer-embedding-wgrad-compute" in one_error(done, "train")
