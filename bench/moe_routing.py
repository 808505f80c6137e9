"""Benchmark: routing imbalance of aux-loss-balanced MoE training, measured on the CPU; writes the
statistics the default MoE forecast uses (capture_megatron/forecast/moe_routing.json) and the
table of docs/BENCHMARKS.md (bench/results/moe_routing.json).

Each run trains a small GPT with real megatron-core MoE layers under capture-megatron's trainer
(build_trainer, megatron-core's schedule and optimizer, the real-text corpus of `make demo`:
Python standard-library docstrings, byte tokens) for a few hundred steps, with the routing
recorder of capture_megatron.train.routing on every MoE layer (the process's memory meter is left
out: it only slows the run). The runs differ in experts, top-k and load balancing: aux loss
(Megatron's Mixtral / Qwen3 settings), sequence aux loss, sinkhorn, and none (aux loss with
coefficient 0, what several of Megatron-LM's functional tests run).

    python bench/moe_routing.py [--runs NAME,...] [--steps 250] [--workdir runs/moe_routing]
                                [--analyse-only]

At initialisation (`--at-init`): the same runs at a learning rate of 1e-9, which leaves every
router as it was initialised (what a run still early in a long learning-rate warm-up routes
with), on byte tokens and, with `--gpt2-bpe DIR` (vocab.json and merges.txt: bench/gpt2_bpe.py),
on GPT-2's BPE tokens of the same corpus; the analysis goes to bench/results/moe_routing_init.json
and leaves the shipped statistics alone:

    python bench/moe_routing.py --at-init --runs e8k2-none --steps 40 --gpt2-bpe DIR

The analysis (bench/moe_routing_fit.py) turns the per-sequence counts into the statistics the
forecast needs and checks the forecast's formula against the imbalance measured directly.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

BASE = (
    "--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 256 "
    "--max-position-embeddings 256 --micro-batch-size 16 --global-batch-size 32 "
    "--disable-bias-linear --swiglu --normalization RMSNorm --position-embedding-type rope "
    "--hidden-dropout 0 --attention-dropout 0 --moe-token-dispatcher-type alltoall "
    "--lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 25 --weight-decay 0.1 "
    "--adam-beta2 0.95 --no-progress --log-interval 50"
).split()
"""The small GPT every run trains: 4 layers, h 128, sequence 256, 32 sequences per step."""

RUNS = {
    "e8k2-aux1e-2": "--num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 256 "
    "--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2",
    "e32k4-aux1e-2": "--num-experts 32 --moe-router-topk 4 --moe-ffn-hidden-size 128 "
    "--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2",
    "e128k8-aux1e-3": "--num-experts 128 --moe-router-topk 8 --moe-ffn-hidden-size 64 "
    "--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3",
    "e32k4-seqaux1e-4": "--num-experts 32 --moe-router-topk 4 --moe-ffn-hidden-size 128 "
    "--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4",
    "e8k1-sinkhorn": "--num-experts 8 --moe-router-topk 1 --moe-ffn-hidden-size 256 "
    "--moe-router-load-balancing-type sinkhorn",
    "e8k2-none": "--num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 256 "
    "--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 0",
}
"""The runs: experts, top-k (expert width so that a token's expert FLOPs stay alike) and load
balancing."""


def bpe_flags(bpe: str) -> list[str]:
    """The tokenizer flags of GPT-2's BPE files in folder `bpe` ([] for byte tokens)."""
    if not bpe:
        return []
    files = [os.path.join(bpe, "vocab.json"), os.path.join(bpe, "merges.txt")]
    return [
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        files[0],
        "--merge-file",
        files[1],
    ]


def corpus(workdir: str, bpe: str = "") -> str:
    """The demo's corpus (all of it) as a Megatron indexed dataset, built once (byte tokens, or
    GPT-2's BPE from folder `bpe`)."""
    from capture_megatron.data.corpus import stdlib_corpus
    from capture_megatron.data.preprocess import preprocess
    from capture_megatron.data.tokenizers import TokenizerOptions

    prefix = os.path.join(workdir, "stdlib-bpe" if bpe else "stdlib")
    if not os.path.exists(prefix + "_text_document.idx"):
        os.makedirs(workdir, exist_ok=True)
        jsonl = os.path.join(workdir, "stdlib.jsonl")
        if not os.path.exists(jsonl):
            stdlib_corpus(jsonl, max_bytes=2_000_000)
        opts = TokenizerOptions()
        if bpe:
            vocab, merges = bpe_flags(bpe)[3], bpe_flags(bpe)[5]
            opts = TokenizerOptions("GPT2BPETokenizer", "", vocab, merges)
        preprocess(jsonl, prefix, opts, append_eod=True)
    return prefix + "_text_document"


def collect(argv: list[str], out: str) -> None:
    """Train one run in this process (a gloo group of one) and write its routing statistics."""
    from capture_megatron.megatron import quiet

    quiet.install()
    from capture_megatron.emulate import cpu_compat
    from capture_megatron.megatron.backend import Backend
    from capture_megatron.serial import to_plain
    from capture_megatron.train.dist_env import init_distributed, read_env
    from capture_megatron.train.entry import parse_config
    from capture_megatron.train.loop import train_step
    from capture_megatron.train.routing import RoutingRecorder, write_routing_stats
    from capture_megatron.train.run import train_iterators
    from capture_megatron.train.trainer import build_trainer, init_parallel_state

    cfg = parse_config(argv, 1)
    init_distributed(read_env(), "gloo")
    cpu_compat.apply("cpu")
    init_parallel_state(cfg.plan, cfg.run.seed)
    backend = Backend()
    trainer = build_trainer(cfg.shape, cfg.plan, cfg.optim, cfg.run, cfg.build, backend)
    iterators = train_iterators(cfg, 0, backend)
    recorder = RoutingRecorder(trainer.model, cfg.plan.micro_batch_size)
    losses = []
    t0 = time.perf_counter()
    for it in range(1, cfg.run.train_iters + 1):
        step = train_step(trainer, iterators, cfg.shape, cfg.plan)
        recorder.step()
        losses.append(step.loss)
        if it % cfg.run.log_interval == 0:
            print(
                f"  step {it}: loss {step.loss:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True
            )
    recorder.close()
    header = {"shape": to_plain(cfg.shape), "plan": to_plain(cfg.plan), "losses": losses}
    write_routing_stats(out, recorder, {**header, "argv": argv})


def run_all(names: list[str], steps: int, workdir: str, lr: str = "", bpe: str = "") -> None:
    """Each run in a fresh process (megatron's parallel state is per process); `lr`: a learning
    rate in place of BASE's (and its minimum); `bpe`: GPT-2's BPE files instead of byte tokens."""
    data = corpus(workdir, bpe)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one thread: far faster on a shared machine
    base = list(BASE)
    if lr:
        for key in ("--lr", "--min-lr"):
            base[base.index(key) + 1] = lr
    for name in names:
        out = os.path.join(workdir, f"{name}.json.gz")
        if os.path.exists(out):
            print(f"{name}: kept {out}")
            continue
        argv = [*base, *RUNS[name].split(), *bpe_flags(bpe), "--train-iters", str(steps)]
        argv += ["--data-path", data]
        print(f"{name}: {' '.join(RUNS[name].split())}", flush=True)
        cmd = [sys.executable, __file__, "--collect", out, "--", *argv]
        subprocess.run(cmd, check=True, env=env, cwd=workdir)


def read(path: str) -> dict:
    """A run's statistics file."""
    with gzip.open(path, "rt") as f:
        return json.load(f)


EARLY = {"none": "e8k2-none", "aux": "e8k2-aux1e-2"}
"""The runs --at-init also trains from step 1 at the bench's own schedule (lr 1e-3, warm-up 25)
on GPT-2 BPE tokens, to see how soon their routers leave their initial routing."""


def at_init(names: list[str], steps: int, workdir: str, bpe: str) -> None:
    """The runs at learning rate 1e-9 on byte tokens (and on GPT-2's BPE with `bpe`), analysed
    by moe_routing_fit.analyse_at_init."""
    from moe_routing_fit import analyse_at_init, early_curve, ship_early, ship_initial

    from capture_megatron.forecast.routing import statistics

    runs = {}
    for tokens, folder in [("byte", ""), ("gpt2-bpe", bpe)][: 2 if bpe else 1]:
        where = os.path.join(workdir, tokens)
        run_all(names, steps, where, lr="1e-9", bpe=folder)
        for n in names:
            runs[f"{n} ({tokens})"] = {
                **read(os.path.join(where, f"{n}.json.gz")),
                "tokenizer": tokens,
            }
    out = os.path.join(ROOT, "bench", "results", "moe_routing_init.json")
    analyse_at_init(runs, out)
    if not bpe:
        return
    ship_initial({n: runs[f"{n} (gpt2-bpe)"] for n in names}, steps)  # what the forecast reads
    early = os.path.join(workdir, "gpt2-bpe-early")  # the bench's own schedule, from step 1
    run_all(list(EARLY.values()), steps, early, bpe=bpe)
    curves = {k: early_curve(read(os.path.join(early, f"{n}.json.gz")), 1e-3, 25)
              for k, n in EARLY.items()}  # fmt: skip
    trained = {r.name: r for r in statistics()[0]}["e8k2-none"].spread
    limit = ship_early(curves, trained)
    print(
        f"early steps (gpt2-bpe, lr 1e-3, warm-up 25): without balancing the spread reaches "
        f"the trained routers' {trained:.2f} once the learning rate sums to {limit:.3g}"
    )
    with open(out) as f:
        data = json.load(f)
    with open(out, "w") as f:
        json.dump({**data, "early": curves, "initial_lr_sum": limit}, f, indent=1)


def main() -> None:
    """Collect the runs (those not yet on disk), then analyse them."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--workdir", default=os.path.join(ROOT, "runs", "moe_routing"))
    ap.add_argument("--analyse-only", action="store_true")
    ap.add_argument("--at-init", action="store_true", help="routers left as initialised")
    ap.add_argument("--gpt2-bpe", default="", help="with --at-init: GPT-2 BPE files' folder too")
    ap.add_argument("--collect", default="", help=argparse.SUPPRESS)
    ns, rest = ap.parse_known_args()
    if ns.collect:
        collect([a for a in rest if a != "--"], ns.collect)
        return
    names = ns.runs.split(",")
    if ns.at_init:
        at_init(names, ns.steps, ns.workdir + "_init", ns.gpt2_bpe)
        return
    if not ns.analyse_only:
        run_all(names, ns.steps, ns.workdir)
    from moe_routing_fit import analyse

    analyse({n: read(os.path.join(ns.workdir, f"{n}.json.gz")) for n in names}, ns.steps)


if __name__ == "__main__":
    main()
