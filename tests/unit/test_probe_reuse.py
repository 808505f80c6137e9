"""A chunk is measured once however many probes build it (capture_megatron.profile.design
.built_as): full recompute of none of a chunk's layers builds megatron-core's model without
recompute, so a full-recompute pair's probes without recomputed layers are its no-recompute
pair's. A cold search that asks for both pairs (the planner asks for a full-recompute candidate's
no-recompute twin) profiles those probes once."""

from __future__ import annotations

import dataclasses

import pytest

from capture_megatron.config import ModelShape, ParallelPlan
from capture_megatron.profile.design import built_as, probes_for
from capture_megatron.records import ProbeShape, Variant

SHAPE = ModelShape(
    num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, vocab_size=512,
    add_bias_linear=False,
)  # fmt: skip
SIZE = ProbeShape.of(SHAPE, 1, 2)


def _variants() -> tuple[Variant, Variant]:
    from capture_megatron.forecast import variant_of

    plan = ParallelPlan(
        tp=1, pp=2, dp=1, micro_batch_size=2, global_batch_size=8, layers_per_stage=(1, 1)
    )
    none = variant_of(SHAPE, plan)
    return none, dataclasses.replace(none, recompute="full")


def test_only_full_recompute_of_no_layer_is_built_as_no_recompute():
    none, full = _variants()
    selective = dataclasses.replace(none, recompute="selective")
    for probe in probes_for(full, [SIZE]):
        expected = none if probe.recompute_layers == 0 else full
        assert built_as(probe) == dataclasses.replace(probe, variant=expected)
    for probe in probes_for(selective, [SIZE]) + probes_for(none, [SIZE]):
        assert built_as(probe) == probe


def _measured(records: list) -> list:
    """The records with their variants blanked (what was measured)."""
    return [dataclasses.replace(r, variant=None) for r in records]


@pytest.mark.slow
def test_a_chunk_is_measured_once_and_equals_its_own_measurement():
    from capture_megatron.profile.session import run_probes

    none, full = _variants()
    alone = run_probes(probes_for(full, [SIZE]), "cpu", progress=False)  # measured as built
    runs: list[None] = []
    both = run_probes(
        probes_for(full, [SIZE]) + probes_for(none, [SIZE]),
        "cpu",
        progress=False,
        tick=lambda: runs.append(None),
    )
    assert len(runs) == len(alone)  # the no-recompute probes ran once, not twice
    assert [r.variant for r in both] == [full] * len(alone) + [none] * (len(both) - len(alone))
    assert _measured(both[: len(alone)]) == _measured(alone)
    shared = [r for r in alone if r.recompute_layers == 0]
    assert _measured(shared) == _measured(both[len(alone) :])


@pytest.mark.slow
def test_a_cached_chunk_is_not_profiled_again(tmp_path, monkeypatch, capsys):
    from capture_megatron.config import Kernels
    from capture_megatron.profile.source import profiled_model

    monkeypatch.setenv("CAPTURE_MEGATRON_CACHE", str(tmp_path))
    none, full = _variants()
    profiled_model(SHAPE, "cpu", Kernels(), {(none, SIZE)}, progress=False)
    first = capsys.readouterr().out
    profiled_model(SHAPE, "cpu", Kernels(), {(none, SIZE), (full, SIZE)}, progress=False)
    second = capsys.readouterr().out
    base = len(probes_for(none, [SIZE]))
    assert f"profiling {base} probes" in first
    assert f"profiling {len(probes_for(full, [SIZE])) - base} probes" in second


@pytest.mark.slow
def test_a_records_file_of_an_older_format_is_profiled_again(tmp_path, monkeypatch, capsys):
    """An upgrade that changes the records format (RECORD_FORMAT) finds the user's old cache file:
    it is set aside with a note and the pairs profiled again, not fitted empty."""
    from capture_megatron.cache import records_path
    from capture_megatron.config import Kernels
    from capture_megatron.config.kernels import kernel_set
    from capture_megatron.profile.source import profiled_model

    monkeypatch.setenv("CAPTURE_MEGATRON_CACHE", str(tmp_path))
    none, _ = _variants()
    path = records_path(SHAPE, "cpu", kernel_set("cpu", Kernels()))
    with open(path, "w") as f:
        f.write('{"capture_megatron_records": 2, "version": "0.6.0"}\n')
    model = profiled_model(SHAPE, "cpu", Kernels(), {(none, SIZE)}, progress=False)
    out = capsys.readouterr().out
    assert "is unusable" in out and f"profiling {len(probes_for(none, [SIZE]))} probes" in out
    assert model is not None and (tmp_path / (path.split("/")[-1] + ".damaged")).exists()
