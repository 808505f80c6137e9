"""`capture-megatron launch <plan flags> --nodes K --gpus-per-node G --sbatch job.sh`: a Slurm batch script.

Plans for K x G GPUs (or takes --plan-json from `capture-megatron plan`), then renders one of two
templates (capture_megatron/templates/):
- torchrun (default): one task per node running torchrun; rendezvous (c10d) on the first node of the
  allocation, every node starts G processes.
- tasks: one Slurm task per GPU; each process reads SLURM_PROCID / SLURM_LOCALID / SLURM_NTASKS and
  the first host of SLURM_JOB_NODELIST (capture_megatron.train.dist_env), no torchrun.
Environment Megatron needs is set in the script: CUDA_DEVICE_MAX_CONNECTIONS=1 with TP > 1 (keeps
TP communication ordered ahead of compute), NCCL/OMP settings; --container-image uses pyxis.
"""
from __future__ import annotations

import json
import shlex
from importlib import resources

from capture_megatron.errors import CaptureError
from capture_megatron.megatron import flags

PASS = ("--mock-data", "--data-path", "--split", "--tokenizer-type", "--tokenizer-model", "--vocab-file",
        "--merge-file", "--train-iters", "--lr", "--min-lr", "--lr-decay-style", "--lr-warmup-iters",
        "--weight-decay", "--clip-grad", "--seed", "--log-interval", "--save", "--load", "--save-interval",
        "--memory-report", "--distributed-backend", "--no-progress", "--exit-interval")


def build_parser() -> flags.FlagParser:
    """Plan flags + training pass-through + the launcher's own."""
    from capture_megatron.plan_cli import build_parser as plan_parser

    p = plan_parser()
    p.prog = "capture-megatron launch"
    flags.add_data_flags(p)
    t = p.add_argument_group("training (passed to pretrain_gpt)")
    for name in ("--train-iters", "--lr", "--min-lr", "--lr-decay-style", "--lr-warmup-iters", "--weight-decay",
                 "--clip-grad", "--seed", "--log-interval", "--save", "--load", "--save-interval",
                 "--memory-report", "--distributed-backend", "--exit-interval"):
        t.add_argument(name)
    g = p.add_argument_group("slurm")
    g.add_argument("--nodes", type=int, required=True)
    g.add_argument("--sbatch", required=True, help="write the batch script here")
    g.add_argument("--mode", choices=["torchrun", "tasks"], default="torchrun")
    g.add_argument("--plan-json", default="", help="use this plan (from `capture-megatron plan --json`)")
    g.add_argument("--job-name", default="capture-megatron")
    g.add_argument("--account", default="")
    g.add_argument("--partition", default="")
    g.add_argument("--time", default="01:00:00")
    g.add_argument("--container-image", default="", help="pyxis/enroot image for srun")
    g.add_argument("--python", default="python", help="interpreter on the compute nodes")
    g.add_argument("--cpu", action="store_true", help="CPU processes (gloo), no --gpus-per-node request")
    g.add_argument("--output", default="%x-%j.out", help="Slurm output file pattern")
    return p


def _pass_through(argv: list[str]) -> list[str]:
    out, take = [], False
    for token in argv:
        if token.startswith("--"):
            take = token.split("=", 1)[0] in PASS
        if take:
            out.append(token)
    return out


def _sbatch_lines(ns, nodes: int, per_node: int) -> str:
    lines = [f"#SBATCH --job-name={ns.job_name}", f"#SBATCH --nodes={nodes}", f"#SBATCH --time={ns.time}",
             f"#SBATCH --output={ns.output}"]
    lines.append(f"#SBATCH --ntasks-per-node={1 if ns.mode == 'torchrun' else per_node}")
    if not ns.cpu:
        lines.append(f"#SBATCH --gpus-per-node={per_node}")
    for flag, value in (("account", ns.account), ("partition", ns.partition)):
        if value:
            lines.append(f"#SBATCH --{flag}={value}")
    return "\n".join(lines)


def render(ns, train_args: list[str], tp: int) -> str:
    """The batch script text."""
    per_node = ns.gpus_per_node
    template = resources.files("capture_megatron").joinpath(f"templates/sbatch_{ns.mode}.sh").read_text()
    container = f"--container-image={shlex.quote(ns.container_image)} " if ns.container_image else ""
    env = ["export CUDA_DEVICE_MAX_CONNECTIONS=1"] if tp > 1 else []
    env.append("export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}")
    return template.format(sbatch=_sbatch_lines(ns, ns.nodes, per_node), env="\n".join(env),
                           nodes=ns.nodes, per_node=per_node, python=shlex.quote(ns.python), srun_container=container,
                           train_args=_format_args(train_args))


def _format_args(args: list[str]) -> str:
    """One flag (with its values) per line."""
    lines: list[list[str]] = []
    for a in args:
        if a.startswith("--") or not lines:
            lines.append([])
        lines[-1].append(shlex.quote(a))
    return " \\\n    ".join(" ".join(line) for line in lines)


def main(argv: list[str]) -> int:
    """Entry point."""
    from capture_megatron.plan_cli import cluster_of, resolve_shape, resolve_space
    from capture_megatron.plan_run import plan_outputs

    ns = flags.parse_flags(build_parser(), argv)
    if ns.nodes < 1 or ns.gpus_per_node < 1:
        raise CaptureError(f"--nodes {ns.nodes} and --gpus-per-node {ns.gpus_per_node} must be at least 1")
    ns.gpus = ns.nodes * ns.gpus_per_node if ns.gpus is None else ns.gpus
    if ns.gpus != ns.nodes * ns.gpus_per_node:
        raise CaptureError(f"--gpus {ns.gpus} differs from --nodes {ns.nodes} x --gpus-per-node {ns.gpus_per_node}")
    if ns.plan_json:
        with open(ns.plan_json) as f:
            out = json.load(f)
    else:
        shape = resolve_shape(ns, argv)
        out = plan_outputs(ns, shape, cluster_of(ns), resolve_space(ns, shape))
    train_args = out["model_args"] + out["megatron_args"] + _pass_through(argv)
    with open(ns.sbatch, "w") as f:
        f.write(render(ns, train_args, out["plan"]["tp"]))
    print(f"wrote {ns.sbatch}: {ns.nodes} nodes x {ns.gpus_per_node} {'processes' if ns.cpu else 'GPUs'}, "
          f"{ns.mode} mode, layout {out['plan']['layout']}; submit with: sbatch {ns.sbatch}")
    return 0
