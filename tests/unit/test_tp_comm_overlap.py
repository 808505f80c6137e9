"""--tp-comm-overlap on the GPU kernel set: Transformer Engine's userbuffers (twelve
[seq x micro-batch / CP, hidden] buffers per GPU from TE's initialize_ub, outside the caching
allocator) are in what a GPU needs but not in the allocated peak; the sequence-parallel gathers of
linear_qkv / linear_fc1 fill them instead of fresh tensors; refusals name the flag."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from test_cli_errors import cli, one_error

from capture_megatron.config import Kernels
from capture_megatron.features.tp_overlap import UB_LAYERS, userbuffer_bytes_per_token
from capture_megatron.records import Probe, ProbeShape, Variant


def test_userbuffers_are_twelve_full_buffers_fp8_for_the_all_gathers():
    assert len(UB_LAYERS) == len(set(UB_LAYERS)) == 12
    assert userbuffer_bytes_per_token(4096, gathered_bytes=2) == 12 * 4096 * 2
    assert userbuffer_bytes_per_token(4096, gathered_bytes=1) == 8 * 4096 + 4 * 4096 * 2
    assert Kernels().userbuffer_bytes_per_token(4096) == 0
    assert Kernels(tp_comm_overlap=True).key().endswith("/tp-comm-overlap")


@pytest.mark.slow
def test_gathers_fill_userbuffers_instead_of_fresh_tensors():
    """One Llama layer at TP 2 + SP: the forward and backward gathers of linear_qkv and
    linear_fc1 (four [s x b, h] bf16 tensors) are no longer allocated; nothing else changes."""
    from capture_megatron.profile.session import run_probes

    variant = Variant("bf16", "selective", True, True, "RMSNorm", "rope", False, False, True)
    b, s, h = 2, 128, 128
    shape = ProbeShape(b, s, h, 4, 4, 32, 256, 256, 2)
    allocated = []
    for kernels in (Kernels(), Kernels(tp_comm_overlap=True)):
        (rec,) = run_probes([Probe(variant, shape, "middle", 1)], "fake-cuda", kernels, False, True)
        lines = [rec.timeline("forward"), rec.timeline("backward")]
        allocated.append(
            Counter((op, n) for t in lines for op, n in zip(t.ops, t.nbytes) if op[0] == "+")
        )
        assert rec.saved_bytes == 492548  # the same for both: userbuffers change no saved tensor
    assert allocated[0] - allocated[1] == Counter({("+empty.memory_format", 2 * s * b * h): 4})
    assert not allocated[1] - allocated[0]


SMALL = (
    "--num-layers 2 --hidden-size 128 --ffn-hidden-size 256 --num-attention-heads 4 "
    "--seq-length 128 --max-position-embeddings 128 --vocab-size 256 --micro-batch-size 2 "
    "--global-batch-size 4 --bf16 --swiglu --disable-bias-linear --no-progress --gpus 2"
).split()


@pytest.mark.slow
def test_predict_adds_the_userbuffers_to_what_a_gpu_needs(tmp_path):
    out = {}
    for name, extra in (("plain", []), ("overlap", ["--tp-comm-overlap"])):
        argv = ["predict", *SMALL, "--tensor-model-parallel-size", "2", "--sequence-parallel"]
        path = tmp_path / f"{name}.json"
        done = cli([*argv, *extra, "--json", str(path)], str(tmp_path))
        assert done.returncode == 0, done.stderr[-2000:]
        out[name] = json.loads(path.read_text())
    ub = 12 * 128 * 2 * (128 * 2)  # 12 buffers of [seq x micro-batch, hidden] bf16
    plain, overlap = out["plain"], out["overlap"]
    assert overlap["predicted_peak_bytes"][0] <= plain["predicted_peak_bytes"][0]
    extra = overlap["needed_bytes_per_gpu"] - plain["needed_bytes_per_gpu"]
    reserve = 0.02 * (overlap["predicted_peak_bytes"][0] - plain["predicted_peak_bytes"][0])
    assert extra == pytest.approx(ub + reserve, abs=2)
    assert "--tp-comm-overlap" in overlap["megatron_args"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--device", "cpu", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
         "only the GPU kernel set models"),
        (["--tensor-model-parallel-size", "1"], "needs --sequence-parallel with"),
        # Megatron-LM stops here too: the refusal names the change (issue 51)
        (["--tensor-model-parallel-size", "1"], "leave out --tp-comm-overlap, or give "
         "--tensor-model-parallel-size > 1 with --sequence-parallel"),
        (["--tensor-model-parallel-size", "2"], "needs --sequence-parallel with"),
        (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--tp-comm-overlap-cfg",
          "ub.yaml"], "--tp-comm-overlap-cfg ub.yaml"),
    ],
)  # fmt: skip
def test_refusals_are_one_paragraph(extra, message, tmp_path):
    done = cli(["predict", *SMALL, "--tp-comm-overlap", *extra], str(tmp_path))
    assert message in one_error(done, "predict")
