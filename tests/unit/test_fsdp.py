"""Megatron-FSDP (issue 51): each sharding strategy's shards and whole buffers, the layers gathered
for the forward and backward (prefetched up to half the communication unit, two at most with
double buffers), the gradient buckets a backward holds until their reduce-scatter, megatron-core's
and Megatron-LM's rules, and the flags read, emitted and listed."""

from __future__ import annotations

import json

import pytest
from synthetic_memory import SMALL, SMALL_ARGS, full_model

from capture_megatron.cli import plan as plan_cli
from capture_megatron.config import DdpOptions, ParallelPlan, versions
from capture_megatron.errors import CaptureError
from capture_megatron.features.fsdp import Fsdp
from capture_megatron.fit import write_model
from capture_megatron.forecast import layers_for
from capture_megatron.forecast.chunks import ChunkCost, chunk_cost
from capture_megatron.forecast.fsdp import Layout, Passes, fsdp_chunk
from capture_megatron.rules.modelled import fsdp_problem

DP = 8


@pytest.fixture(autouse=True)
def _fixed_moments(monkeypatch):
    """The sharding rules as megatron-core lays them out: a Transformer Engine whose FusedAdam
    shards the moments (2.12; 2.10 and 2.11 keep them whole, tested apart below)."""
    monkeypatch.setenv(versions.TE_ENV, "2.12")


def _cost(strategy: str | None, tp: int = 1, **knobs) -> ChunkCost:
    fsdp = Fsdp(True, strategy, **knobs) if strategy else Fsdp()
    plan = ParallelPlan(
        tp=tp, pp=1, dp=DP, micro_batch_size=1, global_batch_size=8 * DP, layers_per_stage=(16,),
        ddp=DdpOptions(fsdp=fsdp),
    )  # fmt: skip
    return chunk_cost(layers_for(full_model(SMALL), SMALL, plan), SMALL, plan, 0, 0)


def _near(a: float, b: float, rel: float = 0.01) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b))


def test_each_strategy_shards_what_megatron_core_shards():
    """bf16: model weights 2 bytes, gradients 4 (fp32), main weights and Adam 12 per element;
    no_shard keeps everything whole (as DDP without the distributed optimizer), optim shards the
    main weights and Adam, optim_grads the gradients too, optim_grads_params the weights too."""
    ddp, plain = _cost(None), _cost("no_shard")
    optim, grads, params = _cost("optim"), _cost("optim_grads"), _cost("optim_grads_params")
    elements = ddp.params // 2
    assert plain.params == ddp.params and plain.grads == ddp.grads
    assert _near(plain.optimizer, ddp.optimizer)
    assert optim.params == ddp.params and _near(optim.grads, ddp.grads)
    assert _near(optim.optimizer, 12 * elements / DP)
    assert _near(grads.grads, ddp.grads / DP) and grads.params == optim.params
    assert _near(params.params, ddp.params / DP) and _near(params.grads, grads.grads)
    assert plain.step_copies == params.step_copies == 0  # fp32 gradients: no copies


@pytest.mark.parametrize("te", ["2.10", "2.11"])
def test_te_2_10_and_2_11_keep_the_adam_moments_whole(monkeypatch, te):
    """Transformer Engine 2.10 and 2.11's FusedAdam makes each moment torch.empty(param.shape):
    under Megatron-FSDP the DTensor's global shape, gathered over TP and not sharded -- 8 bytes
    per element of every parameter x TP, where 2.12 keeps 8 per element of the rank's shard
    (the fp32 main weights stay sharded)."""
    sharded = _cost("optim_grads_params", tp=2)
    monkeypatch.setenv(versions.TE_ENV, te)
    whole = _cost("optim_grads_params", tp=2)
    elements = sharded.params * DP // 2  # the rank's TP shard, before FSDP shards it
    assert _near(sharded.optimizer, 12 * elements / DP)
    assert _near(whole.optimizer, 4 * elements / DP + 8 * 2 * elements)
    assert whole.params == sharded.params and whole.grads == sharded.grads


def test_the_transformer_engine_assumed(monkeypatch):
    """Without TE installed, the newest megatron-core's own requirement admits (0.16.1: 2.11);
    CAPTURE_MEGATRON_TE_VERSION overrides it; a value that is no version is named."""
    monkeypatch.delenv(versions.TE_ENV)
    expected = versions.TE_NEWEST_ADMITTED.get(versions.current(), (2, 12))
    assert versions.transformer_engine() == expected
    monkeypatch.setenv(versions.TE_ENV, "2.11.0+cu13")
    assert versions.transformer_engine() == (2, 11) and versions.te_full_size_moments()
    monkeypatch.setenv(versions.TE_ENV, "latest")
    with pytest.raises(CaptureError, match="CAPTURE_MEGATRON_TE_VERSION='latest'"):
        versions.transformer_engine()


LAYER = 12_000_000
"""Elements of one layer in the walk tests below (16 of them, nothing saved: the gathered
weights and gradient buckets alone)."""


