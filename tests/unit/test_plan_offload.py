"""Issue 31, Build 3: the optimizer offload fraction as a plan dimension. min-gpus fits a model on
fewer GPUs by offloading the optimizer when its state is what overflows; throughput takes offload
only when it is estimated faster than every plan that fits without it; min-peak does not offload
unless asked; a fraction given on the command line is kept; --host-memory-gib rejects plans whose
host copies overflow a node, with the reason in the one-paragraph refusal. On the synthetic memory
model (tests/unit/synthetic_memory.py: no profiling): these check the planner's logic, not a
forecast."""

from __future__ import annotations

import dataclasses

import pytest
from synthetic_memory import SMALL, SMALL_ARGS, full_model, synthetic_source
from test_cli_errors import cli, one_error

from capture_megatron.cli import plan as plan_cli
from capture_megatron.config import GIB, Cluster, DdpOptions, ParallelFlags
from capture_megatron.errors import CaptureError
from capture_megatron.fit import write_model
from capture_megatron.planner import PlanOptions, Space, plan, space_from
from capture_megatron.planner.offload_space import OFFLOAD_FRACTIONS, offload_ddp
from capture_megatron.planner.space import candidates
from capture_megatron.steptime.model import step_seconds
from capture_megatron.steptime.offload import without_offload


def _plan(gpus: int, gib: float, objective: str, offload: tuple[float, ...] = (), **kw):
    """plan() of SMALL (global batch 32, no CUDA context margin); `offload` () searches it."""
    options = PlanOptions(
        objective=objective,
        context_gib=0.0,
        global_batch_size=32,
        space=Space(optimizer_offload=offload),
        **kw,
    )
    return plan(
        SMALL, Cluster(gpus=gpus, gpu_memory_bytes=int(gib * GIB)), options, synthetic_source
    )


def _offloads(p) -> bool:
    return p.ddp.optimizer_cpu_offload


def test_min_gpus_offloads_to_fit_on_fewer_gpus():
    """8 GiB GPUs: without offload SMALL needs 2 (its 0.9B parameters' 12 bytes of Adam state
    alone are ~10 GiB); with offload searched one GPU holds it, at DP 1 with the distributed and
    precision-aware optimizers (fp32 dtypes) that Megatron-LM needs for it, and the same plan
    without offload does not fit: the optimizer state is what overflows (the offloading plan's
    peak is lower by about that state)."""
    plain = _plan(64, 8, "min-gpus", (0.0,)).best
    moved = _plan(64, 8, "min-gpus").best
    assert plain.plan.world_size == 2 and not _offloads(plain.plan)
    assert moved.plan.world_size == 1 and moved.fits and _offloads(moved.plan)
    ddp = moved.plan.ddp
    assert moved.plan.distributed_optimizer and ddp.use_precision_aware_optimizer
    assert (ddp.main_params_dtype, ddp.exp_avg_dtype, ddp.exp_avg_sq_dtype) == ("fp32",) * 3
    back = _plan(1, 8, "throughput", (0.0,), fixed=without_offload(moved.plan)).best
    assert not back.fits
    optimizer = max(s.optimizer for s in back.stages)  # 12 bytes per parameter on one GPU
    assert optimizer > 8 * GIB and max(s.optimizer for s in moved.stages) < optimizer / 4
    assert moved.peak < back.peak - 0.9 * optimizer  # the state moved is what the peak lost


@pytest.mark.parametrize("gpus,gib", [(8, 4), (2, 8), (8, 3), (4, 8)])
def test_throughput_takes_offload_only_when_faster(gpus, gib):
    """With offload searched the fastest plan is never slower than without; it offloads only when
    that is estimated strictly faster than every plan that fits without offload; a chosen plan
    without offload is the same plan as the search without it, and each of its offloaded twins is
    slower (offload adds host transfers and the host Adam to the step)."""
    plain = _plan(gpus, gib, "throughput", (0.0,)).best
    best = _plan(gpus, gib, "throughput").best
    assert best.fits and best.step_seconds <= plain.step_seconds
    if _offloads(best.plan):
        assert best.step_seconds < plain.step_seconds
        return
    assert best.plan == plain.plan
    cost = PlanOptions().cost
    for f in OFFLOAD_FRACTIONS[1:]:
        ddp = offload_ddp(best.plan.ddp, f)
        twin = dataclasses.replace(best.plan, distributed_optimizer=True, ddp=ddp)
        assert step_seconds(SMALL, twin, cost) > best.step_seconds


