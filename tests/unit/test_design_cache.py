"""Issue 13, item 5: the design shapes are profiled once per variant and shared by every model of
that variant (capture_megatron.profile.design_cache); a second model profiles only its own
shapes (fake CPU device, tiny models, two design shapes instead of the full design to keep the
test short)."""

from __future__ import annotations

import os

import pytest

from capture_megatron.config import ModelShape
from capture_megatron.profile import ProfileOptions, design, profile, session
from capture_megatron.records import ProbeShape
from capture_megatron.version import PROBE_REVISION

pytestmark = pytest.mark.slow

A = ModelShape(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=300)
B = A.replace(hidden_size=96, num_attention_heads=6, seq_length=48)


def test_second_model_reuses_the_variants_design(tmp_path, monkeypatch):
    monkeypatch.setenv("CAPTURE_MEGATRON_CACHE", str(tmp_path))
    two = design.design_shapes((1, 2))[:2]
    monkeypatch.setattr(design, "design_shapes", lambda tps: two)
    options = ProfileOptions(device="fake-cpu", progress=False)
    first = profile(A, options)
    assert os.listdir(tmp_path / f"design-r{PROBE_REVISION}")
    ran: list[int] = []
    real = session.run_probes

    def counting(probes, *args, **kwargs):
        ran.append(len(probes))
        return real(probes, *args, **kwargs)

    monkeypatch.setattr(session, "run_probes", counting)
    second = profile(B, options)
    own = ProbeShape.of(B, 1, 1)
    anchors = [r for r in second if r.shape == own]
    assert anchors and ran == [len(anchors)]  # only B's own probes ran
    design_a = [r for r in first if r.shape in two]
    design_b = [r for r in second if r.shape in two]
    assert design_a == design_b and len(design_b) == 16
    assert len(second) == len(anchors) + len(design_b)
