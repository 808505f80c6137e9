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

from functools import partial

import torch

from capture_megatron.config import ModelShape
from capture_megatron.megatron.training import batch_on_this_cp_rank, loss_func


def megatron_lm_batch(
    shape: ModelShape, b: int, first: bool, last: bool, mask: bool, device: str
) -> dict:
    """One micro-batch for a chunk holding the first and / or last stage's ends."""
    s = shape.seq_length
    batch: dict = {}
    if first or (last and shape.mtp_num_layers):  # MTP embeds the shifted tokens on the last stage
        batch["tokens"] = torch.randint(0, shape.vocab_size, (b, s), device=device)
        batch["position_ids"] = torch.arange(s, device=device).expand(b, s).contiguous()
    if last:
        batch["labels"] = torch.randint(0, shape.vocab_size, (b, s), device=device)
        batch["loss_mask"] = torch.ones(b, s, device=device)
    if mask and (first or last):
        batch["attention_mask"] = torch.ones((b, 1, s, s), dtype=torch.bool, device=device).triu(1)
    return batch


def megatron_lm_forward_step(data_iterator, model):
    """pretrain_gpt.py's forward_step on a megatron_lm_batch (this CP rank's part)."""
    batch = batch_on_this_cp_rank(next(data_iterator))
    output = model(
        batch.get("tokens"),
        batch.get("position_ids"),
        batch.get("attention_mask"),
        labels=batch.get("labels"),
    )
    # only the last stage's batch has a loss mask, and only the last stage calls the loss function
    return output, partial(loss_func, batch.get("loss_mask"))  # type: ignore[arg-type]