def test_throughput_uses_offload_where_nothing_fits_without_it():
    """2 GPUs of 6 GiB: no plan fits without offload; with it one does."""
    with pytest.raises(CaptureError, match="no plan fits"):
        _plan(2, 6, "throughput", (0.0,))
    best = _plan(2, 6, "throughput").best
    assert best.fits and _offloads(best.plan)


def test_min_peak_and_cpu_do_not_offload_unless_asked():
    """min-peak keeps the optimizer on the device and reports the lower peak offload reaches."""
    lowest = _plan(8, 4, "min-peak")
    assert not _offloads(lowest.best.plan)
    reach = next(r for r in lowest.reasoning if r.startswith("with all of its optimizer offloaded"))
    assert "worst-rank peak would be" in reach and "of host memory per node" in reach
    cpu = PlanOptions(objective="min-gpus", global_batch_size=32)
    found = plan(
        SMALL, Cluster(gpus=8, gpu_memory_bytes=8 * GIB, device="cpu"), cpu, synthetic_source
    )
    assert not _offloads(found.best.plan)


def test_a_given_fraction_is_kept():
    """--optimizer-cpu-offload fixes its fraction; --optimizer-offload-fraction 0 keeps offload
    out; every candidate has what was given."""
    ddp = DdpOptions(
        use_precision_aware_optimizer=True,
        optimizer_cpu_offload=True,
        optimizer_offload_fraction=0.5,
    )
    space = space_from(ParallelFlags(), ddp=ddp)
    assert space.optimizer_offload == (0.5,)
    plans = list(candidates(SMALL, Cluster(gpus=8, gpu_memory_bytes=8 * GIB), 32, space))
    assert plans and {p.ddp for p in plans} == {ddp}
    off = space_from(ParallelFlags(), ddp=DdpOptions(optimizer_offload_fraction=0.0))
    plans = list(candidates(SMALL, Cluster(gpus=8, gpu_memory_bytes=8 * GIB), 32, off))
    assert plans and not any(_offloads(p) for p in plans)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("model") / "memory_model.json"
    write_model(full_model(SMALL), str(path))
    return str(path)


ONE_GPU = [
    "--gpus",
    "1",
    "--gpu-memory-gib",
    "8",
    "--global-batch-size",
    "32",
    "--context-gib",
    "0",
]


def test_offload_plan_says_what_it_costs_and_its_host_memory(model_file, capsys):
    argv = [*SMALL_ARGS, *ONE_GPU, "--memory-model", model_file, "--no-progress"]
    assert plan_cli.main(argv) == 0
    out = capsys.readouterr().out
    args = next(ln for ln in out.splitlines() if ln.startswith("megatron_args: "))
    assert "--optimizer-cpu-offload" in args and "--use-precision-aware-optimizer" in args
    assert "--use-distributed-optimizer" in args
    assert "the planner offloads the optimizer" in out and "changes no bytes" in out
    assert "of optimizer state on the device, +" in out and " s/step" in out
    assert "1 ranks per node hold" in out and "2048 GiB of host memory (--host-memory-gib)" in out


def test_host_memory_too_small_refuses_in_one_paragraph(model_file, tmp_path):
    """A node's host memory below what the offloaded optimizer needs: no plan fits one GPU, and
    the refusal says why (exit 2, one line, no traceback)."""
    argv = ["plan", *SMALL_ARGS, *ONE_GPU, "--memory-model", model_file, "--no-progress"]
    done = cli([*argv, "--host-memory-gib", "4"], str(tmp_path))
    error = one_error(done, "plan")
    assert "no plan fits 8 GiB on 1 GPUs" in error
    assert "above its 4 GiB of host memory (--host-memory-gib)" in error
