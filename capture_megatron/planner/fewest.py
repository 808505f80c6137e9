"""One model's search over clusters of different sizes: the fewest GPUs on which a plan fits
(min-gpus) and the smallest fitting setup a no-fit error names. Pure Python."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from capture_megatron.config import GIB, Cluster, ModelShape, ParallelPlan
from capture_megatron.errors import CaptureError
from capture_megatron.forecast.fsdp import moments_note
from capture_megatron.planner.balance import host_overflow
from capture_megatron.planner.margins import Margins
from capture_megatron.planner.offload_space import offloaded
from capture_megatron.planner.search import Evaluated, search, undominated
from capture_megatron.planner.space import Space, candidates
from capture_megatron.planner.supply import Supply
from capture_megatron.steptime.model import CostModel


@dataclass(frozen=True)
class ClusterSearch:
    """One model's search over clusters of different sizes (for min-gpus and no-fit messages)."""

    supply: Supply
    """The memory model, grown on demand."""
    shape: ModelShape
    """The model planned."""
    cluster: Cluster
    """The cluster asked for (its GPU count is the most tried)."""
    gbs: int
    """The global batch, the same on any number of GPUs."""
    space: Space
    """What the search may choose."""
    margins: Margins
    """The allocator / CUDA context margins."""
    hw: CostModel
    """The step-time model."""
    low_precision: tuple[bool, bool] = (False, False)
    """(Kernels.low_precision: activations of 1 byte; Kernels.low_precision_params: parameters of
    1 byte), for the search's memory floor."""

    def run(self, cluster: Cluster, objective: str, top: int) -> tuple[tuple[Evaluated, ...], int]:
        """(ranked plans, candidates considered) on `cluster`."""
        found = search(
            self.supply,
            self.shape,
            cluster,
            self.gbs,
            self.space,
            objective,
            self.margins,
            self.hw,
            top=top,
            low_precision=self.low_precision,
        )
        return found.ranked, found.considered

    def best(self, objective: str, top: int) -> tuple[tuple[Evaluated, ...], int]:
        """(ranked plans, candidates considered) for the objective on the whole cluster; min-gpus
        keeps the plan of the fewest GPUs that fit (CaptureError when none does)."""
        if objective != "min-gpus":
            return self.run(self.cluster, objective, top)
        found = self.smallest_fit(self.cluster.gpus)
        if found is None:
            raise self.no_fit(self.run(self.cluster, "min-peak", 1)[0][0])
        # on the fewest GPUs, the fastest plan that fits (not the min-peak one that proved it)
        fastest = self.run(dataclasses.replace(self.cluster, gpus=found[0]), "throughput", top)
        return fastest if fastest[0] and fastest[0][0].fits else ((found[1],), 1)

    def smallest_fit(self, limit: int) -> tuple[int, Evaluated] | None:
        """(gpus, plan) of the fewest GPUs up to `limit` on which some plan fits, else None."""
        counts = gpu_counts(self.cluster, limit)
        clusters = [dataclasses.replace(self.cluster, gpus=n) for n in counts]
        self.supply.complete(  # every pair these min-peak searches need, in one round
            p
            for c in clusters
            for p in undominated(list(candidates(self.shape, c, self.gbs, self.space)))
        )
        for n in counts:
            ranked, _ = self.run(dataclasses.replace(self.cluster, gpus=n), "min-peak", 1)
            if ranked and ranked[0].fits:
                return n, ranked[0]
        return None

    def no_fit(self, best: Evaluated) -> CaptureError:
        """The error when no plan fits: what the best needs and the smallest setup that fits."""
        cluster = self.cluster
        if self.margins.needed(0.0) >= cluster.gpu_memory_bytes:
            return CaptureError(
                f"no plan fits {cluster.gpu_memory_bytes / GIB:g} GiB per GPU: the CUDA "
                f"context and allocator margin alone take {self.margins.needed(0.0) / GIB:.1f} "
                "GiB (--context-gib)"
            )
        limit = max(64 * cluster.gpus, 64)
        found = self.smallest_fit(limit)
        if found:
            p = found[1].plan
            where = (
                f"the smallest fitting setup is {found[0]} GPUs at {found[1].needed / GIB:.1f} GiB "
                f"(TP {p.tp}, PP {p.pp}, DP {p.dp}, VPP {p.vpp}, micro-batch {p.micro_batch_size}, "
                f"recompute {p.recompute.granularity}{offload_words(p)})"
            )
        else:
            where = f"none fits on up to {limit} GPUs either"
        moments = moments_note(best.plan, cluster.device != "cpu")
        return CaptureError(
            f"no plan fits {cluster.gpu_memory_bytes / GIB:g} GiB on {cluster.gpus} GPUs (best "
            f"needs {best.needed / GIB:.1f} GiB per GPU"
            f"{host_overflow(best, cluster, self.hw.hardware.host_memory_bytes)}); {where}"
            + (f". {moments[0].upper()}{moments[1:]}" if moments else "")
        )


def gpu_counts(cluster: Cluster, limit: int) -> list[int]:
    """GPU counts min-gpus tries: 1..gpus_per_node, then whole nodes up to `limit`."""
    small = list(range(1, min(cluster.gpus_per_node, limit) + 1))
    return small + list(range(2 * cluster.gpus_per_node, limit + 1, cluster.gpus_per_node))


def offload_words(plan: ParallelPlan) -> str:
    """', optimizer offload 0.5, activation offload of core_attn, attn_proj' for what the plan
    offloads ('' when nothing)."""
    out = f", optimizer offload {offloaded(plan):g}" if offloaded(plan) else ""
    groups = plan.ddp.activation_offload.groups
    return out + (f", activation offload of {', '.join(groups)}" if groups else "")
