"""Profile real Megatron-Core chunks, fit, and predict shapes the fit never saw (within 1%); fake
mode equals CPU; records files round-trip and their errors are named."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from capture_megatron.errors import CaptureError
from capture_megatron.features.moe import Experts
from capture_megatron.fit import fit, sizes_of
from capture_megatron.forecast.heldout import check_records
from capture_megatron.forecast.static import chunk_static
from capture_megatron.profile.design import design_shapes, probes_for, variant_tps
from capture_megatron.profile.session import run_probes
from capture_megatron.records import (
    ExpertsProbe,
    Probe,
    ProbeShape,
    Variant,
    read_records,
    write_records,
)

# one worker runs the module (make test: --dist loadgroup), so its module fixtures are built once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("profile_fit")]

GPT = Variant(
    dtype="fp32",
    recompute="none",
    sequence_parallel=False,
    swiglu=False,
    normalization="LayerNorm",
    position_embedding_type="learned_absolute",
    add_bias_linear=True,
    dropout=True,
    untied=False,
)
LLAMA_BF16_SP = Variant(
    dtype="bf16",
    recompute="selective",
    sequence_parallel=True,
    swiglu=True,
    normalization="RMSNorm",
    position_embedding_type="rope",
    add_bias_linear=False,
    dropout=False,
    untied=True,
)
HELD_OUT = [
    ProbeShape(2, 160, 80, 5, 5, 16, 272, 384, 1),
    ProbeShape(1, 224, 112, 4, 2, 28, 176, 512, 2),
    ProbeShape(3, 96, 160, 8, 4, 20, 400, 768, 4),
    ProbeShape(2, 320, 48, 6, 3, 8, 96, 1152, 3),
    ProbeShape(1, 64, 144, 12, 12, 12, 288, 256, 1),
    ProbeShape(4, 80, 64, 4, 4, 16, 256, 512, 2),
]


@pytest.fixture(scope="module")
def gpt_model():
    records = run_probes(
        probes_for(GPT, design_shapes(variant_tps(GPT, 4))), "cpu", progress=False, timelines=True
    )
    return records, fit(records)


@pytest.fixture(scope="module")
def gpt_held_out():
    return _measure(GPT, HELD_OUT)


def _measure(variant, shapes, keys=(("middle", 1, 0), ("middle", 2, 0))):
    return run_probes(
        [Probe(variant, s, k, n, r) for s in shapes for k, n, r in keys], "cpu", progress=False
    )


def _check_transient_peaks(vm, records, rel=0.01):
    """Predicted forward / backward / step peaks within `rel` of measured."""
    checks = [c for c in check_records(vm, records) if c.transient]
    assert {c.quantity for c in checks} >= {"fwd1", "bwd1", "step1"}
    for c in checks:
        assert c.rel_error <= rel, c


def test_held_out_saved_activations_and_static_bytes(gpt_model, gpt_held_out):
    _, model = gpt_model
    vm = model.variants[0]
    measured = gpt_held_out
    for one, two in zip(measured[0::2], measured[1::2]):
        z = sizes_of(one)
        assert z not in [a.sizes for a in vm.anchors]
        pred = vm.constants(z)
        assert pred.layer_saved == pytest.approx(two.saved_bytes - one.saved_bytes, rel=1e-9), z
        assert pred.chunk("middle").saved1 == pytest.approx(one.saved_bytes, rel=1e-9), z
        assert list(pred.layer_numels) == list(one.param_numels), z
        static = chunk_static(list(pred.layer_numels), "fp32", 1, False)
        assert (static.params, static.grads, static.optimizer) == (
            one.param_bytes,
            one.grad_bytes,
            one.optimizer_bytes,
        )


def test_held_out_transient_peaks(gpt_model, gpt_held_out):
    """The replayed timelines predict unseen shapes' transient peaks (within 1%)."""
    vm = gpt_model[1].variants[0]
    assert {
        w.window for w in vm.windows if (w.kind, w.layers, w.recompute_layers) == ("middle", 1, 0)
    } == {"forward", "backward", "step"}
    _check_transient_peaks(vm, gpt_held_out)


