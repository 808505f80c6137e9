"""`capture-megatron verify <plan flags> --nproc N`: plan, train a few iterations, compare per rank.

The training run gets exactly the model flags and the plan's `megatron_args` (so what ran is what
was predicted), on `--nproc` processes under torchrun; its --memory-report gives each rank's measured
peak. Prints predicted vs measured per pipeline rank with the relative error (and the allocator's
reserve on CUDA), writes --json / --png, and exits 1 when any rank is off by more than --tolerance.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass

from capture_megatron.config import GIB
from capture_megatron.errors import CaptureError
from capture_megatron.megatron import flags
from capture_megatron.train.report import MemoryReport

PASS_THROUGH = ("--mock-data", "--data-path", "--split", "--tokenizer-type", "--tokenizer-model", "--vocab-file",
                "--merge-file", "--seed", "--lr", "--distributed-backend", "--transformer-impl")


@dataclass(frozen=True)
class RankCheck:
    """Predicted vs measured peak of one pipeline rank."""

    pp_rank: int
    """Pipeline rank."""
    predicted_bytes: int
    """Predicted peak (allocated)."""
    measured_bytes: int
    """Measured peak (allocated; the maximum over its TP/DP peers)."""
    reserved_bytes: int
    """CUDA: measured peak reserved by the allocator (0 on CPU)."""

    @property
    def error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted_bytes - self.measured_bytes) / max(self.measured_bytes, 1)


def build_parser() -> flags.FlagParser:
    """The plan command's flags plus data/training flags and verify's own."""
    from capture_megatron.plan_cli import build_parser as plan_parser

    p = plan_parser()
    p.prog = "capture-megatron verify"
    flags.add_data_flags(p)
    g = p.add_argument_group("verification")
    g.add_argument("--nproc", type=int, required=True, help="training processes (torchrun, this node)")
    g.add_argument("--train-iters", type=int, default=4)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--lr", type=float, default=1e-4)
    g.add_argument("--distributed-backend", choices=["gloo", "nccl"])
    g.add_argument("--tolerance", type=float, default=0.02, help="largest accepted |relative error|")
    g.add_argument("--refit", action="store_true", help="store the measured peaks as calibration")
    g.add_argument("--keep", default="", help="directory to keep the memory report in")
    return p


def _pass_through(argv: list[str]) -> list[str]:
    """Data and training flags (with their values) to hand to pretrain_gpt unchanged."""
    out, i = [], 0
    while i < len(argv):
        flag = argv[i].split("=", 1)[0]
        if flag in PASS_THROUGH:
            out.append(argv[i])
            i += 1
            while "=" not in argv[i - 1] and i < len(argv) and not argv[i].startswith("--"):
                out.append(argv[i])
                i += 1
        else:
            i += 1
    return out


def checks(out: dict, report: MemoryReport) -> list[RankCheck]:
    """Per pipeline rank predicted vs measured."""
    reserved = [0] * report.plan.pp
    for r in report.ranks:
        reserved[r.pp_rank] = max(reserved[r.pp_rank], r.reserved_bytes)
    return [RankCheck(r, int(out["predicted_peak_bytes"][r]), int(m), reserved[r])
            for r, m in enumerate(report.stage_peaks())]


def print_checks(rows: list[RankCheck], tolerance: float) -> None:
    """The verification table."""
    print(f"  {'rank':>4} {'predicted MiB':>14} {'measured MiB':>13} {'error':>8} {'reserved MiB':>13}")
    for c in rows:
        flag = "" if abs(c.error) <= tolerance else "  <-- off"
        print(f"  {c.pp_rank:4d} {c.predicted_bytes / 2**20:14.3f} {c.measured_bytes / 2**20:13.3f} "
              f"{100 * c.error:+7.2f}% {c.reserved_bytes / 2**20:13.3f}{flag}")


def save_png(rows: list[RankCheck], path: str, title: str) -> None:
    """Predicted vs measured bars per rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit, name = (GIB, "GiB") if max(c.measured_bytes for c in rows) >= GIB else (2 ** 20, "MiB")
    xs = [c.pp_rank for c in rows]
    fig, ax = plt.subplots(figsize=(2.5 + 0.9 * len(xs), 3.8))
    ax.bar([x - 0.2 for x in xs], [c.predicted_bytes / unit for c in rows], width=0.4, label="predicted")
    ax.bar([x + 0.2 for x in xs], [c.measured_bytes / unit for c in rows], width=0.4, label="measured")
    for c in rows:
        ax.annotate(f"{100 * c.error:+.1f}%", (c.pp_rank, max(c.predicted_bytes, c.measured_bytes) / unit),
                    ha="center", va="bottom", fontsize=7)
    ax.set_xticks(xs)
    ax.set_xlabel("pipeline rank")
    ax.set_ylabel(f"peak allocated, {name}")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    """Entry point: 0 when every rank is within tolerance, 1 otherwise."""
    from capture_megatron.launcher import run_torchrun
    from capture_megatron.plan_cli import cluster_of, resolve_shape, resolve_space
    from capture_megatron.plan_run import plan_outputs

    ns = flags.parse_flags(build_parser(), argv)
    ns.gpus = ns.nproc if ns.gpus is None else ns.gpus
    if ns.nproc != ns.gpus:
        raise CaptureError(f"--nproc {ns.nproc} must equal --gpus {ns.gpus} (verify trains the plan it makes)")
    shape = resolve_shape(ns, argv)
    out = plan_outputs(ns, shape, cluster_of(ns), resolve_space(ns, shape), quiet=False)
    workdir = ns.keep or tempfile.mkdtemp(prefix="capture-verify-")
    report_path = os.path.join(workdir, "memory_report.json")
    train = out["model_args"] + out["megatron_args"] + _pass_through(argv) + [
        "--train-iters", str(ns.train_iters), "--no-progress", "--memory-report", report_path]
    rc = run_torchrun(ns.nproc, train)
    if rc != 0:
        raise CaptureError(f"the training run failed (torchrun exit code {rc}); its output is above")
    report = MemoryReport.read(report_path)
    rows = checks(out, report)
    print(f"verify: predicted vs measured peak per pipeline rank ({report.device}, {report.transformer_impl} spec)")
    print_checks(rows, ns.tolerance)
    worst = max(abs(c.error) for c in rows)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"plan": out["plan"], "ranks": [dict(c.__dict__, error=c.error) for c in rows],
                       "max_abs_error": worst, "tolerance": ns.tolerance, "device": report.device}, f, indent=1)
    if ns.png:
        save_png(rows, ns.png, f"layout {out['plan']['layout']}: max |error| {100 * worst:.2f}%")
    if ns.refit:
        from capture_megatron.calibration import record
        record(shape, report, rows)
    print(f"max |error| {100 * worst:.2f}% (tolerance {100 * ns.tolerance:.1f}%)")
    return 0 if worst <= ns.tolerance else 1
