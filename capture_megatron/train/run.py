"""A whole training run on one rank: set up, resume, iterate, checkpoint, report memory."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from capture_megatron.config import TrainConfig
from capture_megatron.emulate import cpu_compat
from capture_megatron.megatron import moe
from capture_megatron.megatron.backend import Backend
from capture_megatron.megatron.quiet import kernels_line
from capture_megatron.serial import writable
from capture_megatron.train.checkpoint.directory import iteration_dir
from capture_megatron.train.dist_env import DistEnv, init_distributed, is_logging_rank
from capture_megatron.train.exit_signal import ExitSignal
from capture_megatron.train.refusals import refuse_cpu_state, refuse_untrained
from capture_megatron.train.report import IterationStats, MemoryReport, RankMemory

if TYPE_CHECKING:
    from capture_megatron.megatron.training import Batch
    from capture_megatron.memory.meter import MemoryMeter
    from capture_megatron.train.loop import OnStep
    from capture_megatron.train.routing import RoutingRecorder
    from capture_megatron.train.trainer import Trainer


class PeakWindow:
    """The meter's peak over training iterations only: checkpoint saves are excluded."""

    def __init__(self, meter: MemoryMeter) -> None:
        self.meter = meter
        self.carried = 0

    def pause(self) -> None:
        """Remember the peak so far (call before a save)."""
        self.carried = max(self.carried, self.meter.peak())

    def resume(self) -> None:
        """Forget what the save allocated (call after it)."""
        self.meter.reset_peak()

    def peak(self) -> int:
        """Peak over the iterations so far."""
        return max(self.carried, self.meter.peak())


def _layers_held(trainer: Trainer) -> tuple[int, ...]:
    """Global 1-based numbers of the transformer layers in this rank's chunks."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return tuple(
        sorted(
            m.layer_number
            for chunk in trainer.model
            for m in chunk.modules()
            if isinstance(m, TransformerLayer)
        )
    )


def _gather_report(
    cfg: TrainConfig, device: str, impl: str, mine: RankMemory, stats: list[IterationStats]
) -> MemoryReport:
    ranks: list[Any] = [None] * torch.distributed.get_world_size()  # all_gather_object fills it
    torch.distributed.all_gather_object(ranks, mine)
    return MemoryReport(
        device=device,
        transformer_impl=impl,
        shape=cfg.shape,
        plan=cfg.plan,
        ranks=tuple(ranks),
        iterations=tuple(stats),
    )


def print_peaks(report: MemoryReport) -> None:
    """Per-rank measured peak table on the console."""
    cp = report.plan.cp > 1
    print(f"measured peak memory per rank ({report.device}, {report.transformer_impl} spec):")
    ep = report.plan.ep > 1
    print(
        "  rank  pp  tp  dp"
        + ("  cp" if cp else "")
        + ("  ep" if ep else "")
        + "  layers       peak MiB"
    )
    for r in report.ranks:
        held = f"{r.layers[0]}-{r.layers[-1]}" if r.layers else "-"
        print(
            f"  {r.rank:4d} {r.pp_rank:3d} {r.tp_rank:3d} {r.dp_rank:3d}"
            + (f" {r.cp_rank:3d}" if cp else "")
            + (f" {r.ep_rank:3d}" if ep else "")
            + f"  {held:10s} {r.peak_bytes / 2**20:10.2f}"
        )


def _checkpoint_hook(
    cfg: TrainConfig,
    trainer: Trainer,
    window: PeakWindow,
    start: tuple[int, int],
    stop: ExitSignal | None = None,
) -> OnStep:
    """on_step for run_iterations: save at --save-interval, --exit-interval, the last iteration
    and when `stop` (an ExitSignal) was received; returns True to leave the loop."""
    from capture_megatron.train.checkpoint.save_load import save_checkpoint

    start_consumed, start_iter = start
    saved: set[int] = set()

    def on_step(it: int, final: bool = False) -> bool:
        interval, exit_iv = cfg.checkpoint.save_interval, cfg.run.exit_interval
        signalled = stop is not None and not final and stop.received()
        exiting = bool(exit_iv and it % exit_iv == 0) or signalled
        due = interval and it % interval == 0
        if (
            cfg.checkpoint.save
            and (due or exiting or final or it == cfg.run.train_iters)
            and it not in saved
        ):
            window.pause()
            consumed = start_consumed + (it - start_iter) * cfg.plan.global_batch_size
            path = save_checkpoint(cfg.checkpoint.save, it, trainer, cfg, consumed)
            window.resume()
            saved.add(it)
            if is_logging_rank():
                print(f"saved checkpoint {path}", flush=True)
        if signalled and stop is not None and is_logging_rank():
            print(
                f"{stop.signal.name} received: exiting after iteration {it} of "
                f"{cfg.run.train_iters}" + (" (checkpoint saved)" if cfg.checkpoint.save else ""),
                flush=True,
            )
        return exiting

    return on_step


def describe(cfg: TrainConfig, env: DistEnv) -> str:
    """The run's header line."""
    p = cfg.plan
    return (
        f"capture-megatron: {env.world_size} processes ({env.source}) | "
        f"TP {p.tp} PP {p.pp} DP {p.dp}"
        + (f" CP {p.cp}" if p.cp > 1 else "")
        + (f" VPP {p.vpp}" if p.vpp > 1 else "")
        + f" | layout {p.layout} | micro-batch "
        f"{p.micro_batch_size} x {p.num_microbatches} | {cfg.shape.dtype}"
    )