def test_timelines_replay_to_the_measured_peaks():
    """A record's timelines replay to exactly its forward, backward and step peaks (cpu, fake-cpu
    and fake-cuda)."""
    from capture_megatron.fit.timelines.events import measured_peak

    shape = ProbeShape(2, 64, 64, 4, 2, 16, 192, 256, 2)
    probes = [
        Probe(LLAMA_BF16_SP, shape, k, n) for k, n in (("first", 1), ("middle", 1), ("last", 0))
    ]
    for device in ("cpu", "fake-cpu", "fake-cuda"):
        for rec in run_probes(probes, device, progress=False, timelines=True):
            assert measured_peak(rec.timeline("forward")) == rec.forward_peak, (device, rec.kind)
            assert measured_peak(rec.timeline("backward")) == rec.backward_peak, (device, rec.kind)
            step = rec.timeline("step")
            assert (step is None) == device.startswith("fake")
            assert step is None or measured_peak(step) == rec.step_peak


def test_anchors_are_exact_and_records_round_trip(gpt_model, tmp_path):
    records, model = gpt_model
    path = str(tmp_path / "r.jsonl")
    write_records(records, path)
    assert read_records(path) == records
    vm = model.variants[0]
    for anchor in vm.anchors[:3]:
        assert vm.constants(anchor.sizes) is anchor


def test_bf16_sp_selective_variant(tmp_path):
    shapes = design_shapes(variant_tps(LLAMA_BF16_SP, 4))
    model = fit(
        run_probes(probes_for(LLAMA_BF16_SP, shapes), "cpu", progress=False, timelines=True)
    )
    held = [
        ProbeShape(2, 96, 96, 8, 4, 16, 224, 512, 2),
        ProbeShape(1, 128, 64, 4, 4, 24, 160, 512, 4),
        ProbeShape(3, 64, 80, 4, 2, 8, 320, 384, 2),
    ]
    vm = model.variants[0]
    measured = _measure(LLAMA_BF16_SP, held)
    for one, two in zip(measured[0::2], measured[1::2]):
        assert vm.constants(sizes_of(one)).layer_saved == pytest.approx(
            two.saved_bytes - one.saved_bytes, rel=0.01
        )
    _check_transient_peaks(
        vm, measured + _measure(LLAMA_BF16_SP, held, (("first", 1, 0), ("last", 1, 0)))
    )


PADDED_EXPERTS = Experts(
    num_experts=4,
    moe_router_topk=2,
    moe_token_dispatcher_type="alltoall",
    moe_expert_capacity_factor=1.0,
    moe_pad_expert_input_to_capacity=True,
    moe_aux_loss_coeff=0.01,
)
# a forecast's routing bounds: the allgather dispatcher, and sinkhorn routing (which megatron
# allows no capacity for) padded to a capacity, whose token counts fake tensors cannot hold
ALLGATHER_BOUND = dataclasses.replace(
    PADDED_EXPERTS, moe_token_dispatcher_type="allgather", routing_bound=True
)
SINKHORN_BOUND = dataclasses.replace(
    ALLGATHER_BOUND,
    moe_router_topk=1,
    moe_router_load_balancing_type="sinkhorn",
    moe_aux_loss_coeff=0.0,
    moe_expert_capacity_factor=1.5,
)


