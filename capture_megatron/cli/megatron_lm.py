"""`capture-megatron megatron-lm --megatron-lm PATH --nproc-per-node N <your pretrain_gpt.py
flags>`: plan, then run your Megatron-LM checkout's pretrain_gpt.py with the plan.

Plans from the model, batch and parallel flags you already pass to Megatron-LM's pretrain_gpt.py
(sizes you give stay fixed), prints the plan, and runs your checkout's pretrain_gpt through
capture_megatron.megatron_lm.pretrain_gpt under torchrun with the balanced
--pipeline-model-parallel-layout and per-stage recompute; every other flag is passed through
unchanged. --dry-run prints the command. Before anything else it checks that the checkout can
start here (Megatron-LM's scripts import more than megatron-core declares) and names every missing
module with the pip command that installs it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys

from capture_megatron.config import GIB, Cluster
from capture_megatron.errors import CaptureError
from capture_megatron.flags.parser import HelpParser, summary
from capture_megatron.megatron_lm import deps as lm_deps
from capture_megatron.planner import plan_args
from capture_megatron.planner.emit import GEGLU_NOTE
from capture_megatron.train.job import run_job

WRAPPER = "capture_megatron.megatron_lm.pretrain_gpt"
"""The module torchrun runs (-m): Megatron-LM's pretrain_gpt.py with per-stage recompute."""
PLANNED = {
    "--tensor-model-parallel-size": True,
    "--pipeline-model-parallel-size": True,
    "--pipeline-model-parallel-layout": True,
    "--num-layers-per-virtual-pipeline-stage": True,
    "--num-virtual-stages-per-pipeline-rank": True,
    "--decoder-first-pipeline-num-layers": True,
    "--decoder-last-pipeline-num-layers": True,
    "--micro-batch-size": True,
    "--global-batch-size": True,
    "--recompute-granularity": True,
    "--recompute-method": True,
    "--recompute-num-layers": True,
    "--recompute-num-layers-per-stage": True,
    "--recompute-activations": False,
    "--sequence-parallel": False,
    "--use-distributed-optimizer": False,
    "--expert-model-parallel-size": True,
    "--expert-tensor-parallel-size": True,
}
"""Flags the plan decides: flag -> whether it takes a value."""


def planner_only() -> dict[str, bool]:
    """The planner's own flags that Megatron-LM's pretrain_gpt.py does not know (--objective,
    --reserve-fraction, --hf-config, ...): flag -> whether it takes a value. They steer the plan
    and are not passed on (Megatron-LM would refuse them)."""
    from capture_megatron.cli.plan import build_parser as plan_parser
    from capture_megatron.flags.megatron_lm import flag_names

    known = flag_names()
    return {
        flag: action.nargs != 0
        for flag, action in plan_parser()._option_string_actions.items()
        if flag.startswith("--") and flag not in known and flag != "--help"
    }


def strip_planned(args: list[str]) -> list[str]:
    """The user's flags without those the plan sets and those only the planner reads."""
    drop = {**planner_only(), **PLANNED}
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in drop:
            skip = drop[name] and "=" not in arg
            continue
        out.append(arg)
    return out


def megatron_args_for(
    user_args: list[str], gpus: int, gpu_memory_gib: float, device: str, progress: bool = True
) -> list[str]:
    """Plan from the user's flags (printing the table) and return the flags to run."""
    from capture_megatron.api.request import resolve_shape
    from capture_megatron.cli.plan import build_parser, plan_and_report

    ns, _others = build_parser().parse_known_args(user_args)  # the rest passes through unchanged
    named = [f for f, v in (("--preset", ns.preset), ("--hf-config", ns.hf_config)) if v]
    if named:  # the planner would read the model from them, but Megatron-LM never sees them
        raise CaptureError(
            f"{' and '.join(named)}: the megatron-lm wrapper runs your pretrain_gpt.py flags, and "
            "Megatron-LM builds its model from those alone; pass the model flags (--num-layers, "
            "--hidden-size, ...) instead, so that the plan and the run describe the same model"
        )
    if resolve_shape(ns)[0].geglu:
        raise CaptureError(f"{GEGLU_NOTE}; run it with capture-megatron launch or train instead")
    kind = "cpu" if device == "cpu" else "cuda"
    cluster = Cluster(gpus=gpus, gpu_memory_bytes=int(gpu_memory_gib * GIB), device=kind)
    ns.device = device  # the wrapper's --device: the memory model the plan is made with
    planned = plan_args(plan_and_report(ns, cluster, progress).best.plan)
    if "--recompute-num-layers-per-stage" in planned:  # Megatron-LM's checks want a global count
        counts = planned[planned.index("--recompute-num-layers-per-stage") + 1].split(",")
        planned += ["--recompute-num-layers", str(max(int(c) for c in counts))]
    return strip_planned(user_args) + planned


