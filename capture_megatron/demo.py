"""`capture-megatron demo` (make demo): the main job on an embedded default, end to end on this CPU.

1. Turns Python standard-library docstrings into a Megatron indexed dataset (byte tokenizer).
2. Plans a small GPT for 4 CPU ranks with PP 4: profiles it on the spot, finds the memory-balanced
   --pipeline-model-parallel-layout, and predicts every rank's peak for it and for Megatron's uniform
   split.
3. Trains the balanced plan a few dozen iterations (real torchrun, gloo, megatron-core), and the
   uniform split a few, each with --memory-report.
4. Prints predicted vs measured peak per rank for both: the balanced worst rank is lower.
"""
from __future__ import annotations

import argparse
import os
import time

from capture_megatron.errors import CaptureError

MODEL = ["--num-layers", "12", "--hidden-size", "96", "--num-attention-heads", "4", "--seq-length", "256",
         "--max-position-embeddings", "256", "--vocab-size", "512", "--micro-batch-size", "2",
         "--global-batch-size", "16", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
PLAN = ["--gpus", "4", "--device", "cpu", "--pipeline-model-parallel-size", "4", "--tensor-model-parallel-size", "1",
        "--recompute-granularity", "none", "--num-virtual-stages-per-pipeline-rank", "1"]


def _dataset(workdir: str) -> str:
    from capture_megatron.data.corpus import stdlib_corpus
    from capture_megatron.data.preprocess import main as preprocess

    prefix = os.path.join(workdir, "stdlib")
    if not os.path.exists(prefix + "_text_document.idx"):
        jsonl = os.path.join(workdir, "stdlib.jsonl")
        stdlib_corpus(jsonl, max_bytes=600_000)
        if preprocess(["--input", jsonl, "--output-prefix", prefix, "--tokenizer-type", "ByteTokenizer"]) != 0:
            raise CaptureError("preprocessing the demo corpus failed")
    return prefix + "_text_document"


def _train(args: list[str], iters: int, report: str) -> "MemoryReport":  # noqa: F821
    from capture_megatron.launcher import run_torchrun
    from capture_megatron.train.report import MemoryReport

    rc = run_torchrun(4, [*args, "--train-iters", str(iters), "--log-interval", "5", "--no-progress",
                          "--memory-report", report])
    if rc != 0:
        raise CaptureError(f"demo training failed (torchrun exit code {rc})")
    return MemoryReport.read(report)


def _compare(plan_out: dict, balanced, uniform) -> None:
    mib = 2 ** 20
    uni_pred = plan_out["baselines"]["uniform"]["predicted_peak_bytes"]
    print(f"\npeak memory per pipeline rank (MiB)      balanced {plan_out['plan']['layout']:<18} uniform "
          f"{uniform.plan.layout}")
    print(f"  {'rank':>4} {'predicted':>10} {'measured':>10} {'error':>7}   {'predicted':>10} {'measured':>10} {'error':>7}")
    bal_meas, uni_meas = balanced.stage_peaks(), uniform.stage_peaks()
    for r in range(len(bal_meas)):
        bp, bm, up, um = plan_out["predicted_peak_bytes"][r], bal_meas[r], uni_pred[r], uni_meas[r]
        print(f"  {r:4d} {bp / mib:10.2f} {bm / mib:10.2f} {100 * (bp - bm) / bm:+6.2f}%   {up / mib:10.2f} "
              f"{um / mib:10.2f} {100 * (up - um) / um:+6.2f}%")
    gain = 1 - max(bal_meas) / max(uni_meas)
    print(f"worst rank: balanced {max(bal_meas) / mib:.2f} MiB vs uniform {max(uni_meas) / mib:.2f} MiB "
          f"-> {100 * gain:.1f}% lower peak with the same model, batch and data")


def main(argv: list[str]) -> int:
    """Entry point."""
    from capture_megatron.plan_cli import build_parser, cluster_of, resolve_shape, resolve_space
    from capture_megatron.plan_run import plan_outputs

    p = argparse.ArgumentParser(prog="capture-megatron demo", description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default=os.path.join("runs", "demo"))
    p.add_argument("--iters", type=int, default=24)
    ns = p.parse_args(argv)
    os.makedirs(ns.workdir, exist_ok=True)
    start = time.perf_counter()
    data = ["--data-path", _dataset(ns.workdir)]
    plan_argv = [*MODEL, *PLAN, "--png", os.path.join(ns.workdir, "plan.png"), "--no-progress"]
    pns = build_parser().parse_args(plan_argv)
    shape = resolve_shape(pns, plan_argv)
    out = plan_outputs(pns, shape, cluster_of(pns), resolve_space(pns, shape))
    balanced = _train([*out["model_args"], *out["megatron_args"], *data], ns.iters,
                      os.path.join(ns.workdir, "balanced.json"))
    uniform_args = [a for a in out["megatron_args"]]
    at = uniform_args.index("--pipeline-model-parallel-layout")
    del uniform_args[at:at + 2]
    uniform = _train([*out["model_args"], *uniform_args, *data], 3, os.path.join(ns.workdir, "uniform.json"))
    _compare(out, balanced, uniform)
    print(f"plan breakdown plot: {os.path.join(ns.workdir, 'plan.png')}; demo took {time.perf_counter() - start:.0f} s")
    return 0
