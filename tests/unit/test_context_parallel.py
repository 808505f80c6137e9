"""Context parallelism without Transformer Engine (capture_megatron.emulate.cp_attention and
capture_megatron.config.context): which --cp-comm-type a run may give, the load-balanced causal
mask, the layer spec the builder gets, and the refusals. Training with CP equals one process:
tests/dist/test_parallel_equivalence.py."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from capture_megatron.config import ParallelPlan
from capture_megatron.config.context import check_comm_type, te_comm_type
from capture_megatron.errors import CaptureError
from capture_megatron.train.report import RankMemory


def _plan(cp: int, comm: str = "") -> ParallelPlan:
    return ParallelPlan(
        tp=1,
        pp=1,
        dp=1,
        cp=cp,
        cp_comm_type=comm,
        micro_batch_size=1,
        global_batch_size=1,
        layers_per_stage=(2,),
    )


@pytest.mark.parametrize("comm", ["", "allgather"])
def test_all_gather_runs_without_te(comm):
    check_comm_type(_plan(2, comm), uses_te=False)


@pytest.mark.parametrize("comm", ["p2p", "a2a", "a2a+p2p"])
def test_te_algorithms_are_refused_without_te(comm):
    with pytest.raises(CaptureError) as err:
        check_comm_type(_plan(2, comm), uses_te=False)
    text = str(err.value)
    assert f"--cp-comm-type {comm}" in text and "all-gathers K and V" in text
    assert "Transformer Engine's algorithms" in text and "\n" not in text


def test_cp_1_takes_any_comm_type_and_te_all_but_hierarchical():
    check_comm_type(_plan(1, "p2p"), uses_te=False)
    for comm in ("", "p2p", "a2a", "allgather"):
        check_comm_type(_plan(2, comm), uses_te=True)
    with pytest.raises(CaptureError, match="--hierarchical-context-parallel-sizes"):
        check_comm_type(_plan(2, "a2a+p2p"), uses_te=True)


def test_te_gets_megatron_lm_default_and_te_names():
    assert te_comm_type(_plan(2), uses_te=True) == "p2p"
    assert te_comm_type(_plan(2, "allgather"), uses_te=True) == "all_gather"
    assert te_comm_type(_plan(2, "a2a"), uses_te=True) == "a2a"
    assert te_comm_type(_plan(2, "a2a"), uses_te=False) is None
    assert te_comm_type(_plan(1, "a2a"), uses_te=True) is None


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("window", [None, (5, 0)])
def test_mask_is_the_one_process_mask_of_each_ranks_chunks(cp, window):
    from megatron.core.transformer.utils import get_sliding_window_causal_mask

    from capture_megatron.emulate.cp_attention import cp_mask, rank_positions

    chunk = 4
    s = 2 * cp * chunk
    full = torch.ones(s, s, dtype=torch.bool).triu(1)
    if window is not None:
        from capture_megatron.emulate import cpu_compat

        cpu_compat.apply("cpu")  # megatron builds the window mask on "cuda"
        full = get_sliding_window_causal_mask(s, s, window)
    keys = torch.cat([rank_positions(cp, j, chunk) for j in range(cp)])
    assert sorted(keys.tolist()) == list(range(s))
    for rank in range(cp):
        rows = rank_positions(cp, rank, chunk)
        expected = full[rows][:, keys]
        assert torch.equal(cp_mask(cp, rank, chunk, window, "cpu")[0, 0], expected)


def test_spec_gets_the_all_gather_attention_only_when_needed():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from capture_megatron.emulate.cp_attention import AllGatherCPAttention, with_context_parallel

    def core(spec):
        return spec.submodules.self_attention.submodules.core_attention

    spec = get_gpt_layer_local_spec()
    assert core(with_context_parallel(spec, _plan(1), uses_te=False)) is DotProductAttention
    assert core(with_context_parallel(spec, _plan(2), uses_te=True)) is DotProductAttention
    built = with_context_parallel(spec, _plan(2, "allgather"), uses_te=False)
    assert core(built) is AllGatherCPAttention
    assert core(spec) is DotProductAttention  # the stock spec is left as it was
    with pytest.raises(CaptureError, match="all-gathers K and V"):
        with_context_parallel(spec, _plan(2, "p2p"), uses_te=False)


FAKE_GPU = """
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from capture_megatron.config import ParallelPlan
from capture_megatron.errors import CaptureError
from capture_megatron.emulate import cpu_compat
from capture_megatron.emulate.cp_attention import with_context_parallel
cpu_compat.apply_fake_cuda()
plan = ParallelPlan(tp=1, pp=1, dp=1, cp=2, micro_batch_size=1, global_batch_size=1,
                    layers_per_stage=(2,))
