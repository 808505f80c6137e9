"""`pretrain_gpt --moe-routing-stats` is checked before any process starts: it needs experts, and
full recompute (which runs every router twice per micro-batch) is refused with the reason."""

from __future__ import annotations

import pytest

from capture_megatron.errors import CaptureError
from capture_megatron.train.entry import parse_config

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --vocab-size 256 --micro-batch-size 1 --global-batch-size 2 "
    "--mock-data --moe-routing-stats r.json"
).split()
MOE = "--num-experts 4 --moe-router-topk 2 --disable-bias-linear".split()


def test_routing_stats_flag_is_read():
    cfg = parse_config([*BASE, *MOE], 2)
    assert cfg.run.moe_routing_stats == "r.json"


def test_routing_stats_need_experts():
    with pytest.raises(CaptureError, match="needs a model with experts"):
        parse_config(BASE, 2)


def test_routing_stats_refuse_full_recompute():
    full = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
    with pytest.raises(CaptureError, match="count its tokens twice"):
        parse_config([*BASE, *MOE, *full.split()], 2)
