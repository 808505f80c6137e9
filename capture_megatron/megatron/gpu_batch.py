"""A micro-batch as Megatron-LM's pretrain_gpt.py hands it to the model on a GPU.

get_batch (pretrain_gpt.py) -> get_batch_on_this_tp_rank (megatron/training/utils.py): the first
pipeline stage receives tokens, position_ids and the attention mask; the last stage labels,
loss_mask and the attention mask (and tokens and position_ids with multi-token prediction, whose
layers embed the shifted tokens there: get_batch_on_this_tp_rank's mtp_on_this_rank); other stages
nothing. The mask is GPTDataset's bool
[b, 1, s, s] (megatron/core/datasets/gpt_dataset.py), present unless
--no-create-attention-mask-in-dataloader. forward_step passes them to the model as
model(tokens, position_ids, attention_mask, labels=labels), after get_batch_on_this_cp_rank has
cut this context-parallel rank's part (its 2 of the 2 x cp sequence chunks, the mask's query rows
included).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from capture_megatron.config import ModelShape
from capture_megatron.megatron.training import Batch


def stage_keys(shape: ModelShape, first: bool, last: bool) -> tuple[str, ...]:
    """The data tensors get_batch_on_this_tp_rank hands a stage holding the first and / or last
    stage's ends (the attention mask apart)."""
    keys: tuple[str, ...] = ()
    if first or (last and shape.mtp_num_layers):  # MTP embeds the shifted tokens on the last stage
        keys += ("tokens", "position_ids")
    if last:
        keys += ("labels", "loss_mask")
    return keys


def causal_mask(b: int, s: int, device: str | torch.device) -> torch.Tensor:
    """GPTDataset's bool attention mask, True above the diagonal (masked), [b, 1, s, s]."""
    return torch.ones((b, 1, s, s), dtype=torch.bool, device=device).triu(1)


def megatron_lm_batch(
    shape: ModelShape, b: int, first: bool, last: bool, mask: bool, device: str
) -> Batch:
    """One synthetic micro-batch for a probe chunk holding the first and / or last stage's ends."""
    s = shape.seq_length
    make = {
        "tokens": lambda: torch.randint(0, shape.vocab_size, (b, s), device=device),
        "position_ids": lambda: torch.arange(s, device=device).expand(b, s).contiguous(),
        "labels": lambda: torch.randint(0, shape.vocab_size, (b, s), device=device),
        "loss_mask": lambda: torch.ones(b, s, device=device),
    }
    batch = {key: make[key]() for key in stage_keys(shape, first, last)}
    if mask and (first or last):
        batch["attention_mask"] = causal_mask(b, s, device)
    return batch


def on_device(
    batches: Iterator[Batch],
    shape: ModelShape,
    ends: tuple[bool, bool],
    mask: bool,
    device: str = "cuda",
) -> Iterator[Batch]:
    """A training chunk's host micro-batches as get_batch hands them to its stage on this rank's
    GPU, for a chunk holding the (first, last) stage's `ends`: the stage's tensors copied
    (.cuda(non_blocking=True), as get_batch_on_this_tp_rank does) and GPTDataset's attention mask
    unless --no-create-attention-mask-in-dataloader. A stage between the ends reads nothing
    (get_batch returns None there) and gets an empty batch."""
    first, last = ends
    keys = stage_keys(shape, first, last)
    for batch in batches:
        if not (first or last):
            yield {}
            continue
        out = {key: batch[key].to(device, non_blocking=True) for key in keys}
        if mask:
            b, s = batch["tokens"].shape
            out["attention_mask"] = causal_mask(b, s, device)
        yield out