def _walk(strategy: str, kind: str = "only", **knobs):
    fsdp = Fsdp(True, strategy, **knobs)
    layout = Layout(((LAYER, 0),) * 16, (1_000_000, 0), 160)
    return fsdp_chunk(
        fsdp, DdpOptions(fsdp=fsdp), "bf16", layout, (DP, 1), kind, None, Passes(0, 0, 0)
    )


def test_the_layers_gathered_follow_the_prefetch_window():
    """By default (a communication unit of 1e9 elements, prefetching 5e8) the first layer's
    forward gathers every layer of 16 x 12M elements; with a unit of two layers it prefetches
    one; with double buffers the layers sit in two persistent buffers instead."""
    wide = _walk("optim_grads_params")
    narrow = _walk("optim_grads_params", suggested_communication_unit_size=2 * LAYER)
    ends = 2 * 1_000_000  # the embedding and output layer, gathered from the first forward on
    assert wide.forward == 2 * 16 * LAYER and wide.buffers == ends
    assert narrow.forward == 2 * 2 * LAYER
    double = _walk("optim_grads_params", fsdp_double_buffer=True)
    assert double.buffers == 2 * (2 + 4) * LAYER + ends and double.forward == 0
    assert _walk("optim_grads").forward == _walk("optim_grads").buffers == 0  # weights whole


def test_gradient_buckets_wait_for_the_reduce_scatter_queue():
    """The backward holds each finished layer's whole fp32 buckets until the reduce-scatter queue
    passes the communication unit; the first stage's embedding bucket until the backward ends,
    the last stage's output layer first in the queue."""
    ends, grads = 1_000_000, 4 * 16 * LAYER
    wide = _walk("optim_grads_params", "first", suggested_communication_unit_size=10**12)
    assert wide.backward == 4 * ends + grads + 2 * LAYER  # + the first layer gathered
    # a queue of 3 layers: 4 finished layers at most (it is emptied down to 3 before the next
    # one joins) and the one running; 1.5 layers prefetched: the running one and two more
    tight = _walk("optim_grads_params", "first", suggested_communication_unit_size=3 * LAYER)
    assert tight.backward == 4 * (ends + 5 * LAYER) + 2 * 3 * LAYER


def test_sharded_gradients_are_held_whole_until_the_backward_ends():
    """optim_grads accumulates each micro-batch's gradients in whole fp32 buckets, reduce-
    scattered at the end of the backward (one bucket, below the 1e9-element queue)."""
    plain, grads = _cost("optim"), _cost("optim_grads")
    assert grads.backward - plain.backward > 0.9 * plain.grads
    assert grads.forward == plain.forward


def test_cpu_kernels_and_fp8_parameters_are_refused_with_the_reason():
    ddp = DdpOptions(fsdp=Fsdp(True, "optim_grads_params"))
    assert "CUDA only" in fsdp_problem(ddp, "cpu", False)
    assert "--fp8-param-gather" in fsdp_problem(ddp, "gpu:transformer_engine/auto", True)
    assert fsdp_problem(DdpOptions(), "cpu", True) == ""


@pytest.fixture
def memory_model(tmp_path) -> str:
    path = tmp_path / "memory_model.json"
    write_model(full_model(SMALL), str(path))
    return str(path)


def _plan(argv: list[str], memory_model: str, out) -> int:
    base = [*SMALL_ARGS, "--memory-model", memory_model, "--global-batch-size", "32"]
    base += ["--gpus", "8", "--gpu-memory-gib", "40", "--context-gib", "0", "--no-progress"]
    return plan_cli.main([*base, *argv, "--json", str(out)])


FSDP = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]


def test_plan_keeps_and_emits_megatron_fsdp(memory_model, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert (
        _plan([*FSDP, "--ckpt-format", "fsdp_dtensor", "--fsdp-double-buffer"], memory_model, out)
        == 0
    )
    data = json.loads(out.read_text())
    args = data["megatron_args"]
    assert "--use-megatron-fsdp" in args and "--fsdp-double-buffer" in args
    assert args[args.index("--data-parallel-sharding-strategy") + 1] == "optim_grads_params"
    assert "--use-distributed-optimizer" not in args  # Megatron-FSDP shards by itself
    capsys.readouterr()


def test_megatron_lms_checkpoint_format_rule(memory_model, tmp_path, capsys):
    with pytest.raises(CaptureError, match="fsdp_dtensor checkpoint format"):
        _plan(FSDP, memory_model, tmp_path / "plan.json")
    capsys.readouterr()


def test_the_trainer_refuses_megatron_fsdp_by_name():
    from capture_megatron.flags import parser as flags
    from capture_megatron.flags.args import train_config
    from capture_megatron.train.entry import build_parser

    ns = flags.parse_flags(build_parser("train", ""), [*SMALL_ARGS, "--mock-data", *FSDP])
    with pytest.raises(CaptureError, match="Megatron-FSDP needs CUDA streams"):
        train_config(ns, 8, None)
