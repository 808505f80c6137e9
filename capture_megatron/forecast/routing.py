"""The routing imbalance a dropless MoE forecast assumes (pure Python).

Dropless routing sends each expert as many tokens as the router picks, so the bytes of a rank's
experts follow the most tokens any expert-parallel rank receives. The forecast assumes every
expert padded to `factor` x its balanced share (capture_megatron.forecast.support.experts_probe):
- given: --moe-imbalance-factor F (capped at the worst case);
- balanced (factor 1): --moe-router-force-load-balancing (megatron-core routes by random
  logits), and EP 1 (a rank's experts receive every token's top-k choices, whatever the routing);
- else the routing statistics measured on the CPU (moe_routing.json, written by
  bench/moe_routing.py): the expected max over EP ranks of received / balanced tokens,
      factor = 1 + sigma * M(ep),  sigma^2 = s^2 (E - L) / (L (E - 1)) + rho (ep - 1) / (D k),
  for E experts, top-k k, L = E / ep local experts and D tokens routed per micro-batch in the
  EP group: s is the measured spread of an expert's expected load (relative to its balanced
  share) and rho the measured over-dispersion of token counts (1: independent tokens) of the
  measured run closest in load balancing, coefficient and experts; M(ep) the expected maximum
  of ep zero-sum normal deviates. The planning factor, against which `plan` checks a plan fits,
  is the same with the 95th percentile in place of M: the forecast plus the measured spread.
Both are rounded up to 0.05 (each value is a variant profiled apart) and capped at the worst case
(experts / top-k: every token of an expert's ranks routed to it), which stays beside them.

Which statistics: a router trains only as fast as its learning rate lets it. A run whose learning
rate summed over its iterations (`lr_sum`, from a pasted command line's --train-iters and
schedule: Experts.router_lr_sum) stays at most initial_lr_sum() routes much as its routers were
initialised: its statistics are those measured with routers left as initialised on GPT-2 BPE
tokens (the file's `initial` runs, `bench/moe_routing.py --at-init`), the nearest in experts and
top-k, the spread grown as the bench's early steps measured it at the same sum (`drift`, the
file's `early` curves, without balancing and with an aux loss). Any other run, and every plan
(whose length is not given), takes the trained statistics above.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from dataclasses import dataclass
from statistics import NormalDist

from capture_megatron.config import ModelShape, ParallelPlan
from capture_megatron.features.moe import Experts

STATISTICS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "moe_routing.json")
"""The routing statistics shipped with the package (bench/moe_routing.py writes them)."""
QUANTILE = 0.95
"""The planning factor's quantile of a layer's max-over-ranks imbalance."""
STEP = 0.05
"""Factors are rounded up to a multiple of this."""
CASES = ("forecast", "planning", "bound")
"""Which factor a prediction uses (Experts.routing_case)."""


@dataclass(frozen=True)
class RoutingFactor:
    """The imbalance factors of one (model, plan): tokens an expert receives / its balanced
    share."""

    forecast: float
    """What the run is expected to hold: the default forecast."""
    planning: float
    """The forecast plus its margin: what `plan` checks a plan fits against."""
    bound: float
    """The worst case: every token of an expert's ranks routed to it (experts / top-k)."""
    basis: str
    """given, balanced, statistics or worst (no statistics apply)."""
    source: str
    """Where the forecast comes from, in words."""

    def __post_init__(self) -> None:
        if not 1.0 <= self.forecast <= self.planning <= self.bound + 1e-9:
            raise ValueError(f"routing factors out of order: {self}")

    def of(self, case: str) -> float:
        """The factor of a case (forecast, planning or bound)."""
        return {"forecast": self.forecast, "planning": self.planning, "bound": self.bound}[case]


@dataclass(frozen=True)
class RunStatistics:
    """One measured run's routing statistics (a row of moe_routing.json)."""

    name: str
    """The run's name in bench/moe_routing.py."""
    num_experts: int
    """Experts per MoE layer."""
    topk: int
    """Experts per token."""
    balancing: str
    """Megatron's --moe-router-load-balancing-type (none: aux loss with coefficient 0; initial:
    routers left as initialised, whatever their balancing)."""
    coeff: float
    """--moe-aux-loss-coeff."""
    spread: float
    """s: the standard deviation of an expert's expected load over its balanced share, minus 1
    (the largest over the run's phases)."""
    overdispersion: float
    """rho: variance of an expert's token count per sequence over the multinomial variance of
    independent tokens (the largest over the run's phases)."""


