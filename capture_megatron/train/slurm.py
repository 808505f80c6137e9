"""Slurm batch scripts for a training run (`capture-megatron launch`). Pure Python.

Two templates (capture_megatron/train/templates/):
- torchrun (default): one task per node running torchrun; rendezvous (c10d) on the first node of the
  allocation, every node starts G processes.
- tasks: one Slurm task per GPU; each process reads SLURM_PROCID / SLURM_LOCALID / SLURM_NTASKS and
  the first host of SLURM_JOB_NODELIST (capture_megatron.train.dist_env), no torchrun.
Environment Megatron needs is set in the script: CUDA_DEVICE_MAX_CONNECTIONS=1 with TP > 1 (keeps
TP communication ordered ahead of compute), OMP settings; --container-image uses pyxis.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from importlib import resources

from capture_megatron.config.fields import flag
from capture_megatron.errors import require

MODES = ("torchrun", "tasks")
"""How the script starts processes: one torchrun per node, or one Slurm task per GPU."""


@dataclass(frozen=True)
class SlurmOptions:
    """The Slurm job: nodes, script, launch mode and sbatch settings."""

    nodes: int = flag("--nodes")
    """Nodes to allocate."""
    sbatch: str = flag("--sbatch")
    """Write the batch script here."""
    mode: str = flag("--mode", "torchrun", choices=MODES)
    """torchrun: one torchrun per node; tasks: one Slurm task per GPU."""
    plan_json: str = flag("--plan-json", "")
    """Use this plan (from `capture-megatron plan --json`) instead of planning."""
    job_name: str = flag("--job-name", "capture-megatron")
    """Slurm job name."""
    account: str = flag("--account", "")
    """Slurm account."""
    partition: str = flag("--partition", "")
    """Slurm partition."""
    time: str = flag("--time", "01:00:00")
    """Slurm time limit."""
    container_image: str = flag("--container-image", "")
    """pyxis/enroot image for srun."""
    python: str = flag("--python", "python")
    """The interpreter on the compute nodes."""
    cpu: bool = flag("--cpu", False)
    """CPU processes (gloo): no --gpus-per-node request."""
    output: str = flag("--output", "%x-%j.out")
    """Slurm output file pattern."""

    def __post_init__(self) -> None:
        require([f"--nodes {self.nodes} must be at least 1"] if self.nodes < 1 else [], "Slurm job")


def _sbatch_lines(opts: SlurmOptions, per_node: int) -> str:
    lines = [
        f"#SBATCH --job-name={opts.job_name}",
        f"#SBATCH --nodes={opts.nodes}",
        f"#SBATCH --time={opts.time}",
        f"#SBATCH --output={opts.output}",
        f"#SBATCH --ntasks-per-node={1 if opts.mode == 'torchrun' else per_node}",
    ]
    if not opts.cpu:
        lines.append(f"#SBATCH --gpus-per-node={per_node}")
    for name, value in (("account", opts.account), ("partition", opts.partition)):
        if value:
            lines.append(f"#SBATCH --{name}={value}")
    return "\n".join(lines)


def render(opts: SlurmOptions, per_node: int, train_args: list[str], tp: int) -> str:
    """The batch script that runs pretrain_gpt with `train_args` on opts.nodes x per_node
    processes."""
    template = (
        resources.files("capture_megatron.train")
        .joinpath(f"templates/sbatch_{opts.mode}.sh")
        .read_text()
    )
    image = opts.container_image
    container = f"--container-image={shlex.quote(image)} " if image else ""
    env = ["export CUDA_DEVICE_MAX_CONNECTIONS=1"] if tp > 1 else []
    env.append("export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}")
    return template.format(
        sbatch=_sbatch_lines(opts, per_node),
        env="\n".join(env),
        nodes=opts.nodes,
        per_node=per_node,
        python=shlex.quote(opts.python),
        srun_container=container,
        train_args=_format_args(train_args),
    )


def _format_args(args: list[str]) -> str:
    """One flag (with its values) per line."""
    lines: list[list[str]] = []
    for a in args:
        if a.startswith("--") or not lines:
            lines.append([])
        lines[-1].append(shlex.quote(a))
    return " \\\n    ".join(" ".join(line) for line in lines)
