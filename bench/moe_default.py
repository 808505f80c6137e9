"""Benchmark: the default dropless MoE forecast of published MoE setups, the worst case beside it.

- Mixtral 8x7B: Megatron-LM's examples/mixtral/train_mixtral_8x7b_distributed.sh (core_v0.16.1),
  its MODEL_ARGS, MOE_ARGS, TRAINING_ARGS and MODEL_PARALLEL_ARGS as the script passes them
  (--vocab-size 32000 for its Llama-2 tokenizer file) at NVIDIA's recommended TP1 PP4 EP8 on 32 x
  80 GiB: `predict`, then `plan` with TP, PP and EP left to the search -- at the default forecast
  and at the old default (the worst case, --moe-imbalance-factor 4).
- Qwen3-235B-A22B: its published config.json as Megatron flags at Megatron-Bridge's H100
  pre-training recipe (qwen3_235b_a22b_pretrain_256gpu_h100_bf16_config: TP4 PP16 CP2 EP8, SP,
  micro-batch 1, sequence 4096, embedding and loss counted in the pipeline split) on 256 x 80 GiB.

Flags a line holds that this version refuses are left out and listed (e.g. --qk-layernorm, not
modelled yet). Writes bench/results/moe_default.json (rendered by bench/report.py).

    python bench/moe_default.py [--device fake] [--only NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

import capture_megatron
from capture_megatron.config import GIB
from capture_megatron.errors import CaptureError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIXTRAL = """
--use-mcore-models --disable-bias-linear --seq-length 4096 --max-position-embeddings 32768
--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
--init-method-std 0.01 --attention-dropout 0.0 --hidden-dropout 0.0 --normalization RMSNorm
--position-embedding-type rope --swiglu --untie-embeddings-and-output-weights
--group-query-attention --num-query-groups 8 --no-masked-softmax-fusion --no-position-embedding
--rotary-base 1000000
--num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss
--moe-aux-loss-coeff 1e-2 --moe-grouped-gemm --moe-token-dispatcher-type alltoall
--overlap-param-gather --overlap-grad-reduce
--micro-batch-size 1 --global-batch-size 256 --lr 1e-4 --train-iters 500000
--lr-decay-iters 320000 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 0.1
--lr-warmup-iters 500 --clip-grad 1.0 --bf16
--vocab-size 32000
""".split()
"""Megatron-LM's Mixtral 8x7B script (core_v0.16.1) without its data, logging and parallel args."""
MIXTRAL_SIZES = (
    "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 "
    "--expert-model-parallel-size 8 --use-distributed-optimizer --sequence-parallel"
).split()
"""The script's MODEL_PARALLEL_ARGS: NVIDIA's recommended TP1 PP4 EP8."""
QWEN3_235B = """
--num-layers 94 --hidden-size 4096 --ffn-hidden-size 12288 --num-attention-heads 64
--group-query-attention --num-query-groups 4 --kv-channels 128 --qk-layernorm
--num-experts 128 --moe-router-topk 8 --moe-ffn-hidden-size 1536 --moe-aux-loss-coeff 1e-3
--moe-router-load-balancing-type aux_loss --moe-grouped-gemm --moe-token-dispatcher-type alltoall
--moe-permute-fusion
--seq-length 4096 --max-position-embeddings 40960 --vocab-size 151936 --swiglu
--normalization RMSNorm --position-embedding-type rope --rotary-base 1000000
--disable-bias-linear --untie-embeddings-and-output-weights --bf16
--micro-batch-size 1 --global-batch-size 1024
--tensor-model-parallel-size 4 --pipeline-model-parallel-size 16 --context-parallel-size 2
--expert-model-parallel-size 8 --expert-tensor-parallel-size 1 --sequence-parallel
--use-distributed-optimizer --account-for-embedding-in-pipeline-split
--account-for-loss-in-pipeline-split
""".split()
"""Qwen/Qwen3-235B-A22B's config.json (router_aux_loss_coef 0.001) at Megatron-Bridge's recipe."""
PARALLEL = (
    "--tensor-model-parallel-size",
    "--pipeline-model-parallel-size",
    "--expert-model-parallel-size",
)


def _run(argv: list[str], gpus: int, device: str, fixed: bool) -> tuple[Any, list[str]]:
    """(PlanResult, flags left out) of predict (`fixed`) or plan, leaving out refused flags."""
    dropped: list[str] = []
    while True:
        args = [*argv, "--gpus", str(gpus), "--gpu-memory-gib", "80", "--no-progress"]
        args += ["--device", device] if device else []
        try:
            run = capture_megatron.predict if fixed else capture_megatron.plan
            return run(args), dropped
        except CaptureError as err:
            text = str(err)
            refused = [
                a
                for a in argv
                if a.startswith("--") and re.search(re.escape(a) + r"(?![\w-])", text)
            ]
            if "not modelled" not in text or not refused:
                raise
            flag = max(refused, key=len)
            at = argv.index(flag)
            takes = at + 1 < len(argv) and not argv[at + 1].startswith("--")
            dropped.append(" ".join(argv[at : at + 1 + takes]))
            argv = argv[:at] + argv[at + 1 + takes :]


