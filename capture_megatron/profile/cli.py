"""`capture-megatron profile <Megatron model flags> --device {cpu,cuda,fake} --out records.jsonl`.

Probes the model's own sizes (anchors: exact predictions later) at the TP sizes and micro-batch sizes
asked for, and by default a design of small shapes on which every regression term is identifiable,
for each variant (recompute / sequence-parallel setting) asked for.
"""
from __future__ import annotations

import time

from capture_megatron.errors import CaptureError
from capture_megatron.megatron import args as margs
from capture_megatron.megatron import flags
from capture_megatron.profile.requests import model_probes, model_variant
from capture_megatron.profile.records import write_records


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CaptureError(f"{what} {text!r}: expected comma-separated integers")
    if not values or min(values) < 1:
        raise CaptureError(f"{what} {text!r}: expected positive integers")
    return values


def build_parser() -> flags.FlagParser:
    """Model flags plus the profile command's own."""
    p = flags.FlagParser(prog="capture-megatron profile", description=__doc__.splitlines()[0])
    flags.add_model_flags(p)
    flags.add_parallel_flags(p)
    g = p.add_argument_group("profiling")
    g.add_argument("--device", default="cpu", help="cpu, cuda or fake")
    g.add_argument("--out", required=True, help="records file (JSON lines)")
    g.add_argument("--probe-tp", default="", help="TP sizes to probe (default: --tensor-model-parallel-size or 1)")
    g.add_argument("--probe-micro-batch-sizes", default="", help="default: --micro-batch-size or 1")
    g.add_argument("--variants", choices=["model", "all"], default="model",
                   help="model: the flags' recompute/SP setting; all: none/selective/full x SP on/off")
    g.add_argument("--no-design", action="store_true", help="probe only the model's own sizes (fast)")
    g.add_argument("--no-timelines", action="store_true",
                   help="do not record allocation timelines (cpu/fake; without them `fit` regresses transient "
                        "peaks instead of replaying them)")
    g.add_argument("--no-progress", action="store_true")
    return p


def variants_for(ns, shape) -> list:
    """The variants to profile."""
    if ns.variants == "all":
        return [model_variant(shape, rc, sp) for rc in ("none", "selective", "full") for sp in (False, True)]
    rc = ns.recompute_granularity or ("selective" if ns.recompute_activations else "none")
    if ns.recompute_num_layers_per_stage:
        rc = "full"
    return [model_variant(shape, rc, bool(ns.sequence_parallel))]


def main(argv: list[str]) -> int:
    """Entry point; returns the exit code."""
    from capture_megatron.profile.session import check_device, run_probes

    ns = flags.parse_flags(build_parser(), argv)
    check_device(ns.device)
    shape = margs.model_shape(ns)
    tps = _ints(ns.probe_tp, "--probe-tp") if ns.probe_tp else [ns.tensor_model_parallel_size or 1]
    mbs = (_ints(ns.probe_micro_batch_sizes, "--probe-micro-batch-sizes") if ns.probe_micro_batch_sizes
           else [ns.micro_batch_size or 1])
    probes = model_probes(shape, variants_for(ns, shape), tps, mbs, design=not ns.no_design)
    if not probes:
        raise CaptureError(f"no probe fits: TP sizes {tps} do not divide heads {shape.num_attention_heads} / "
                           f"groups {shape.groups} / ffn {shape.ffn} (or SP needs TP > 1)")
    start = time.perf_counter()
    records = run_probes(probes, ns.device, ns.transformer_impl, progress=not ns.no_progress,
                         timelines=not ns.no_timelines and ns.device != "cuda")
    write_records(records, ns.out)
    print(f"profiled {len(records)} probes on {ns.device} ({records[0].transformer_impl} spec) in "
          f"{time.perf_counter() - start:.1f} s -> {ns.out}")
    return 0
