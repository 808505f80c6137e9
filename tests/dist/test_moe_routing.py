"""The routing-statistics recorder (`pretrain_gpt --moe-routing-stats`,
capture_megatron.train.routing) on real megatron-core MoE training: torchrun, gloo, EP 2 with the
alltoall dispatcher, aux-loss balancing. What the routers decide, counted per sequence, must add up
to the tokens megatron-core's token dispatcher delivers to each rank's experts -- the identity
bench/moe_routing.py relies on to derive any expert-parallel size's imbalance from per-sequence
counts."""

from __future__ import annotations

import numpy as np
from harness import TINY, train

from capture_megatron.train.routing import read_routing_stats

EXPERTS, TOPK, ITERS = 4, 2, 3
MOE = [
    "--num-experts",
    str(EXPERTS),
    "--moe-router-topk",
    str(TOPK),
    "--moe-aux-loss-coeff",
    "1e-2",
    "--moe-token-dispatcher-type",
    "alltoall",
    "--disable-bias-linear",
    "--expert-model-parallel-size",
    "2",
]


def test_router_counts_add_up_to_what_each_rank_receives(tmp_path):
    path = tmp_path / "routing.json.gz"
    args = [*TINY, *MOE, "--mock-data", "--train-iters", str(ITERS)]
    run = train(2, [*args, "--moe-routing-stats", str(path)], str(tmp_path), "ep2")
    assert run.returncode == 0, run.output[-4000:]
    data = read_routing_stats(str(path))
    ranks = sorted(data["ranks"], key=lambda r: r["ep_rank"])
    assert [r["ep_rank"] for r in ranks] == [0, 1]
    seq, mbs, gbs = 32, 2, 16  # TINY's sequence, micro-batch and global batch
    layers = [str(n) for n in ranks[0]["layers"]]
    assert layers == [str(n) for n in range(1, 9)]  # every one of TINY's 8 layers is an MoE layer
    local = EXPERTS // 2
    for step in range(ITERS):
        for layer in layers:
            per_seq = [np.array(r["steps"][step][layer]["sequences"]) for r in ranks]
            for counts in per_seq:  # each DP rank's sequences, every token routed TOPK times
                assert counts.shape == (gbs // 2, EXPERTS)
                assert (counts.sum(axis=1) == seq * TOPK).all()
            routed = sum(c.sum(axis=0) for c in per_seq)  # the EP group's tokens per expert
            for r in ranks:
                received = np.array(r["steps"][step][layer]["received"])
                assert received.shape == (gbs // (2 * mbs), local)  # one row per micro-batch
                mine = routed[r["ep_rank"] * local : (r["ep_rank"] + 1) * local]
                assert (received.sum(axis=0) == mine).all(), (step, layer, r["ep_rank"])
    assert len(data["iterations"]) == ITERS and data["shape"]["moe"]["num_experts"] == EXPERTS