@pytest.mark.parametrize(
    "variant",
    [
        GPT,
        LLAMA_BF16_SP,
        dataclasses.replace(GPT, dtype="bf16", recompute="full"),
        dataclasses.replace(LLAMA_BF16_SP, moe=ExpertsProbe(PADDED_EXPERTS, 2, 2, "exact")),
        dataclasses.replace(LLAMA_BF16_SP, moe=ExpertsProbe(ALLGATHER_BOUND, 2, 2, "imbalance")),
        dataclasses.replace(LLAMA_BF16_SP, moe=ExpertsProbe(SINKHORN_BOUND, 2, 1, "imbalance")),
        dataclasses.replace(GPT, cp=2),
    ],
    ids=[
        "gpt",
        "llama_bf16_sp",
        "gpt_bf16_full",
        "llama_moe_ep2",
        "moe_allgather",
        "moe_sinkhorn",
        "gpt_cp2",
    ],  # fmt: skip
)
def test_fake_equals_cpu_for_a_small_shape(variant):
    shape = ProbeShape(2, 64, 64, 4, 2, 16, 192, 256, 2)
    keys = [
        Probe(variant, shape, k, n)
        for k, n in (("first", 1), ("middle", 2), ("last", 1), ("only", 0))
    ]
    cpu = run_probes(keys, "cpu", progress=False)
    fake = run_probes(keys, "fake-cpu", progress=False)
    # RoPE keeps one int32 scalar per layer that fake mode materialises and the CPU run does not
    for a, b in zip(cpu, fake):
        slack = 4 * a.layers if variant.position_embedding_type == "rope" else 0
        for field in (
            "param_bytes",
            "grad_bytes",
            "optimizer_bytes",
            "input_bytes",
            "buffers",
            "backward_peak",
        ):
            assert getattr(a, field) == getattr(b, field), (a.kind, field)
        for field in ("saved_bytes", "forward_peak"):
            assert 0 <= getattr(b, field) - getattr(a, field) <= slack, (a.kind, field)


def test_fake_gpu_kernel_set_runs_grouped_and_sequential_experts():
    """The GPU kernel set profiles MoE layers (the allgather dispatcher, sinkhorn routing padded to
    its bound): TE's grouped GEMM holds the same parameters and optimizer state as the sequential
    experts, adds TE's 4 multi-stream cuBLAS workspaces, and keeps no more activations (its
    input views are the permuted tokens the sequential experts keep as their first linear's
    input)."""
    from capture_megatron.emulate.gpu.grouped import workspace_bytes

    shape = ProbeShape(2, 64, 64, 4, 2, 16, 192, 256, 2)
    sequential, grouped = (
        dataclasses.replace(
            LLAMA_BF16_SP,
            moe=ExpertsProbe(
                dataclasses.replace(SINKHORN_BOUND, moe_grouped_gemm=g), 2, 2, "imbalance"
            ),
        )
        for g in (False, True)
    )
    seq, grp = run_probes(
        [Probe(v, shape, "middle", 2) for v in (sequential, grouped)], "fake-cuda", progress=False
    )
    for field in ("param_bytes", "grad_bytes", "optimizer_bytes", "input_bytes"):
        assert getattr(seq, field) == getattr(grp, field) > 0, field
    assert grp.workspace_bytes - seq.workspace_bytes == workspace_bytes() == 4 * (32 * 2**20 + 1024)
    assert 0 < grp.saved_bytes <= seq.saved_bytes


@pytest.mark.parametrize("device", ["fake-cpu", "fake-cuda"])
def test_llama70b_fake_profile_and_fit_in_little_memory(tmp_path, device):
    """Llama-2-70B's layers profile under FakeTensorMode in under 2 GiB of host memory, on CPU
    kernels and on the GPU kernel set (whose worker process is measured too: RUSAGE_CHILDREN; the
    time it takes is in bench/speed.py)."""
    out = str(tmp_path / "r.jsonl")
    code = (
        "import resource, sys; from capture_megatron.cli import main; rc = main(sys.argv[1:]); "
        "rss = max(resource.getrusage(w).ru_maxrss for w in "
        "(resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)); print('RSS_MB', rss / 1024); "
        "sys.exit(rc)"
    )
    args = (
        "profile --num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 "
        "--num-attention-heads 64 --group-query-attention --num-query-groups 8 --swiglu "
        "--normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
        "--untie-embeddings-and-output-weights "
        "--hidden-dropout 0 --attention-dropout 0 --bf16 --seq-length 4096 --vocab-size 32000 "
        "--tensor-model-parallel-size 8 --sequence-parallel --micro-batch-size 1 "
        "--no-design --no-progress --out"
    ).split() + [out, "--device", device]
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    model = fit(read_records(out))
    rss = float(done.stdout.split("RSS_MB")[1].split()[0])
    assert rss < 2048, rss
    # a 70B layer at s=4096, TP8+SP: hundreds of MB of saved activations
    assert 0.1e9 < model.variants[0].anchors[0].layer_saved < 2e9