@functools.cache
def _shipped() -> dict:
    with open(STATISTICS) as f:
        return json.load(f)


def _rows(rows: list[dict]) -> tuple[RunStatistics, ...]:
    keys = RunStatistics.__dataclass_fields__
    return tuple(RunStatistics(**{k: r[k] for k in keys}) for r in rows)


@functools.cache
def statistics() -> tuple[tuple[RunStatistics, ...], str]:
    """The shipped runs of trained routers and their provenance."""
    return _rows(_shipped()["runs"]), _shipped()["source"]


@functools.cache
def initial_statistics() -> tuple[RunStatistics, ...]:
    """The shipped runs with routers left as initialised (empty when none are shipped)."""
    return _rows(_shipped().get("initial", []))


def lr_sum(lr: float, warmup: float, iterations: int) -> float:
    """The learning rate summed over a run's iterations under Megatron's schedule: iteration i
    (from 1) steps at lr x (i - 1) / warmup during the linear warm-up from 0 (the scheduler is
    stepped after each iteration), then at most lr (any decay counted at the peak: an upper
    bound)."""
    if warmup <= 0:
        return lr * iterations
    ramp = min(iterations, int(warmup) + 1)
    return lr * (ramp * (ramp - 1) / 2 / warmup + (iterations - ramp))


def initial_lr_sum() -> float:
    """The most a run's learning rate may sum to over its iterations for its routers to count as
    early (the shipped file's `initial_lr_sum`: where the early steps' spread without balancing
    reaches the trained routers' spread; 0 when none is shipped)."""
    return float(_shipped().get("initial_lr_sum", 0.0))


def drift(balancing: str, total: float) -> float:
    """How far the spread has grown over the routers' initial spread once the learning rate has
    summed to `total`: the shipped early steps of the regime (none, or aux for any balancing),
    the largest so far, linearly interpolated between steps."""
    curves = _shipped().get("early", {})
    curve = curves.get("none" if balancing == "none" else "aux", [])
    best, (at, rel) = 1.0, (0.0, 1.0)
    for point, value in curve:
        if point > total:
            share = (total - at) / (point - at) if point > at else 0.0
            return max(best, rel + (value - rel) * share)
        best, at, rel = max(best, value), point, value
    return best


def _initial_run(moe: Experts) -> RunStatistics | None:
    """The run with routers as initialised nearest in experts (log) and top-k, its spread grown
    by `drift`, when the run's learning rate sums to at most initial_lr_sum(); else None."""
    runs = initial_statistics()
    total = moe.router_lr_sum
    if total is None or total > initial_lr_sum() or not runs:
        return None
    near = min(
        runs,
        key=lambda r: (abs(math.log2(r.num_experts) - math.log2(moe.num_experts)),
                       abs(r.topk - moe.moe_router_topk)),
    )  # fmt: skip
    return dataclasses.replace(near, spread=near.spread * drift(regime(moe), total))


def regime(moe: Experts) -> str:
    """sinkhorn, none (no load balancing) or aux (an aux loss balances the load)."""
    if moe.moe_router_load_balancing_type == "sinkhorn":
        return "sinkhorn"
    if moe.moe_router_load_balancing_type == "none" or moe.moe_aux_loss_coeff <= 0:
        return "none"
    return "aux"


def nearest_run(moe: Experts) -> RunStatistics:
    """The measured run of the same load-balancing regime closest in aux-loss coefficient (log)
    and experts (log), then top-k."""
    runs, _ = statistics()
    same = [r for r in runs if regime_of_run(r) == regime(moe)] or list(runs)

    def distance(r: RunStatistics) -> tuple[float, float, float]:
        coeff = abs(math.log10(max(r.coeff, 1e-9)) - math.log10(max(moe.moe_aux_loss_coeff, 1e-9)))
        return (
            round(coeff, 3),
            abs(math.log2(r.num_experts) - math.log2(moe.num_experts)),
            abs(r.topk - moe.moe_router_topk),
        )

    return min(same, key=distance)