def build_parser() -> argparse.ArgumentParser:
    """The wrapper's own flags (the rest of the command line is the user's pretrain_gpt.py's)."""
    p = HelpParser(
        prog="capture-megatron megatron-lm",
        description=summary(__doc__),
        example="--megatron-lm ~/Megatron-LM --nproc-per-node 8 --num-layers 32 --hidden-size 4096 "
        "--num-attention-heads 32 --seq-length 4096 --max-position-embeddings 4096 "
        "--micro-batch-size 1 --global-batch-size 64 --bf16 --mock-data --tokenizer-type "
        "NullTokenizer --vocab-size 32000 --train-iters 10 --dry-run",
    )
    p.add_argument("--megatron-lm", required=True, help="your Megatron-LM checkout (core_v0.16.x)")
    p.add_argument("--nproc-per-node", type=int, required=True)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default="localhost")
    p.add_argument("--master-port", type=int, default=29500)
    p.add_argument("--gpu-memory-gib", type=float, default=80.0)
    p.add_argument(
        "--plan-device",
        default="",
        help="memory model device (cuda, fake, cpu); default: cuda if usable, else fake",
    )
    p.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    p.add_argument("--no-progress", action="store_true", help="no progress bar while profiling")
    return p


def _handled_signal(args: list[str]) -> signal.Signals | None:
    """The signal the ranks handle: Megatron-LM's --exit-signal (default SIGTERM) with
    --exit-signal-handler, else None."""
    if "--exit-signal-handler" not in args:
        return None
    for i, arg in enumerate(args):
        if arg == "--exit-signal" and i + 1 < len(args):
            return signal.Signals.__members__.get(args[i + 1])
        if arg.startswith("--exit-signal="):
            return signal.Signals.__members__.get(arg.split("=", 1)[1])
    return signal.SIGTERM


def main(argv: list[str]) -> int:
    """Entry point."""
    ns, user = build_parser().parse_known_args(argv)
    if not os.path.isfile(os.path.join(ns.megatron_lm, "pretrain_gpt.py")):
        raise CaptureError(
            f"--megatron-lm {ns.megatron_lm} holds no pretrain_gpt.py (a Megatron-LM checkout)"
        )
    if ns.nproc_per_node < 1 or ns.nnodes < 1:
        raise CaptureError(
            f"--nproc-per-node {ns.nproc_per_node} and --nnodes {ns.nnodes} must be >= 1"
        )
    lm_deps.check(ns.megatron_lm)
    args = megatron_args_for(
        user, ns.nproc_per_node * ns.nnodes, ns.gpu_memory_gib, ns.plan_device, not ns.no_progress
    )
    launcher = [
        "--nproc-per-node",
        str(ns.nproc_per_node),
        "--nnodes",
        str(ns.nnodes),
        "--node-rank",
        str(ns.node_rank),
        "--master-addr",
        ns.master_addr,
        "--master-port",
        str(ns.master_port),
        "-m",
        WRAPPER,
        *args,
    ]
    env = {"MEGATRON_LM": os.path.abspath(ns.megatron_lm), "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    text = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    print(f"{text} {shlex.join(['torchrun', *launcher])}", flush=True)
    if ns.dry_run:
        return 0
    lm_deps.build_helper(ns.megatron_lm)
    # torchrun as this interpreter's module: the console script may not be on PATH
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher]
    full = dict(os.environ, **env, PATH=lm_deps.launch_path())
    rc = run_job(cmd, full, None, _handled_signal(args))  # signals reach every rank
    if rc != 0:
        print(
            f"capture-megatron megatron-lm: Megatron-LM's pretrain_gpt.py failed (torchrun exit "
            f"code {rc}); the failing rank's own error is above torchrun's report.",
            file=sys.stderr,
        )
    return rc