def test_records_file_errors(tmp_path, gpt_model):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(CaptureError, match="is empty"):
        read_records(str(empty))
    good = tmp_path / "good.jsonl"
    write_records(gpt_model[0][:3], str(good))
    lines = good.read_text().splitlines()
    (tmp_path / "cut.jsonl").write_text("\n".join(lines[:-1] + [lines[-1][:40]]))
    with pytest.raises(CaptureError, match="line 4 is truncated or corrupt"):
        read_records(str(tmp_path / "cut.jsonl"))
    header = json.loads(lines[0])
    header["version"] = "0.0.1"
    (tmp_path / "old.jsonl").write_text("\n".join([json.dumps(header)] + lines[1:]))
    with pytest.raises(CaptureError, match="written by capture-megatron 0.0.1"):
        read_records(str(tmp_path / "old.jsonl"))
    (tmp_path / "alien.jsonl").write_text('{"hello": 1}\n')
    with pytest.raises(CaptureError, match="not a capture-megatron records file"):
        read_records(str(tmp_path / "alien.jsonl"))


@pytest.mark.parametrize(
    "variant",
    [
        dataclasses.replace(GPT, dtype="bf16", recompute="full", sequence_parallel=True),
        dataclasses.replace(LLAMA_BF16_SP, recompute="full"),
    ],
)
def test_full_recompute_chunks_of_any_depth(variant):
    """Block recompute of n of k layers: the decomposition (first recomputed layer R, each further
    R2) predicts saved, forward and backward peaks of unprobed (k, n) exactly."""
    from capture_megatron.fit import shape_sizes
    from capture_megatron.forecast.chunks import _activations

    shape = ProbeShape(2, 64, 64, 4, 4, 16, 256, 256, 2)
    sc = (
        fit(run_probes(probes_for(variant, [shape]), "cpu", progress=False))
        .variants[0]
        .constants(shape_sizes(shape))
    )
    cases = [(3, 2), (3, 3), (4, 2), (4, 4)]
    for (k, n), rec in zip(
        cases,
        run_probes(
            [Probe(variant, shape, "middle", k, n) for k, n in cases], "cpu", progress=False
        ),
    ):
        _, saved, fwd, bwd, _ = _activations(sc, "middle", k, n)
        assert (saved, fwd, bwd) == (rec.saved_bytes, rec.forward_peak, rec.backward_peak), (k, n)


def test_fit_table_reports_the_error_of_what_predictions_use(gpt_model, gpt_held_out, capsys):
    """`capture-megatron fit`'s table marks every regression row whose quantity a replayed timeline
    gives as not used (naming the timeline row), exactly the rows VariantModel.constants replaces
    at a shape it never saw, and closes with the largest leave-one-out error of the used rows."""
    from capture_megatron.cli.render import print_quality
    from capture_megatron.fit.quality import quality_rows, used_error
    from capture_megatron.fit.timelines.windows import FIELDS, lookup

    _, model = gpt_model
    vm = model.variants[0]
    z = sizes_of(gpt_held_out[0])
    pred, replay = vm.constants(z), lookup(vm.windows, z)
    rows = {r.quantity: r for r in quality_rows(model)}
    assert {"middle.fwd1", "middle.bwd1", "layer saved S"} <= {
        q for q, r in rows.items() if r.replaced_by
    }
    differ = 0
    for chunk in vm.chunks:
        for field, reg in chunk.fields:
            row, used = rows[f"{chunk.kind}.{field}"], getattr(pred.chunk(chunk.kind), field)
            if row.replaced_by:
                assert row.replaced_by in rows, row
                assert used == replay(chunk.kind, *FIELDS[field]), row
                differ += used != reg.predict(z)
            else:
                assert used == reg.predict(z), row
    assert differ > 0  # the replay is not the regression: which one is used matters
    print_quality(model)
    out = capsys.readouterr().out
    worst = used_error(list(rows.values()))
    assert worst is not None and not worst.replaced_by
    assert f"{100 * worst.loo_max_rel_error:.3f}% ({worst.variant} {worst.quantity}" in out
    marked = [line for line in out.splitlines() if "not used:" in line]
    assert len(marked) == sum(1 for r in rows.values() if r.replaced_by)
