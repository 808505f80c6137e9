"""The typed Python API: profile -> fit -> predict -> plan with frozen objects in and out, the plan
JSON written by PlanResult and read back by read_plan (fake device, a tiny model)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from capture_megatron.config import GIB, Cluster, ModelShape
from capture_megatron.errors import CaptureError
from capture_megatron.fit import fit
from capture_megatron.forecast import predict
from capture_megatron.planner import PlanOptions, Space, plan, read_plan
from capture_megatron.profile import ProfileOptions, memory_source, profile

# one worker runs the module (make test: --dist loadgroup), so its module fixtures are built once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("api")]

SHAPE = ModelShape(
    num_layers=6, hidden_size=64, num_attention_heads=4, seq_length=64, vocab_size=300, dtype="bf16"
)
CLUSTER = Cluster(gpus=4, gpu_memory_bytes=4 * GIB)
SPACE = Space(tp=(1,), pp=(4,), vpp=(1,), micro_batch_size=(1,), recompute=("none",))
CONTRACT = {
    "plan",
    "predicted_peak_bytes",
    "breakdown",
    "megatron_args",
    "baselines",
    "needed_bytes_per_gpu",
    "fits",
    "memory_model",
    "model_args",
}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CAPTURE_MEGATRON_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield memory_source(SHAPE, "fake", progress=False)


def test_plan_result_and_its_json(source, tmp_path):
    result = plan(SHAPE, CLUSTER, PlanOptions(space=SPACE, global_batch_size=8), source)
    best = result.best
    assert best.fits and best.plan.pp == 4 and sum(best.plan.layers_per_stage) == 6
    assert max(best.rank_peaks) == int(best.peak)
    assert result.baseline("uniform").partition is None  # 6 layers do not split evenly over 4
    assert result.baseline("megatron-first-last").partition.peak >= best.peak
    data = result.to_plain()
    assert set(data) >= CONTRACT and data["plan"]["layout"] == best.plan.layout
    assert "--pipeline-model-parallel-layout" in data["megatron_args"]
    path = tmp_path / "plan.json"
    result.write(str(path))
    assert json.loads(path.read_text()) == json.loads(json.dumps(data))
    planned = read_plan(str(path))
    assert planned.shape == SHAPE and planned.plan == best.plan


def test_a_fixed_plan_is_only_predicted(source):
    first = plan(SHAPE, CLUSTER, PlanOptions(space=SPACE, global_batch_size=8), source).best.plan
    fixed = dataclasses.replace(first, layers_per_stage=(1, 1, 2, 2))
    result = plan(SHAPE, CLUSTER, PlanOptions(fixed=fixed), source)
    assert result.considered == 1 and result.best.plan == fixed


def test_profile_fit_predict_agree_with_plan(source):
    result = plan(SHAPE, CLUSTER, PlanOptions(space=SPACE, global_batch_size=8), source)
    records = profile(SHAPE, ProfileOptions(device="fake", design=False, progress=False))
    assert {r.variant.dtype for r in records} == {"bf16"} and len(records) == 8
    stages = predict(fit(list(records)), SHAPE, result.best.plan)
    assert [int(s.peak) for s in stages] == list(result.best.rank_peaks)


def test_plan_without_a_memory_model_is_an_error():
    with pytest.raises(CaptureError, match="needs a memory model"):
        plan(SHAPE, CLUSTER)


def test_a_warm_plan_reads_the_kept_fit(source, monkeypatch):
    """A records file's fit is kept beside it (<records>.fit.json): a later process (the
    in-process caches cleared) plans from it without fitting again, while records changed since
    are fitted again."""
    import glob
    import os

    from capture_megatron.profile import source as src

    first = plan(SHAPE, CLUSTER, PlanOptions(space=SPACE, global_batch_size=8), source)
    cache = os.environ["CAPTURE_MEGATRON_CACHE"]
    (records,) = glob.glob(os.path.join(cache, "fake-cuda-*.jsonl"))
    assert os.path.exists(f"{records}.fit.json")

    def refit(_records, _memo=None):
        raise AssertionError("fitted again")

    monkeypatch.setattr(src, "fit", refit)
    src._fitted.cache_clear()
    src._read.cache_clear()
    src._WRITTEN.clear()
    src._FITS.clear()
    again = plan(SHAPE, CLUSTER, PlanOptions(space=SPACE, global_batch_size=8), source)
    assert again.best == first.best
    stat = os.stat(records)
    os.utime(records, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    src._fitted.cache_clear()
    with pytest.raises(AssertionError, match="fitted again"):
        plan(SHAPE, CLUSTER, PlanOptions(space=SPACE, global_batch_size=8), source)
