"""Slurm batch scripts for a training run (`capture-megatron launch`). Pure Python.

Two templates (capture_megatron/train/templates/):
- torchrun (default): one task per node running torchrun; rendezvous (c10d) on the first node of the
  allocation, every node starts G processes.
- tasks: one Slurm task per GPU; each process reads SLURM_PROCID / SLURM_LOCALID / SLURM_NTASKS and
  the first host of SLURM_JOB_NODELIST (capture_megatron.train.dist_env), no torchrun.
The job asks for what an admin expects a training job to state: whole nodes (--exclusive, all their
memory) or a --mem, --cpus-per-task covering the ranks each task runs, and with --requeue a signal
before the time limit on which the ranks save a checkpoint and the job requeues itself and resumes
(capture_megatron.train.slurm_requeue). Environment Megatron needs is set in the script:
CUDA_DEVICE_MAX_CONNECTIONS=1 with TP > 1 (keeps TP communication ordered ahead of compute), OMP
settings; --container-image runs the ranks in a pyxis/enroot container.
"""

from __future__ import annotations

import os
import re
import shlex
import textwrap
from dataclasses import dataclass
from importlib import resources

from capture_megatron.errors import CaptureError, require
from capture_megatron.fields import flag
from capture_megatron.train import slurm_requeue
from capture_megatron.train.slurm_time import time_limit_seconds

MODES = ("torchrun", "tasks")
"""How the script starts processes: one torchrun per node, or one Slurm task per GPU."""
CPUS_PER_GPU_RANK = 8
"""Default CPUs per GPU rank: its Python main thread, data reading and the communication library's
progress threads, with room to spare (8-GPU nodes have 64 or more cores)."""
CPUS_PER_CPU_RANK = 2
"""Default CPUs per --cpu rank: one for its single-threaded (OMP_NUM_THREADS=1) compute, one for
gloo's communication threads."""
DEFAULT_SIGNAL_SECONDS = 300
"""Default --signal-seconds: time for one more iteration and a checkpoint save before the limit."""
_MEM = re.compile(r"^\d+[KMGT]?$")
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""This installation's capture_megatron package directory (mounted into a --container-image)."""
CONTAINER_ROOT = "/opt/capture-megatron"
"""Where the package is mounted in the container (put on PYTHONPATH there)."""


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
    """Slurm time limit (HH:MM:SS, D-HH:MM:SS, minutes, or UNLIMITED)."""
    cpus_per_task: int = flag("--cpus-per-task", 0)
    """CPUs per Slurm task; 0 (default): 8 per GPU rank (2 per --cpu rank) times the ranks one task
    runs: all G of a node in torchrun mode, one in tasks mode."""
    exclusive: bool = flag("--no-exclusive", True, negate=True)
    """Allocate whole nodes (#SBATCH --exclusive, the default); --no-exclusive shares them."""
    mem: str = flag("--mem", "")
    """Memory per node in Slurm's syntax (e.g. 500G; 0: all of it); default 0 with whole nodes,
    else the cluster's default."""
    container_image: str = flag("--container-image", "")
    """pyxis/enroot image the ranks run in (srun --container-image)."""
    container_mounts: str = flag("--container-mounts", "")
    """Mounts into the container, pyxis' SRC:DST[:FLAGS],... (needs --container-image)."""
    container_workdir: str = flag("--container-workdir", "")
    """Working directory in the container (needs --container-image); default the image's."""
    requeue: bool = flag("--requeue", False, note="(capture-megatron)")
    """Before the time limit, have the ranks save a checkpoint to --save and requeue the job, which
    resumes from it (#SBATCH --requeue, --signal=B:USR1@--signal-seconds, --exit-signal-handler)."""
    signal_seconds: int = flag("--signal-seconds", 0, note="(capture-megatron)")
    """With --requeue: signal the job this many seconds before its time limit; 0 (default): 300.
    Must cover one iteration plus a checkpoint save."""
    python: str = flag("--python", "python")
    """The interpreter on the compute nodes."""
    cpu: bool = flag("--cpu", False)
    """CPU processes (gloo): no --gpus-per-node request."""
    output: str = flag("--output", "%x-%j.out")
    """Slurm output file pattern."""

    def __post_init__(self) -> None:
        require(self._problems(), "Slurm job")

    def _problems(self) -> list[str]:
        p = [f"--nodes {self.nodes} must be at least 1"] if self.nodes < 1 else []
        if self.cpus_per_task < 0:
            p.append(f"--cpus-per-task {self.cpus_per_task} must be >= 0 (0: the default)")
        if self.mem and not _MEM.match(self.mem):
            p.append(f"--mem {self.mem!r} is not a Slurm size (a number with K, M, G or T)")
        for name in ("job_name", "account", "partition", "output", "time", "mem"):
            if re.search(r"\s", getattr(self, name)):
                p.append(f"--{name.replace('_', '-')} {getattr(self, name)!r} contains a space")
        for name in ("container_mounts", "container_workdir"):
            if getattr(self, name) and not self.container_image:
                flag_name = "--" + name.replace("_", "-")
                p.append(f"{flag_name} needs --container-image (the ranks run on the host)")
        if self.signal_seconds and not self.requeue:
            p.append(f"--signal-seconds {self.signal_seconds} needs --requeue")
        if not 0 <= self.signal_seconds <= 65535:
            p.append(f"--signal-seconds {self.signal_seconds} must be between 1 and 65535")
        try:
            limit = time_limit_seconds(self.time)
        except CaptureError as err:
            return p + [str(err)]
        if self.requeue and limit is not None and self.lead >= limit:
            p.append(
                f"--signal-seconds {self.lead} leaves no time to train within --time {self.time}"
            )
        return p

    @property
    def lead(self) -> int:
        """Seconds before the time limit at which a --requeue job is signalled."""
        return self.signal_seconds or DEFAULT_SIGNAL_SECONDS

    def cpus(self, per_node: int) -> int:
        """--cpus-per-task: given, or the default for the ranks one task runs."""
        if self.cpus_per_task:
            return self.cpus_per_task
        ranks = per_node if self.mode == "torchrun" else 1
        return ranks * (CPUS_PER_CPU_RANK if self.cpu else CPUS_PER_GPU_RANK)

    def memory(self) -> str:
        """--mem: given, else 0 (all of each node's memory) with whole nodes, else none."""
        return self.mem or ("0" if self.exclusive else "")


