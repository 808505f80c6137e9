"""The live-storage tracker is exact: hand-computable programs, and a real megatron layer whose
forward adds exactly what autograd saves (counted independently with saved_tensors_hooks) plus its
output."""

from __future__ import annotations

import gc

import torch

from capture_megatron.memory.live import LiveTensorTracker


def test_views_inplace_out_and_frees():
    with LiveTensorTracker() as t:
        a = torch.zeros(1000)  # +4000
        b = a * 2  # +4000
        c = b.view(10, 100)  # view: +0
        b.add_(1)  # in place: +0
        d = torch.empty(0)
        torch.add(a, b, out=d)  # out= grows d to 4000
        assert t.current_bytes == 12000
        del b, c
        gc.collect()
        assert t.current_bytes == 8000
        t.reset_peak()
        e = torch.ones(500)  # +2000
        del e
        assert t.peak_bytes == 10000 and t.current_bytes == 8000
        del a, d


def test_backward_is_seen():
    with LiveTensorTracker() as t:
        x = torch.randn(100, 100, requires_grad=True)
        before = t.current_bytes
        (x * x).sum().backward()
        assert (
            t.current_bytes - before == 40000
        )  # x.grad only; the product and its saved x are gone


def test_megatron_layer_forward_equals_saved_tensors_plus_output():
    from capture_megatron.emulate import cpu_compat
    from capture_megatron.profile.groups import fake_job
    from capture_megatron.profile.iteration import hidden_input as _hidden
    from capture_megatron.profile.probe import build
    from capture_megatron.profile.setup import Setup
    from capture_megatron.records import Probe, ProbeShape, Variant

    cpu_compat.apply("cpu")
    variant = Variant(
        dtype="fp32",
        recompute="none",
        sequence_parallel=False,
        swiglu=True,
        normalization="RMSNorm",
        position_embedding_type="rope",
        add_bias_linear=False,
        dropout=True,
        untied=True,
    )
    with LiveTensorTracker() as tracker, fake_job(1, 1):
        chunk = build(
            Probe(variant, ProbeShape(2, 32, 64, 4, 2, 16, 128, 128, 1), "middle", 1),
            Setup("cpu", None, "cpu", ("", "", "")),
        )
        layer = chunk.model.module.decoder.layers[0]
        out = x = None
        for _ in range(2):  # the second pass: cached masks / RoPE tables already exist
            del out, x  # drop the first pass's graph before measuring the second
            gc.collect()
            x = _hidden(chunk.shape, chunk.plan, "cpu").requires_grad_()
            saved = {}
            params = {p.untyped_storage()._cdata for p in chunk.model.parameters()} | {
                x.untyped_storage()._cdata
            }

            def pack(t, params=params, saved=saved):
                st = t.untyped_storage()
                if st._cdata not in params:
                    saved[st._cdata] = st.nbytes()
                return t

            before = tracker.current_bytes
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out, _ = layer(
                    x, attention_mask=None, rotary_pos_emb=chunk.model.module.rotary_pos_emb(32)
                )
            grown = tracker.current_bytes - before
            independent = sum(saved.values()) + (
                0 if out.untyped_storage()._cdata in saved else out.nbytes
            )
        assert grown == independent and independent > 100_000