def train_iterators(cfg: TrainConfig, consumed: int, backend: Backend) -> list[Iterator[Batch]]:
    """This rank's training micro-batch iterators (one per chunk), after `consumed` samples; on a
    GPU each chunk's as Megatron-LM's get_batch hands them to its stage (megatron/gpu_batch.py)."""
    from megatron.core import parallel_state as ps

    from capture_megatron.megatron.gpu_batch import on_device
    from capture_megatron.train.data import build_train_iterators

    p = cfg.plan
    iterators = build_train_iterators(
        cfg.data,
        cfg.shape.seq_length,
        p.micro_batch_size,
        p.global_batch_size,
        cfg.run.train_iters,
        ps.get_data_parallel_rank(),
        p.dp,
        cfg.run.seed,
        consumed,
        p.vpp,
    )
    if backend.kind != "gpu":
        return iterators
    assert backend.kernels is not None
    mask = backend.kernels.create_attention_mask_in_dataloader
    return [
        on_device(
            it,
            cfg.shape,
            (
                ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=i),
                ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=i),
            ),
            mask,
        )
        for i, it in enumerate(iterators)
    ]


def _rank_memory(
    env: DistEnv, trainer: Trainer, window: PeakWindow, meter: MemoryMeter, setup_bytes: int
) -> RankMemory:
    """What this process measured."""
    from megatron.core import parallel_state as ps

    from capture_megatron.megatron.offload_placed import placed

    split = placed(trainer.optimizer)
    return RankMemory(
        rank=env.rank,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        peak_bytes=int(window.peak()),
        layers=_layers_held(trainer),
        setup_bytes=int(setup_bytes),
        reserved_bytes=int(meter.reserved()) if hasattr(meter, "reserved") else 0,
        cp_rank=ps.get_context_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        optimizer_device_bytes=split.device,
        optimizer_host_bytes=split.host,
    )


def _routing_recorder(cfg: TrainConfig, trainer: Trainer) -> RoutingRecorder | None:
    """A RoutingRecorder on this rank's chunks when --moe-routing-stats is given (else None)."""
    if not cfg.run.moe_routing_stats:
        return None
    from capture_megatron.train.routing import RoutingRecorder

    return RoutingRecorder(trainer.model, cfg.plan.micro_batch_size)


def _recording(on_step: OnStep, recorder: RoutingRecorder | None) -> OnStep:
    """on_step that first closes the recorder's step (on_step itself without a recorder)."""
    if recorder is None:
        return on_step

    def hook(it: int, final: bool = False) -> bool:
        if not final:
            recorder.step()
        return on_step(it, final)

    return hook


def _write_routing(
    cfg: TrainConfig, recorder: RoutingRecorder | None, stats: list[IterationStats]
) -> None:
    """Gather and write the routing statistics (rank 0 writes; nothing without a recorder)."""
    if recorder is None:
        return
    from capture_megatron.serial import to_plain
    from capture_megatron.train.routing import write_routing_stats

    recorder.close()
    header = {
        "shape": to_plain(cfg.shape),
        "plan": to_plain(cfg.plan),
        "data": to_plain(cfg.data),
        "seed": cfg.run.seed,
        "iterations": to_plain(tuple(stats)),
    }
    write_routing_stats(cfg.run.moe_routing_stats, recorder, header)
    if is_logging_rank():
        print(f"wrote MoE routing statistics to {cfg.run.moe_routing_stats}", flush=True)