@dataclass(frozen=True)
class TrainRun:
    """What the batch script starts: pretrain_gpt's flags and what resuming needs."""

    args: tuple[str, ...]
    """pretrain_gpt flags (model, plan, data, training; --load is added by the script under
    --requeue)."""
    tp: int
    """Tensor-parallel size (CUDA_DEVICE_MAX_CONNECTIONS=1 when > 1)."""
    train_iters: int = 0
    """--train-iters: the requeued job stops requeueing once the checkpoint reaches it."""
    save: str = ""
    """--save: where the ranks save on the signal (needed by --requeue)."""
    load: str = ""
    """--load for the first start (a requeued start loads from --save once it holds a
    checkpoint)."""
    notes: tuple[str, ...] = ()
    """Warnings written as comments at the top of the script."""


def _sbatch_lines(opts: SlurmOptions, per_node: int) -> str:
    lines = [
        f"#SBATCH --job-name={opts.job_name}",
        f"#SBATCH --nodes={opts.nodes}",
        f"#SBATCH --ntasks-per-node={1 if opts.mode == 'torchrun' else per_node}",
        f"#SBATCH --cpus-per-task={opts.cpus(per_node)}",
        f"#SBATCH --time={opts.time}",
        f"#SBATCH --output={opts.output}",
    ]
    if not opts.cpu:
        lines.append(f"#SBATCH --gpus-per-node={per_node}")
    if opts.exclusive:
        lines.append("#SBATCH --exclusive")
    if opts.memory():
        lines.append(f"#SBATCH --mem={opts.memory()}")
    for name, value in (("account", opts.account), ("partition", opts.partition)):
        if value:
            lines.append(f"#SBATCH --{name}={value}")
    if opts.requeue:
        lines += slurm_requeue.sbatch_lines(opts.lead)
    return "\n".join(lines)


