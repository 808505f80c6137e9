"""megatron-core's optimizers besides Adam (issue 51): SGD's momentum, Muon's momentum with Adam
for the embedding and output layer, layer-wise distributed Muon's share and all-gather, read from
the command line, predicted, emitted, refused where megatron-core or Megatron-LM refuses them."""

from __future__ import annotations

import json

import pytest
from synthetic_memory import SMALL, SMALL_ARGS, full_model

from capture_megatron.cli import plan as plan_cli
from capture_megatron.config import DdpOptions, ParallelPlan
from capture_megatron.errors import CaptureError
from capture_megatron.features.optimizers import Optimizer, layer_wise_share
from capture_megatron.fit import write_model
from capture_megatron.flags import parser as flags
from capture_megatron.flags.args import train_config
from capture_megatron.forecast import layers_for, predict
from capture_megatron.forecast.chunks import chunk_cost
from capture_megatron.rules.megatron import check_plan_fits_model


def _plan(optimizer: str = "adam", dp: int = 2, momentum: float = 0.9) -> ParallelPlan:
    opt = Optimizer(optimizer=optimizer, sgd_momentum=momentum)
    return ParallelPlan(
        tp=2, pp=2, dp=dp, micro_batch_size=1, global_batch_size=8 * dp, layers_per_stage=(8, 8),
        ddp=DdpOptions(optimizer=opt),
    )  # fmt: skip


MUON = Optimizer("muon")


def _optimizer_bytes(plan: ParallelPlan) -> list[float]:
    return [s.optimizer for s in predict(full_model(SMALL), SMALL, plan)]


def test_state_bytes_per_element():
    adam, sgd, muon = Optimizer(), Optimizer("sgd"), Optimizer("muon")
    assert [adam.state_bytes("bf16", False), adam.state_bytes("fp32", False)] == [12, 8]
    still = Optimizer("sgd", sgd_momentum=0)
    assert [sgd.state_bytes("bf16", False), still.state_bytes("bf16", False)] == [8, 4]
    assert [muon.state_bytes("bf16", False), muon.state_bytes("bf16", True)] == [8, 12]


def test_sgd_and_muon_keep_less_than_adam_and_the_layer_wise_share_less_still():
    """Without the distributed optimizer, per element: Adam 12 bytes + a step counter per tensor,
    SGD 8, Muon 8 except the embedding and output layer (Adam's 12); dist_muon about 1/DP of it."""
    adam, sgd = _optimizer_bytes(_plan("adam")), _optimizer_bytes(_plan("sgd"))
    muon, layer_wise = _optimizer_bytes(_plan("muon")), _optimizer_bytes(_plan("dist_muon"))
    layers = layers_for(full_model(SMALL), SMALL, _plan())
    numels = chunk_cost(layers, SMALL, _plan(), 1, 0)  # the last stage: layers + output layer
    for a, s, m, w in zip(adam, sgd, muon, layer_wise):
        assert s < m < a and w < m
        assert abs(s / a - 8 / 12) < 0.01  # the step counters are a few bytes per tensor
        assert 0.45 < w / m < 0.65  # DP 2: about half of the parameters, dealt ping-pong
    embedding = SMALL.padded_vocab(2) // 2 * SMALL.hidden_size
    assert muon[1] - sgd[1] >= 4 * embedding  # the output layer stays with Adam
    assert numels.gathered == (0.0, 0.0)
    gathered = chunk_cost(layers, SMALL, _plan("dist_muon"), 1, 0).gathered
    assert gathered[0] > 2 * 2 * 8 * 4 * SMALL.hidden_size**2 and gathered[1] == 0.0


def test_no_momentum_no_buffer():
    plain, none = _optimizer_bytes(_plan("sgd")), _optimizer_bytes(_plan("sgd", momentum=0))
    assert all(abs(n / p - 0.5) < 0.01 for p, n in zip(plain, none))


def test_layer_wise_share_is_megatron_cores_ping_pong():
    # sorted by size, dealt 0, 1, 2, 2, 1, 0, 0, 1, ...; the most loaded rank's indices
    numels = [10, 1, 2, 3, 4, 5, 6]
    assert sorted(layer_wise_share(numels, 3)) == [0, 1, 6]  # 1 + 6 + 10 elements
    assert layer_wise_share(numels, 1) == list(range(7))


@pytest.mark.parametrize(
    "plan, message",
    [
        (_plan("sgd").replace(distributed_optimizer=True), "Only Adam and HybridDeviceOptimizer"),
        (_plan("muon").replace(distributed_optimizer=True), "muon with dist optimizer"),
        (
            _plan("muon").replace(ddp=DdpOptions(optimizer=MUON, overlap_grad_reduce=True)),
            "without --overlap-grad-reduce",
        ),
    ],
)
def test_megatron_refusals(plan, message):
    with pytest.raises(CaptureError, match=message):
        check_plan_fits_model(SMALL, plan)


def test_plan_keeps_emits_and_never_overlaps_muon(tmp_path, capsys):
    """The search keeps the optimizer, never gives Muon the distributed optimizer or the overlap
    flags Megatron-LM asserts it without, and writes --optimizer into megatron_args."""
    path = tmp_path / "memory_model.json"
    write_model(full_model(SMALL), str(path))
    out = tmp_path / "plan.json"
    argv = [*SMALL_ARGS, "--memory-model", str(path), "--global-batch-size", "32", "--gpus", "8"]
    argv += ["--gpu-memory-gib", "40", "--context-gib", "0", "--no-progress", "--json", str(out)]
    assert plan_cli.main([*argv, "--optimizer", "muon"]) == 0
    data = json.loads(out.read_text())
    args = data["megatron_args"]
    assert args[args.index("--optimizer") + 1] == "muon"
    assert "--use-distributed-optimizer" not in args and "--overlap-grad-reduce" not in args
    assert data["plan"]["ddp"]["optimizer"]["optimizer"] == "muon"
    assert plan_cli.main(argv) == 0
    assert "optimizer" not in json.loads(out.read_text())["plan"]["ddp"]  # Adam: as before
    capsys.readouterr()


def test_the_trainer_refuses_muon_by_name():
    from capture_megatron.train.entry import build_parser

    argv = [*SMALL_ARGS, "--mock-data", "--optimizer", "muon"]
    ns = flags.parse_flags(build_parser("train", ""), argv)
    with pytest.raises(CaptureError, match="Emerging-Optimizers"):
        train_config(ns, 8, None)