def _refuse_on_cpu(cfg: TrainConfig, device: str) -> None:
    """CaptureError for what the CPU kernel set cannot train (MoE kernels, optimizer state), and
    what the trainer runs on no device (CUDA graphs)."""
    refuse_untrained(cfg)
    if device == "cpu":
        moe.refuse_on_cpu(cfg.shape)
        refuse_cpu_state(cfg)


def run_training(cfg: TrainConfig, env: DistEnv) -> MemoryReport:
    """Train `cfg` on this rank; rank 0 writes cfg.run.memory_report. Returns the gathered
    report."""
    from megatron.core import parallel_state as ps

    from capture_megatron.megatron.builder import resolve_impl
    from capture_megatron.megatron.extensions import gpu_kernels
    from capture_megatron.memory.meter import make_meter
    from capture_megatron.train.checkpoint.claim import claim

    device = "cuda" if torch.cuda.is_available() else "cpu"
    _refuse_on_cpu(cfg, device)
    stop = ExitSignal(cfg.run.exit_signal) if cfg.run.exit_signal_handler else None
    init_distributed(env, cfg.run.distributed_backend)
    cpu_compat.apply("cpu")
    meter = make_meter(device)
    impl = resolve_impl(cfg.kernels.transformer_impl)
    backend = Backend.of(device, gpu_kernels(cfg.kernels, impl) if device == "cuda" else None)
    if is_logging_rank():
        print(describe(cfg, env) + " | " + kernels_line(impl, device), flush=True)
    lock = claim(cfg)
    try:
        report = _train(cfg, env, device, impl, backend, meter, stop)
    finally:
        if lock is not None:
            lock.release()
    ps.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    return report


def _train(
    cfg: TrainConfig,
    env: DistEnv,
    device: str,
    impl: str,
    backend: Backend,
    meter: MemoryMeter,
    stop: ExitSignal | None,
) -> MemoryReport:
    """Resume, iterate, checkpoint and gather the memory report, holding --save's lock."""
    from capture_megatron.train.checkpoint.claim import start_point
    from capture_megatron.train.checkpoint.save_load import load_checkpoint
    from capture_megatron.train.loop import run_iterations
    from capture_megatron.train.trainer import build_trainer, init_parallel_state

    check_outputs(cfg)
    resume = start_point(cfg)
    init_parallel_state(cfg.plan, cfg.run.seed)
    trainer = build_trainer(
        cfg.shape, cfg.plan, cfg.optim, cfg.run, cfg.build, backend, cfg.checkpoint
    )
    loaded, start, consumed = cfg.checkpoint.load, 0, 0
    if resume.iteration is not None:
        start, consumed = load_checkpoint(cfg, trainer, resume.iteration)
    if start and is_logging_rank():
        print(f"resumed from checkpoint iteration {start} in {loaded}", flush=True)
    iterators = train_iterators(cfg, consumed, backend)
    setup_bytes = meter.current()
    meter.reset_peak()
    window = PeakWindow(meter)
    recorder = _routing_recorder(cfg, trainer)
    hook = _recording(_checkpoint_hook(cfg, trainer, window, (consumed, start), stop), recorder)
    stats = run_iterations(
        trainer,
        iterators,
        cfg.shape,
        cfg.plan,
        start,
        cfg.run.train_iters,
        cfg.run.log_interval,
        hook,
        progress=cfg.run.progress,
    )
    if start > 0 and not stats:
        _resave(cfg, hook, start)
    _write_routing(cfg, recorder, stats)
    mine = _rank_memory(env, trainer, window, meter, setup_bytes)
    report = _gather_report(cfg, device, impl, mine, stats)
    if is_logging_rank():
        print_peaks(report)
        if cfg.run.memory_report:
            report.write(cfg.run.memory_report)
    torch.distributed.barrier()
    return report


def _resave(cfg: TrainConfig, hook: OnStep, start: int) -> None:
    """Nothing left to train: save the loaded state again under this plan -- unless --save holds
    that iteration already (the --load directory itself), which is kept as it is."""
    save = cfg.checkpoint.save
    if save and os.path.isdir(iteration_dir(save, start)):
        if is_logging_rank():
            print(f"nothing to train: iteration {start} is already saved in {save}", flush=True)
        return
    hook(start, final=True)


def check_outputs(cfg: TrainConfig) -> None:
    """The files rank 0 writes at the end (--memory-report, --moe-routing-stats) can be written,
    checked before training (CaptureError on every rank alike)."""
    for flag, path in (
        ("--memory-report", cfg.run.memory_report),
        ("--moe-routing-stats", cfg.run.moe_routing_stats),
    ):
        if path:
            writable(flag, path)