def _srun_flags(opts: SlurmOptions, per_node: int) -> str:
    """srun's options: CPUs again (srun does not inherit sbatch's --cpus-per-task since Slurm
    22.05), fail fast, and the container (on a line of its own)."""
    out = f"--cpus-per-task={opts.cpus(per_node)} --kill-on-bad-exit=1"
    container = _container_flags(opts)
    return out + (" \\\n    " + " ".join(container) + " \\\n   " if container else "")


def _container_flags(opts: SlurmOptions) -> list[str]:
    """pyxis flags; the image gets this capture_megatron mounted read-only (mounts given first)."""
    if not opts.container_image:
        return []
    ours = f"{PACKAGE_DIR}:{CONTAINER_ROOT}/capture_megatron:ro"
    mounts = ",".join(m for m in (opts.container_mounts, ours) if m)
    out = [f"--container-image={shlex.quote(opts.container_image)}"]
    out.append(f"--container-mounts={shlex.quote(mounts)}")
    if opts.container_workdir:
        out.append(f"--container-workdir={shlex.quote(opts.container_workdir)}")
    return out


def _container_env(opts: SlurmOptions) -> list[str]:
    """In a container: capture_megatron on PYTHONPATH, and one step that checks, before the job
    starts, that the image can import it and megatron-core (a clear message, not a traceback per
    rank)."""
    if not opts.container_image:
        return []
    check = (
        f"srun --ntasks-per-node=1 {' '.join(_container_flags(opts))} {shlex.quote(opts.python)} "
        "-c 'import capture_megatron, megatron.core, torch'"
    )
    return [
        f"# capture_megatron is mounted from {PACKAGE_DIR} (a path the compute nodes must see);",
        "# the image must provide torch and megatron-core 0.16 (pip install megatron-core==0.16.1)",
        f"export PYTHONPATH={CONTAINER_ROOT}${{PYTHONPATH:+:$PYTHONPATH}}",
        f"{check} || {{ echo 'capture-megatron: the container image cannot import "
        "capture_megatron, megatron.core and torch (see the lines above)' >&2; exit 1; }",
    ]


def _notes(notes: tuple[str, ...]) -> str:
    return "".join(
        textwrap.fill(n, 100, initial_indent="# WARNING: ", subsequent_indent="#   ") + "\n"
        for n in notes
    )


def render(opts: SlurmOptions, per_node: int, run: TrainRun) -> str:
    """The batch script that runs pretrain_gpt with `run.args` on opts.nodes x per_node
    processes."""
    template = (
        resources.files("capture_megatron.train")
        .joinpath(f"templates/sbatch_{opts.mode}.sh")
        .read_text()
    )
    env = ["export CUDA_DEVICE_MAX_CONNECTIONS=1"] if run.tp > 1 else []
    env.append("export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}")
    env += _container_env(opts)
    args = _format_args(list(run.args))
    requeue = (
        slurm_requeue.parts(opts.lead, run.train_iters, run.save, run.load)
        if opts.requeue
        else None
    )
    text = template.format(
        notes=_notes(run.notes),
        sbatch=_sbatch_lines(opts, per_node),
        env="\n".join(env),
        nodes=opts.nodes,
        per_node=per_node,
        python=shlex.quote(opts.python),
        srun_flags=_srun_flags(opts, per_node),
        prefix=requeue.prefix if requeue else "",
        train_args=args + (requeue.load_arg if requeue else ""),
        before=requeue.before if requeue else "",
        after=requeue.after if requeue else "",
        background=" &" if requeue else "",
    )
    return text.rstrip("\n") + "\n"


def _format_args(args: list[str]) -> str:
    """One flag (with its values) per line."""
    lines: list[list[str]] = []
    for a in args:
        if a.startswith("--") or not lines:
            lines.append([])
        lines[-1].append(shlex.quote(a))
    return " \\\n    ".join(" ".join(line) for line in lines)
