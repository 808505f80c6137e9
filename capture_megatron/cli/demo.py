"""`capture-megatron demo` (make demo): the main job on an embedded default, end to end on this CPU.

1. Turns Python standard-library docstrings into a Megatron indexed dataset (byte tokenizer).
2. Plans a small GPT for 4 CPU ranks with PP 4: profiles it on the spot, finds the memory-balanced
   --pipeline-model-parallel-layout, and predicts every rank's peak for it and for Megatron's
   uniform split.
3. Trains the balanced plan a few dozen iterations (real torchrun, gloo, megatron-core), and the
   uniform split a few, each with --memory-report.
4. Prints predicted vs measured peak per rank for both: the balanced worst rank is lower.
"""

from __future__ import annotations

import os
import time

import psutil

from capture_megatron.cli.render import MIB, save_plan_png
from capture_megatron.config import GIB, Cluster, ModelShape
from capture_megatron.errors import CaptureError
from capture_megatron.flags.parser import HelpParser, summary
from capture_megatron.planner import PlanOptions, PlanResult, Space, model_args, plan, plan_args
from capture_megatron.serial import writable_dir
from capture_megatron.train.report import MemoryReport

MODEL = ModelShape(
    num_layers=12,
    hidden_size=96,
    num_attention_heads=4,
    seq_length=256,
    max_position_embeddings=256,
    vocab_size=512,
    hidden_dropout=0.1,
    attention_dropout=0.1,
)
"""The demo's GPT: 12 layers, h 96, 4 heads, sequence 256, fp32, dropout on."""
OPTIONS = PlanOptions(
    objective="min-peak",
    space=Space(tp=(1,), pp=(4,), vpp=(1,), micro_batch_size=(2,), recompute=("none",)),
    global_batch_size=16,
)
"""4 pipeline stages, no TP / interleaving / recompute, micro-batch 2, global batch 16; the
lowest-peak plan (the demo shows the memory-balanced layout against Megatron's uniform split)."""
RANKS = 4
"""CPU processes (pipeline stages)."""


def _dataset(workdir: str) -> str:
    from capture_megatron.data.corpus import stdlib_corpus
    from capture_megatron.data.preprocess import preprocess
    from capture_megatron.data.tokenizers import TokenizerOptions

    prefix = os.path.join(workdir, "stdlib")
    if not os.path.exists(prefix + "_text_document.idx"):
        jsonl = os.path.join(workdir, "stdlib.jsonl")
        stdlib_corpus(jsonl, max_bytes=600_000)
        preprocess(jsonl, prefix, TokenizerOptions(), append_eod=True)
    return prefix + "_text_document"


def _train(args: list[str], iters: int, report: str) -> MemoryReport:
    from capture_megatron.train.launch import run_torchrun

    rc = run_torchrun(
        RANKS,
        [
            *args,
            "--train-iters",
            str(iters),
            "--log-interval",
            "5",
            "--no-progress",
            "--memory-report",
            report,
        ],
    )
    if rc != 0:
        raise CaptureError(f"demo training failed (torchrun exit code {rc})")
    return MemoryReport.read(report)


def _compare(result: PlanResult, balanced: MemoryReport, uniform: MemoryReport) -> None:
    uniform_split = result.baseline("uniform").partition
    assert uniform_split is not None  # 12 layers split evenly over 4 stages
    uni_pred = [int(x) for x in uniform_split.rank_peaks]
    print(
        f"\npeak memory per pipeline rank (MiB)      balanced {result.best.plan.layout:<18} "
        f"uniform {uniform.plan.layout}"
    )
    print(
        f"  {'rank':>4} {'predicted':>10} {'measured':>10} {'error':>7}   "
        f"{'predicted':>10} {'measured':>10} {'error':>7}"
    )
    bal_meas, uni_meas = balanced.stage_peaks(), uniform.stage_peaks()
    for r in range(len(bal_meas)):
        bp, bm, up, um = result.best.rank_peaks[r], bal_meas[r], uni_pred[r], uni_meas[r]
        print(
            f"  {r:4d} {bp / MIB:10.2f} {bm / MIB:10.2f} {100 * (bp - bm) / bm:+6.2f}%   "
            f"{up / MIB:10.2f} {um / MIB:10.2f} {100 * (up - um) / um:+6.2f}%"
        )
    gain = 1 - max(bal_meas) / max(uni_meas)
    print(
        f"worst rank: balanced {max(bal_meas) / MIB:.2f} MiB vs uniform "
        f"{max(uni_meas) / MIB:.2f} MiB -> {100 * gain:.1f}% lower peak with the same model, "
        "batch and data"
    )


def main(argv: list[str]) -> int:
    """Entry point."""
    from capture_megatron.cli.render import print_plan
    from capture_megatron.profile import memory_source

    p = HelpParser(prog="capture-megatron demo", description=summary(__doc__), example="--iters 24")
    p.add_argument(
        "--workdir", default=os.path.join("runs", "demo"), help="dataset, reports and plot"
    )
    p.add_argument("--iters", type=int, default=24, help="iterations of the balanced run")
    ns = p.parse_args(argv)
    writable_dir("--workdir", ns.workdir)  # before the dataset is built
    start = time.perf_counter()
    data = ["--data-path", _dataset(ns.workdir)]
    cluster = Cluster(
        gpus=RANKS, gpu_memory_bytes=int(psutil.virtual_memory().total / GIB * GIB), device="cpu"
    )
    result = plan(MODEL, cluster, OPTIONS, memory_source(MODEL, "cpu", progress=False))
    print_plan(result)
    save_plan_png(result, os.path.join(ns.workdir, "plan.png"))
    balanced = _train(
        [*model_args(MODEL), *plan_args(result.best.plan), *data],
        ns.iters,
        os.path.join(ns.workdir, "balanced.json"),
    )
    uniform_args = plan_args(result.best.plan)  # without the layout: Megatron's even split
    at = uniform_args.index("--pipeline-model-parallel-layout")
    del uniform_args[at : at + 2]
    uniform = _train(
        [*model_args(MODEL), *uniform_args, *data], 3, os.path.join(ns.workdir, "uniform.json")
    )
    _compare(result, balanced, uniform)
    print(
        f"plan breakdown plot: {os.path.join(ns.workdir, 'plan.png')}; "
        f"demo took {time.perf_counter() - start:.0f} s"
    )
    return 0
