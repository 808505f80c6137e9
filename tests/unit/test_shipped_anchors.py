"""The anchor records shipped with the package (capture_megatron/profile/anchors) are found by the
plans they were written for, are what the probes measure, and fill an empty cache without a probe:
a change of version, model reading or kernel set without re-running bench/ship_anchors.py would
leave those plans to profile from nothing (minutes each)."""

from __future__ import annotations

import dataclasses
import json
import os
from importlib import resources
from importlib.metadata import version

import pytest

from capture_megatron.api.request import Request, cluster_of, read_request
from capture_megatron.cache import records_path
from capture_megatron.cli.plan import build_parser
from capture_megatron.config.kernels import kernel_set
from capture_megatron.profile.shipped import ANCHORS, SWITCH, read_shipped, shipped_anchors
from capture_megatron.profile.source import profiled_model
from capture_megatron.records import read_records

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FOLDER = resources.files("capture_megatron.profile").joinpath(ANCHORS)
INDEX: dict = json.loads(FOLDER.joinpath("index.json").read_text())
SHIPPED_FOR = ("2.13.0+cpu", "0.16.1")
"""The torch and megatron-core the anchors are shipped for (the default CI leg's); on any other
the names differ, nothing shipped is read and the plans profile as before."""

needs_pinned = pytest.mark.skipif(
    (version("torch"), version("megatron-core")) != SHIPPED_FOR,
    reason="anchor records are shipped for torch 2.13.0+cpu and megatron-core 0.16.1 only",
)
PLANS = [(file, argv) for file, entry in sorted(INDEX.items()) for argv in entry["plans"].values()]


def _records_file(argv: list[str]) -> tuple[str, Request]:
    """(the records file a fake-CUDA plan of `argv` reads, its Request)."""
    argv = [os.path.join(ROOT, a) if a.endswith(".json") else a for a in argv]
    ns = build_parser().parse_args(argv)
    request = read_request(ns, cluster_of(ns), False, None)
    kernels = kernel_set("fake-cuda", request.options.kernels)
    return records_path(request.shape, "fake-cuda", kernels), request


def test_every_shipped_file_is_indexed_and_every_indexed_one_shipped():
    files = {p.name for p in FOLDER.iterdir() if p.name.endswith(".jsonl.gz")}
    assert files == set(INDEX), "run python bench/ship_anchors.py"
    assert all(entry["plans"] for entry in INDEX.values())


@needs_pinned
@pytest.mark.parametrize("file, argv", PLANS, ids=[p[0] for p in PLANS])
def test_each_plan_reads_its_shipped_file(file, argv):
    path, _ = _records_file(argv)
    assert os.path.basename(path) + ".gz" == file, "run python bench/ship_anchors.py"


@needs_pinned
def test_an_empty_cache_takes_every_shipped_pair_without_a_probe(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CAPTURE_MEGATRON_CACHE", str(tmp_path))
    file = min(INDEX, key=lambda f: FOLDER.joinpath(f).stat().st_size)  # the smallest: quick
    path, request = _records_file(next(iter(INDEX[file]["plans"].values())))
    shipped = shipped_anchors(path)
    asked = frozenset({(shipped[0].variant, shipped[0].shape)})
    model = profiled_model(request.shape, "fake-cuda", request.options.kernels, asked)
    assert "profiling" not in capsys.readouterr().out  # no probe ran
    assert model.variants  # fitted from the shipped records
    cached = {(r.variant, r.shape) for r in read_records(path)}
    assert cached == {(r.variant, r.shape) for r in shipped}  # every shipped pair, now cached
    monkeypatch.setenv(SWITCH, "0")
    assert shipped_anchors(path) == () and read_shipped(ANCHORS, file[: -len(".jsonl.gz")]) is None


@needs_pinned
@pytest.mark.slow
def test_shipped_records_are_what_the_probes_measure():
    """Two shipped records of the dense model measured again on fake CUDA: identical."""
    from capture_megatron.profile.session import run_probes
    from capture_megatron.profile.source import _probe

    dense = next(f for f, e in INDEX.items() if "llama3-70b" in e["plans"])
    path, request = _records_file(INDEX[dense]["plans"]["llama3-70b"])
    chosen = [r for r in shipped_anchors(path) if r.layers == 0 and r.kind in ("first", "last")][:2]
    assert len(chosen) == 2
    again = run_probes([_probe(r) for r in chosen], "fake-cuda", request.options.kernels, False)
    for old, new in zip(chosen, again):
        assert dataclasses.replace(new, variant=old.variant) == old
