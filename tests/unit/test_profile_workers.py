"""The fake-cuda profiling workers (capture_megatron.profile.remote) are started once and kept for
a process's later rounds: a search profiles in rounds, and a worker start (torch and megatron-core
imports) costs about a dozen probes. What a kept worker measures does not depend on what it ran
before, a job of another kernel set included."""

from __future__ import annotations

import pytest

from capture_megatron.config import Kernels, ModelShape, ParallelPlan

SHAPE = ModelShape(
    num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, vocab_size=512,
    add_bias_linear=False,
)  # fmt: skip


def _probes():
    """The probes of SHAPE's two-stage plan (a dozen or so)."""
    from capture_megatron.forecast import variant_of
    from capture_megatron.profile.design import probes_for
    from capture_megatron.records import ProbeShape

    plan = ParallelPlan(
        tp=1, pp=2, dp=1, micro_batch_size=2, global_batch_size=8, layers_per_stage=(1, 1)
    )
    return probes_for(variant_of(SHAPE, plan), [ProbeShape.of(SHAPE, 1, 2)])


@pytest.mark.slow
def test_a_second_round_reuses_the_worker_and_measures_the_same():
    from capture_megatron.profile import remote
    from capture_megatron.profile.session import run_probes

    probes = _probes()
    remote._stop(list(remote._KEPT), kill=False)  # noqa: SLF001  (a fresh start)
    first = run_probes(probes[:3], "fake-cuda", progress=False)
    (worker,) = remote._KEPT  # noqa: SLF001  (3 probes: one worker)
    again = run_probes(probes, "fake-cuda", progress=False)
    assert [worker] == remote._KEPT and worker.process.poll() is None  # noqa: SLF001
    measured = [
        (r.kind, r.layers, r.saved_bytes, r.forward_peak, r.backward_peak) for r in again[:3]
    ]
    assert measured == [
        (r.kind, r.layers, r.saved_bytes, r.forward_peak, r.backward_peak) for r in first
    ]
    remote._stop(list(remote._KEPT), kill=False)  # noqa: SLF001  (ends at the end of its input)
    assert worker.process.returncode == 0 and not remote._KEPT  # noqa: SLF001


# Transformer Engine with flash attention and every fusion, against the local spec's unfused
# attention without the fusions: different modules, saved tensors and workspaces
TE = Kernels()
LOCAL = Kernels(
    transformer_impl="local", attention_backend="unfused", masked_softmax_fusion=False,
    bias_dropout_fusion=False, rope_fusion=False, deterministic_mode=True,
)  # fmt: skip


@pytest.mark.slow
def test_a_worker_kept_from_another_kernel_set_measures_what_a_fresh_one_does():
    from capture_megatron.profile import remote
    from capture_megatron.profile.session import run_probes

    probes = _probes()[:3]
    remote._stop(list(remote._KEPT), kill=False)  # noqa: SLF001  (a fresh start)
    fresh_local = run_probes(probes, "fake-cuda", LOCAL, progress=False)
    remote._stop(list(remote._KEPT), kill=False)  # noqa: SLF001
    te = run_probes(probes, "fake-cuda", TE, progress=False)
    (worker,) = remote._KEPT  # noqa: SLF001  (3 probes: one worker)
    local = run_probes(probes, "fake-cuda", LOCAL, progress=False)
    te_again = run_probes(probes, "fake-cuda", TE, progress=False)
    assert [worker] == remote._KEPT  # noqa: SLF001  (one worker ran all three jobs)
    remote._stop(list(remote._KEPT), kill=False)  # noqa: SLF001

    def held(records):
        return [(r.saved_bytes, r.forward_peak, r.backward_peak) for r in records]

    assert held(te) != held(fresh_local)  # the kernel sets keep different tensors
    assert local == fresh_local and te_again == te