def _attempt(argv: list[str], gpus: int, device: str, fixed: bool) -> tuple[Any, list[str]]:
    """_run, and without CP when the GPU kernel set cannot profile CP with RoPE yet."""
    try:
        return _run(argv, gpus, device, fixed)
    except CaptureError as err:
        if "--context-parallel-size" not in argv or "profiling worker failed" not in str(err):
            raise
        at = argv.index("--context-parallel-size")
        result, dropped = _run(argv[:at] + argv[at + 2 :], gpus, device, fixed)
        why = "this version cannot profile CP with RoPE on the GPU kernel set"
        return result, [*dropped, f"--context-parallel-size {argv[at + 1]} ({why})"]


def _row(name: str, result, dropped: list[str]) -> dict[str, Any]:
    best, routing = result.best, result.routing
    p = best.plan
    return {
        "model": name,
        "sizes": f"TP {p.tp} PP {p.pp} DP {p.dp} CP {p.cp} EP {p.ep} VPP {p.vpp}",
        "ep": p.ep,
        "recompute": p.recompute.granularity,
        "layout": p.layout,
        "forecast_gib": max(best.rank_peaks) / GIB,
        "needed_gib": best.needed / GIB,
        "fits": best.fits,
        "factors": [routing.factors.forecast, routing.factors.planning, routing.factors.bound],
        "source": routing.factors.source,
        "planning_gib": max(routing.planning_peaks) / GIB,
        "bound_gib": max(routing.bound_peaks) / GIB,
        "bound_needed_gib": routing.bound_needed / GIB,
        "bound_fits": routing.bound_fits,
        "left_out": dropped,
    }


def main() -> None:
    """Predict and plan the setups; write the results."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--device", default="", help="memory model device (default: the planner's)")
    ap.add_argument("--only", default="", help="run the setups whose name has this; keep the rest")
    ns = ap.parse_args()
    out = os.path.join(ROOT, "bench/results/moe_default.json")
    kept: dict[str, dict] = {}
    if ns.only:
        with open(out) as f:
            kept = {r["model"]: r for r in json.load(f)["rows"]}
    rows = []
    steps = (
        ("Mixtral 8x7B, predict", MIXTRAL + MIXTRAL_SIZES, 32, True),
        ("Mixtral 8x7B, plan", MIXTRAL + ["--use-distributed-optimizer"], 32, False),
        (
            "Mixtral 8x7B, plan at the worst case",
            MIXTRAL + ["--use-distributed-optimizer", "--moe-imbalance-factor", "4"],
            32,
            False,
        ),
        (
            "Mixtral 8x7B, plan at TP 1 PP 4 (EP searched)",
            MIXTRAL + MIXTRAL_SIZES[:4] + ["--use-distributed-optimizer"],
            32,
            False,
        ),
        (
            "Mixtral 8x7B, plan at TP 1 PP 4 (EP searched) at the worst case",
            MIXTRAL
            + MIXTRAL_SIZES[:4]
            + ["--use-distributed-optimizer"]
            + ["--moe-imbalance-factor", "4"],
            32,
            False,
        ),
        ("Qwen3-235B-A22B, predict", QWEN3_235B, 256, True),
    )
    for name, argv, gpus, fixed in steps:
        if ns.only and ns.only not in name and name in kept:
            rows.append(kept[name])
            continue
        print(f"{name} ...", file=sys.stderr, flush=True)
        try:
            result, dropped = _attempt(argv, gpus, ns.device, fixed)
        except CaptureError as err:  # e.g. no plan fits
            rows.append({"model": name, "gpus": gpus, "predict": fixed, "error": str(err)})
            print(f"  {err}", file=sys.stderr)
            continue
        rows.append({**_row(name, result, dropped), "gpus": gpus, "predict": fixed})
        r = rows[-1]
        print(
            f"  {r['sizes']}: forecast {r['forecast_gib']:.1f} GiB (factor {r['factors'][0]:g}), "
            f"planning {r['planning_gib']:.1f}, bound {r['bound_gib']:.1f} GiB; fits {r['fits']}",
            file=sys.stderr,
        )
    with open(out, "w") as f:
        json.dump({"device": ns.device or "default", "rows": rows}, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
