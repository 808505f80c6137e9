"""What each pipeline stage's micro-batch holds on a GPU (megatron/gpu_batch.py): the trainer's
copy of its data (on_device) and the probe's synthetic one (megatron_lm_batch) are
Megatron-LM's get_batch, tensor for tensor, so what the probes measured is what training holds.
Run here with device "cpu" (the copy is the same .to(device) call)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from capture_megatron.config import ModelShape
from capture_megatron.config.training import DataOptions
from capture_megatron.megatron.gpu_batch import megatron_lm_batch, on_device, stage_keys
from capture_megatron.train.data import build_train_iterators

SHAPE = ModelShape(
    num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=257,
    add_bias_linear=False,
)  # fmt: skip
MBS = 2
ENDS = [(True, False), (False, True), (True, True), (False, False)]


def _host_batches(n: int = 2):
    (it,) = build_train_iterators(DataOptions(mock_data=True), 32, MBS, 2 * MBS, n, 0, 1, 7, 0, 1)
    return it


def test_stage_keys_follow_get_batch_on_this_tp_rank():
    assert stage_keys(SHAPE, True, False) == ("tokens", "position_ids")
    assert stage_keys(SHAPE, False, True) == ("labels", "loss_mask")
    assert stage_keys(SHAPE, False, False) == ()
    mtp = dataclasses.replace(SHAPE, mtp_num_layers=1)  # MTP embeds tokens on the last stage
    assert stage_keys(mtp, False, True) == ("tokens", "position_ids", "labels", "loss_mask")


@pytest.mark.parametrize("ends", ENDS)
@pytest.mark.parametrize("mask", [True, False])
def test_training_batch_is_the_probe_batch_tensor_for_tensor(ends, mask):
    host = list(_host_batches())
    got = list(on_device(iter(host), SHAPE, ends, mask, device="cpu"))
    probe = megatron_lm_batch(SHAPE, MBS, *ends, mask, "cpu")
    assert len(got) == len(host)
    for batch, source in zip(got, host):
        assert list(batch) == list(probe)  # the same tensors, allocated in the same order
        for key, tensor in batch.items():
            assert (tensor.shape, tensor.dtype) == (probe[key].shape, probe[key].dtype), key
            if key != "attention_mask":
                assert torch.equal(tensor, source[key])  # the data itself, copied
    if mask and any(ends):
        causal = got[0]["attention_mask"][0, 0]
        assert causal[0, 1] and not causal[1, 0]  # True above the diagonal: masked


def test_a_middle_stage_reads_nothing_and_keeps_the_iterator_in_step():
    host = list(_host_batches(3))
    got = list(on_device(iter(host), SHAPE, (False, False), True, device="cpu"))
    assert got == [{}] * len(host)
