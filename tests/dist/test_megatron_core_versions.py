"""The installed megatron-core, whichever of the supported series (issue 55): a small PP-2 GPT and
a PP-2 x EP-2 mixture-of-experts model planned, trained and verified on the CPU are within 1% on
every rank, and the verify JSON names the megatron-core the forecast was made for. CI runs this
file on both legs: Python 3.11 with megatron-core 0.16.1 (`make test`) and Python 3.12 with
megatron-core 0.19.2 (`make test312`). Real torchrun + gloo, megatron-core's own layers."""

from __future__ import annotations

from importlib.metadata import version

from harness import SMALL_SHAPE, verify_on_cpu

PP2 = ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "1"]
MOE = [
    *("--disable-bias-linear", "--num-experts", "4", "--moe-router-topk", "2"),
    *("--moe-token-dispatcher-type", "alltoall", "--moe-aux-loss-coeff", "0.01"),
    *("--expert-model-parallel-size", "2"),
    *("--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"),
]


def _check(result: dict, pp: int) -> None:
    errors = [abs(r["error"]) for r in result["ranks"]]
    print(f"megatron-core {version('megatron-core')}: per-rank errors {errors}")
    assert result["plan"]["pp"] == pp
    assert result["megatron_core"] == version("megatron-core")
    assert len(errors) == pp and max(errors) <= 0.01, result["ranks"]


def test_a_pp2_gpt_is_verified_within_1_percent_on_every_rank(tmp_path):
    _check(verify_on_cpu([*SMALL_SHAPE, *PP2], tmp_path, nproc=2), pp=2)


def test_a_pp2_moe_model_is_verified_within_1_percent_on_every_rank(tmp_path):
    result = verify_on_cpu([*SMALL_SHAPE, *PP2, *MOE], tmp_path, nproc=4)
    assert result["plan"]["ep"] == 2
    _check(result, pp=2)
