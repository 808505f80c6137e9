"""Issue 12, must-show 1: `predict` on Megatron-LM's own functional tests (core_v0.16.1, measured on
8 x H100; tests/data/megatron_lm_functional_tests.json), each case's MODEL_ARGS verbatim.

Development set only: the dense GPT cases at world size 8 whose names do not contain "resume" (the
"resume" cases are held out; bench/conformance.py reports them in docs/BENCHMARKS.md). Every
accepted case's last pipeline stage must be within 5% of its measured peak of allocated bytes and
the median within 2%, the context-parallel ones (issue 16) within 5%; every refused case must be
refused for a feature that is not modelled, named.
"""

from __future__ import annotations

import importlib.util
import statistics
from pathlib import Path

import pytest

from capture_megatron.config import versions

BENCH = Path(__file__).parents[2] / "bench" / "conformance.py"
NOT_MODELLED = (
    "--num-experts",
    "--expert-tensor-parallel-size",
)


def _conformance():
    spec = importlib.util.spec_from_file_location("conformance", BENCH)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.xdist_group("forecasts")  # with the other forecasts: tests/conftest.py
def test_development_cases_on_the_gpu_kernel_set(forecast_cache, monkeypatch):
    monkeypatch.setenv("CAPTURE_MEGATRON_CACHE", forecast_cache)
    bench = _conformance()
    dev = [c for c in bench.cases(("gpt",)) if c["world_size"] == 8 and "resume" not in c["name"]]
    assert len(dev) >= 20
    rows = [bench.predict_case(c, "fake-cuda") for c in dev]
    refused = [r for r in rows if "refused" in r]
    for r in refused:
        assert any(flag in r["refused"] for flag in NOT_MODELLED), r
    errors = {r["name"]: r["error"] for r in rows if "error" in r}
    assert len(errors) + len(refused) == len(dev) and len(errors) >= 10
    worst = max(errors.items(), key=lambda kv: abs(kv[1]))
    assert abs(worst[1]) <= 0.05, errors
    assert statistics.median(abs(e) for e in errors.values()) <= 0.02, errors
    context_parallel = {n: e for n, e in errors.items() if "_cp2" in n}  # TE's ring attention
    assert len(context_parallel) >= 5 and max(map(abs, context_parallel.values())) <= 0.05
    for name in ("gpt3_7b_tp1_pp4_memory_speed", "gpt3_7b_tp4_pp1_memory_speed"):
        assert any(n.startswith(name) for n in errors), (name, sorted(errors))


MOE_CASES = (
    "gpt3_mcore_cp2_pp2_ep2_te_4experts2parallel_nondeterministic",  # sinkhorn, allgather, CP2
    "gpt3_mcore_te_tp2_pp1_te_8experts_etp1_ep4",  # TE's grouped GEMM, ETP 1 under TP 2
    # MLA, MTP, QK norms, TE's fused permutation and TE's fused cross entropy (issue 26)
    "gpt3_mcore_te_tp2_pp2_ep4_etp1_memory_speed",
)


@pytest.mark.slow
@pytest.mark.xdist_group("forecasts")  # with the other forecasts: tests/conftest.py
def test_moe_cases_on_the_gpu_kernel_set(forecast_cache, monkeypatch):
    """Issue 16, must-show 2, and issue 26 (two development cases; bench/conformance.py runs them
    all): dropless MoE at the default routing forecast (measured routing statistics) within 10%
    of the measured peak, and the worst-case bound above it."""
    monkeypatch.setenv("CAPTURE_MEGATRON_CACHE", forecast_cache)
    bench = _conformance()
    for case in (c for c in bench.cases(("moe",)) if c["name"] in MOE_CASES):
        row = bench.predict_case(case, "fake-cuda")
        assert row.get("routing") == "forecast", row.get("refused")
        assert 1.0 < row["factor"] <= row["planning_factor"] < row["bound_factor"], row
        assert abs(row["error"]) <= 0.10 and row["bound"] > row["measured"], row


def test_values_reach_capture_megatron_as_megatron_lms_launcher_hands_them_on():
    """_run_training.sh (core_v0.16.1) trims each MODEL_ARGS value with xargs and builds the
    argument array with eval: two levels of backslash escapes go, nothing else changes."""
    launched = _conformance().launched
    assert launched(r"Et*3\\|\\(tt\\|\\)*6mL") == "Et*3|(tt|)*6mL"
    assert launched("([0]*3+[1]*12)") == "([0]*3+[1]*12)"


ISSUE51_CASES = {
    "gpt3_mcore_te_tp2_zp_z3_resume_fsdp_dtensor": 0.05,
    "gpt3_mcore_te_tp2_zp_z3_resume_torch_dist_te_8experts2parallel_top2router": 0.10,
    "gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_optimizer": 0.10,
}
"""Issue 51's cases the forecast now answers within their bars (5% dense, 10% MoE) -> the bar:
the two Megatron-FSDP cases (Transformer Engine 2.11's whole Adam moments, the TE their golden
values were recorded with) and an EP 8 dropless case whose 100 iterations end early in a long
warm-up (routers as initialised)."""


@pytest.mark.slow
@pytest.mark.xdist_group("forecasts")  # with the other forecasts: tests/conftest.py
@pytest.mark.skipif(versions.current() != versions.V0_16, reason="core_v0.16.1's golden values")
def test_the_fsdp_and_early_routing_cases_are_within_the_bars(forecast_cache, monkeypatch):
    monkeypatch.setenv("CAPTURE_MEGATRON_CACHE", forecast_cache)
    monkeypatch.setenv(versions.TE_ENV, "2.11")  # the TE Megatron-LM recorded them with
    bench = _conformance()
    by_name = {c["name"]: c for c in bench.cases(("gpt", "moe")) if c["name"] in ISSUE51_CASES}
    rows = {name: bench.predict_case(by_name[name], "fake-cuda") for name in ISSUE51_CASES}
    assert all(abs(rows[n]["error"]) <= bar for n, bar in ISSUE51_CASES.items()), rows
