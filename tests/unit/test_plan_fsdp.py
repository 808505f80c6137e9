"""The planner tries Megatron-FSDP's ZeRO-3 against the distributed optimizer (issue 51): on GPUs,
for throughput, a ZeRO-3 twin of every candidate; taken only where it is FSDP_MARGIN faster than
the fastest plan without it (its step time is not calibrated on a measured run), written with the
flags Megatron-LM needs for it; never for min-peak, on CPU processes, or where the command line
rules it out."""

from __future__ import annotations

import pytest
from cli_golden import Case, run
from synthetic_memory import SMALL, SMALL_ARGS, synthetic_source

from capture_megatron.config import GIB, Cluster, versions
from capture_megatron.planner import PlanOptions, plan
from capture_megatron.planner.offload_space import fsdp_twin
from capture_megatron.planner.search import FSDP_MARGIN
from capture_megatron.planner.space import Space

ZERO3 = ("--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params")


@pytest.fixture(autouse=True)
def _sharded_moments(monkeypatch):
    """A Transformer Engine whose FusedAdam shards Megatron-FSDP's moments (2.12)."""
    monkeypatch.setenv(versions.TE_ENV, "2.12")


def _plan(objective: str = "throughput", fsdp: tuple[bool, ...] = (), device: str = "cuda"):
    """SMALL on 8 GPUs of 6 GiB (global batch 32, no context margin, no optimizer offload)."""
    options = PlanOptions(
        objective=objective,
        context_gib=0.0,
        global_batch_size=32,
        space=Space(optimizer_offload=(0.0,), fsdp=fsdp),
    )
    cluster = Cluster(gpus=8, gpu_memory_bytes=6 * GIB, device=device)
    return plan(SMALL, cluster, options, synthetic_source)


def test_throughput_takes_zero3_where_it_is_faster_by_the_margin():
    """At 6 GiB the distributed optimizer recomputes; ZeRO-3's sharded weights and gradients
    leave room for a larger micro-batch, estimated more than FSDP_MARGIN faster."""
    best = _plan().best
    without = _plan(fsdp=(False,)).best
    assert best.plan.ddp.fsdp.enabled and best.plan.ddp.fsdp.strategy == "optim_grads_params"
    assert not without.plan.ddp.fsdp.enabled
    assert best.step_seconds < without.step_seconds * (1 - FSDP_MARGIN)
    assert best.fits and best.peak < without.peak + 6 * GIB


def test_zero3_within_the_margin_is_not_taken():
    """The same search with a margin no plan can beat keeps the distributed optimizer."""
    from capture_megatron.planner import search

    saved = search.FSDP_MARGIN
    search.FSDP_MARGIN = 0.99
    try:
        best = _plan().best
    finally:
        search.FSDP_MARGIN = saved
    assert not best.plan.ddp.fsdp.enabled


@pytest.mark.parametrize("objective", ["min-peak"])
def test_min_peak_never_tries_it(objective):
    assert not _plan(objective).best.plan.ddp.fsdp.enabled


def test_twins_keep_the_sizes_and_need_data_parallel_ranks():
    result = _plan(fsdp=(False,))
    p = result.best.plan
    twin = fsdp_twin(p)
    assert twin is not None and (twin.tp, twin.pp, twin.dp, twin.micro_batch_size) == (
        p.tp,
        p.pp,
        p.dp,
        p.micro_batch_size,
    )
    assert twin.distributed_optimizer and twin.ddp.fsdp.units
    solo = type(p)(
        tp=8, pp=1, dp=1, micro_batch_size=1, global_batch_size=32, layers_per_stage=(16,)
    )
    assert fsdp_twin(solo) is None  # one data-parallel rank: nothing to shard


def _cli(*extra: str) -> dict:
    argv = ("plan", *SMALL_ARGS, "--global-batch-size", "32", "--gpus", "8")
    return run(Case("fsdp", (*argv, "--gpu-memory-gib", "6", "--context-gib", "0", *extra)))


def test_the_command_line_writes_the_flags_megatron_lm_needs():
    out = _cli()
    args = out["json"]["megatron_args"]
    assert out["code"] == 0 and all(a in args for a in ZERO3)
    assert args[args.index("--ckpt-format") + 1] == "fsdp_dtensor"  # Megatron-LM asserts it
    table = out["stdout"].splitlines()
    header = next(i for i, line in enumerate(table) if line.split()[:2] == ["TP", "PP"])
    column = table[header].split().index("DO")
    assert table[header + 1].split()[column] == "Z3"  # the DO column names the ZeRO stage


@pytest.mark.parametrize(
    "extra",
    [("--ckpt-format", "torch"), ("--objective", "min-peak"), ("--use-distributed-optimizer",)],
)  # a checkpoint format Megatron-FSDP refuses, min-peak, the distributed optimizer asked for
def test_what_rules_it_out_leaves_the_distributed_optimizer(extra):
    out = _cli(*extra)
    assert out["code"] == 0
    assert "--use-megatron-fsdp" not in out["json"]["megatron_args"]


def test_cpu_processes_and_given_settings_never_try_it():
    from capture_megatron.config import DdpOptions, Kernels
    from capture_megatron.planner.offload_space import ZERO3 as SETTINGS
    from capture_megatron.planner.offload_space import searched_fsdp

    plain = DdpOptions()
    assert searched_fsdp(plain, "throughput", True, Kernels()) == (False, True)
    assert searched_fsdp(plain, "throughput", False, Kernels()) == (False,)  # CPU processes
    given = DdpOptions(fsdp=SETTINGS)  # the command line's own Megatron-FSDP is kept as given
    assert searched_fsdp(given, "throughput", True, Kernels()) == (False,)
    offload = DdpOptions(optimizer_cpu_offload=True, use_precision_aware_optimizer=True)
    assert searched_fsdp(offload, "throughput", True, Kernels()) == (False,)


def test_te_2_11_keeps_zero3_out_and_a_zero3_line_says_why(monkeypatch):
    """Under Transformer Engine 2.11 (megatron-core 0.16.1's newest) ZeRO-3's moments are whole:
    the twin loses its edge, and a command line that asks for Megatron-FSDP is forecast with them
    and says so in a note naming the variable that gives another TE."""
    monkeypatch.setenv(versions.TE_ENV, "2.11")
    assert not _plan().best.plan.ddp.fsdp.enabled
    asked = (*ZERO3, "--ckpt-format", "fsdp_dtensor", "--gpu-memory-gib", "80")
    out = _cli(*asked)
    notes = " ".join(out["json"]["notes"])
    assert out["code"] == 0 and "Transformer Engine 2.11" in notes and versions.TE_ENV in notes
    monkeypatch.setenv(versions.TE_ENV, "2.12")
    assert "Transformer Engine" not in " ".join(_cli(*asked)["json"]["notes"])


def test_a_zero3_line_that_fits_nowhere_under_te_2_11_names_it(monkeypatch):
    """When no plan fits, the refusal says that TE 2.11 keeps Megatron-FSDP's moments whole."""
    monkeypatch.setenv(versions.TE_ENV, "2.11")
    out = _cli(*ZERO3, "--ckpt-format", "fsdp_dtensor", "--gpu-memory-gib", "1")
    assert out["code"] == 2 and "Megatron-FSDP with Transformer Engine 2.11" in out["stderr"]