def regime_of_run(run: RunStatistics) -> str:
    """The load-balancing regime a measured run represents."""
    if run.balancing == "sinkhorn":
        return "sinkhorn"
    return "none" if run.balancing == "none" or run.coeff <= 0 else "aux"


@functools.cache
def max_deviate(ep: int) -> tuple[float, float]:
    """(expected value, QUANTILE) of the largest of `ep` zero-sum normal deviates of unit
    standard deviation (ep independent standard normals minus their mean, scaled to unit
    variance): the largest rank's load, in standard deviations."""
    if ep < 2:
        return 0.0, 0.0
    nd = NormalDist()
    scale = 1.0 / math.sqrt(1.0 - 1.0 / ep)
    n, lo, hi = 4000, -8.0, 8.0
    dx = (hi - lo) / n
    # E[max of ep iid normals] = integral of x d(Phi^ep); the mean term of the zero-sum form
    # has expectation 0
    mean = sum(
        (lo + (i + 0.5) * dx)
        * ep
        * nd.pdf(lo + (i + 0.5) * dx)
        * nd.cdf(lo + (i + 0.5) * dx) ** (ep - 1)
        * dx
        for i in range(n)
    )
    # the quantile of the zero-sum maximum: that of ep independent normals' maximum (subtracting
    # the mean and rescaling to unit variance cancel, within 0.01 for ep >= 2)
    return mean * scale, nd.inv_cdf(QUANTILE ** (1.0 / ep))


def group_tokens(shape: ModelShape, plan: ParallelPlan) -> float:
    """Tokens routed per micro-batch in one expert-parallel group: each of its ep x etp ranks
    routes its micro-batch's share of the sequence (split over TP and CP)."""
    local = plan.micro_batch_size * shape.seq_length / (plan.tp * plan.cp)
    return local * plan.ep * plan.expert_tp


def _round_up(x: float) -> float:
    return round(math.ceil(round(x / STEP, 6)) * STEP, 2)


def measured_sigma(run: RunStatistics, e: int, k: int, ep: int, tokens: float) -> float:
    """The relative standard deviation of an EP rank's received tokens (formula above) for `e`
    experts, top-k `k`, EP size `ep` and `tokens` routed in the EP group."""
    local = e // ep
    systematic = run.spread**2 * (e - local) / (local * (e - 1)) if e > 1 else 0.0
    noise = run.overdispersion * (ep - 1) / (tokens * k)
    return math.sqrt(systematic + noise)


def routing_factor(shape: ModelShape, plan: ParallelPlan) -> RoutingFactor:
    """The imbalance factors of a dropless MoE model split as `plan` says."""
    moe = shape.moe
    bound = moe.num_experts / moe.moe_router_topk
    if moe.moe_imbalance_factor:
        f = min(moe.moe_imbalance_factor, bound)
        return RoutingFactor(f, f, bound, "given", "--moe-imbalance-factor")
    if moe.moe_router_force_load_balancing:
        why = "--moe-router-force-load-balancing (megatron-core routes by random logits)"
        return RoutingFactor(1.0, 1.0, bound, "balanced", why)
    if plan.ep == 1:
        why = "EP 1: a rank's experts receive every top-k choice of its tokens"
        return RoutingFactor(1.0, 1.0, bound, "balanced", why)
    early = _initial_run(moe)
    run = early or nearest_run(moe)
    tokens = group_tokens(shape, plan)
    sigma = measured_sigma(run, moe.num_experts, moe.moe_router_topk, plan.ep, tokens)
    mean, high = max_deviate(plan.ep)
    forecast = min(_round_up(1.0 + sigma * mean), bound)
    planning = min(max(_round_up(1.0 + sigma * high), forecast), bound)
    source = f"routing statistics measured on the CPU, run {run.name} (bench/moe_routing.py)"
    if early is not None:
        source = (
            f"routing statistics measured on the CPU with routers as initialised, run {run.name} "
            f"(bench/moe_routing.py --at-init): the run's learning rate sums to "
            f"{moe.router_lr_sum:.3g} over its iterations, at most {initial_lr_sum():.3g}, so its "
            "routers route much as initialised (spread grown as the early steps measured)"
        )
    return RoutingFactor(forecast, planning, bound, "statistics", source)
