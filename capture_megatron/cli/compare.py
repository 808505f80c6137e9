"""`plan ... --compare-with FILE`: the chosen plan's estimated step beside a given configuration's
for the same model and GPUs (typically NVIDIA's published launch line), and, when the plan claims
more than 15% more tokens per second per GPU than it, where each step's time goes, part by part
(capture_megatron.steptime.breakdown). FILE holds a Megatron-LM command line (shell words;
`#` starts a comment); it is predicted on the plan's cluster (--gpus, --gpu-memory-gib,
--gpus-per-node, --device, --memory-model and the hardware flags are added when FILE does not give
them), as `capture-megatron predict` would.
"""

from __future__ import annotations

import argparse
import json
import shlex
from dataclasses import dataclass

from capture_megatron.config import Cluster
from capture_megatron.errors import CaptureError
from capture_megatron.fields import to_flags
from capture_megatron.flags import parser as flags
from capture_megatron.planner import PlanResult
from capture_megatron.serial import JsonMixin, to_plain
from capture_megatron.steptime.breakdown import (
    OUTPACES,
    StepBreakdown,
    breakdown,
    outpaces,
    side_by_side,
)
from capture_megatron.steptime.hardware import HardwareFlags

FLAG = "--compare-with"
"""The plan command's flag naming the configuration to compare with."""


def add_compare_flag(p: argparse.ArgumentParser) -> None:
    """The plan command's --compare-with FILE."""
    p.add_argument(
        FLAG,
        default="",
        metavar="FILE",
        help="a file with the same model's Megatron-LM line to compare the plan's step with",
    )


@dataclass(frozen=True)
class Comparison(JsonMixin):
    """The plan's estimated step beside another configuration's, on the same GPUs."""

    file: str
    """The file the other configuration's command line was read from."""
    plan_tokens_per_s_per_gpu: float
    """The plan's estimated training throughput per GPU."""
    given_tokens_per_s_per_gpu: float
    """The other configuration's, estimated by the same step-time model."""
    outpaces: bool
    """Whether the plan claims more than OUTPACES more throughput (then both breakdowns print)."""
    plan_step: StepBreakdown
    """Where the plan's step goes."""
    given_step: StepBreakdown
    """Where the other configuration's step goes."""


def _cluster_flags(ns: argparse.Namespace, cluster: Cluster, given: list[str]) -> list[str]:
    """The plan's cluster as flags, each only when the file does not give it."""
    pairs = [
        ("--gpus", [str(cluster.gpus)]),
        ("--gpus-per-node", [str(cluster.gpus_per_node)]),
        ("--gpu-memory-gib", [str(cluster.gpu_memory_bytes / 2**30)]),
        ("--device", [ns.device] if ns.device else None),
        ("--memory-model", [ns.memory_model] if ns.memory_model else None),
    ]
    hardware = to_flags(flags.from_namespace(HardwareFlags, ns))
    pairs += [(f, [v]) for f, v in zip(hardware[::2], hardware[1::2])]
    names = {a.split("=", 1)[0] for a in given if a.startswith("--")}
    return [t for f, v in pairs if v is not None and f not in names for t in (f, *v)]


def compare(ns: argparse.Namespace, cluster: Cluster, result: PlanResult) -> Comparison:
    """Predict the configuration in ns.compare_with on `cluster` and set it beside `result`."""
    from capture_megatron.api import predict

    path = ns.compare_with
    try:
        with open(path) as f:
            given = shlex.split(f.read().replace("\\\n", " "), comments=True)
    except (OSError, ValueError) as err:
        raise CaptureError(f"{FLAG} {path}: cannot be read as a command line ({err})") from None
    try:
        other = predict([*given, *_cluster_flags(ns, cluster, given), "--no-progress"])
    except CaptureError as err:
        raise CaptureError(f"{FLAG} {path}: {err}") from None
    ours, theirs = result.step, other.step
    return Comparison(
        path,
        ours.tokens_per_s_per_gpu,
        theirs.tokens_per_s_per_gpu,
        outpaces(ours, theirs),
        breakdown(ours),
        breakdown(theirs),
    )


def print_comparison(c: Comparison) -> None:
    """One line comparing the throughputs; both steps part by part when the plan outpaces."""
    gain = c.plan_tokens_per_s_per_gpu / c.given_tokens_per_s_per_gpu - 1
    print(
        f"\ncompared with {c.file}: {c.given_tokens_per_s_per_gpu:,.0f} tokens/s per GPU "
        f"(step {c.given_step.seconds:.2f} s); this plan {c.plan_tokens_per_s_per_gpu:,.0f} "
        f"(step {c.plan_step.seconds:.2f} s), {gain:+.1%}"
    )
    if c.outpaces:
        print(f"more than {OUTPACES:.0%} over it: where each step's time goes, side by side")
        for line in side_by_side([("this plan", c.plan_step), ("given", c.given_step)]):
            print("  " + line)


def add_to_json(path: str, c: Comparison) -> None:
    """Add the comparison to the plan's --json file (key `compared_with`)."""
    with open(path) as f:
        data = json.load(f)
    data["compared_with"] = to_plain(c)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