spec = get_gpt_layer_local_spec()
assert with_context_parallel(spec, plan, uses_te=True) is spec
try:
    with_context_parallel(spec, plan, uses_te=False, emulated=True)
except CaptureError as err:
    print(err)
import os, sys  # as capture_megatron/profile/worker.py: the fake-CUDA process exits without
sys.stdout.flush()  # finalising, whose native threads now and then abort at exit (status -6)
os._exit(0)
"""


@pytest.mark.slow  # profiles on fake CUDA: 6-14 s, the full suite runs it
def test_fake_gpu_kernel_set_runs_cp_with_te_attention_only():
    """On the fake-cuda device TE's flash / fused attention of the GPU kernel set runs CP itself
    (the spec is left as it is); the local spec's attention refuses it, as on a GPU."""
    done = subprocess.run(
        [sys.executable, "-c", FAKE_GPU], capture_output=True, text=True, timeout=120
    )
    assert "local attention and Transformer Engine's unfused" in done.stdout, done.stderr[-2000:]


@pytest.mark.parametrize(
    ("kernel_set", "impl", "backend", "comm", "refused"),
    [
        ("cpu", "local", "auto", "", ""),
        ("cpu", "local", "auto", "allgather", ""),
        ("cpu", "local", "auto", "p2p", "--cp-comm-type p2p"),
        ("gpu:x", "transformer_engine", "flash", "", ""),
        ("gpu:x", "transformer_engine", "auto", "p2p", ""),
        ("gpu:x", "transformer_engine", "fused", "a2a", "--cp-comm-type a2a"),
        ("gpu:x", "transformer_engine", "unfused", "", "--attention-backend unfused"),
        ("gpu:x", "local", "auto", "", "--transformer-impl local"),
    ],
)
def test_context_problem_names_what_the_kernel_set_does_not_model(
    kernel_set, impl, backend, comm, refused
):
    from capture_megatron.config import Kernels
    from capture_megatron.rules.modelled import context_problem

    kernels = Kernels(transformer_impl=impl, attention_backend=backend)
    problem = context_problem((2,), comm, kernel_set, kernels)
    assert (refused in problem) if refused else problem == ""
    assert context_problem((1,), "a2a", kernel_set, kernels) == ""


def test_rank_memory_keeps_cp_rank_and_reads_older_reports():
    mine = RankMemory(
        rank=3, tp_rank=1, pp_rank=0, dp_rank=0, peak_bytes=10, layers=(1, 2), setup_bytes=4,
        cp_rank=1,
    )  # fmt: skip
    assert RankMemory.from_json(mine.to_json()) == mine
    old = {k: v for k, v in dataclasses.asdict(mine).items() if k != "cp_rank"}
    old["layers"] = list(old["layers"])
    from capture_megatron.serial import from_plain

    assert from_plain(RankMemory, old).cp_rank == 0


def test_cost_model_splits_work_over_cp_ranks_and_adds_the_ring():
    """A CP rank computes for its s / CP tokens: CP 2 on 2 GPUs costs well under one GPU's step,
    a little more than DP 2 on the same GPUs; TE's K/V ring is hidden behind the attention until
    the link is too slow for it."""
    import dataclasses

    from capture_megatron.config import ModelShape
    from capture_megatron.steptime import parts as costparts
    from capture_megatron.steptime.hardware import Hardware
    from capture_megatron.steptime.model import CostModel, step_seconds

    shape = ModelShape(
        num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=8192,
        max_position_embeddings=8192, vocab_size=32000, dtype="bf16",
    )  # fmt: skip

    def plan(dp: int, cp: int) -> ParallelPlan:
        return ParallelPlan(
            tp=1, pp=1, dp=dp, cp=cp, micro_batch_size=1, global_batch_size=4,
            layers_per_stage=(8,),
        )  # fmt: skip

    one, dp2, cp2 = (step_seconds(shape, plan(dp, cp)) for dp, cp in ((1, 1), (2, 1), (1, 2)))
    assert dp2 < cp2 < 0.7 * one  # without the split, CP 2 would cost more than one GPU

    def ring(plan: ParallelPlan, nvlink: float) -> tuple[float, float]:
        hw = dataclasses.replace(Hardware(), nvlink_bytes_per_s=nvlink)
        s = CostModel(hardware=hw).setting
        return costparts.cp_comm(s, shape, plan, costparts.attention(s, shape, plan))

    assert ring(plan(2, 1), 1e9) == (0.0, 0.0)
    assert ring(plan(1, 2), 450e9) == (0.0, 0.0)  # hidden behind the attention of each step
    slow = ring(plan(1, 2), 1e9)
    assert 0 < slow[0] < slow[1]  # the backward passes K, V and their gradients
