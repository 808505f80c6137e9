"""Analysis of bench/moe_routing.py's runs: the statistics of capture_megatron/forecast/routing.py
from per-sequence routing counts, and the check of its formula against the imbalance measured
directly.

Per run, training phase (a fifth of its steps) and MoE layer, from the counts c[step][sequence]
[expert] (top-k assignments of each sequence's tokens):
- the spread s: the standard deviation over experts of an expert's expected load in a step
  (its share of the step's assignments x experts, minus 1), less the part sampling noise
  explains; the root mean square over layers;
- the over-dispersion rho: the variance of a sequence's count around the step's expected count
  over the multinomial variance of independent tokens (n k mu (1 - mu)).
The shipped value of each is the largest over the balanced phases: the last BALANCED of the run's
PHASES phases, once the load balancing has evened out the routing of the first steps (the earlier
phases are kept in the file, and the report shows them: training progress).

Measured directly: for EP size ep and n sequences per rank, the step's sequences are grouped into
EP groups of ep x n; rank r holds experts [r E/ep, (r+1) E/ep) (Megatron's placement), and the
factor is the largest rank's assignments over the group's mean per rank. Mean and 95th percentile
over the balanced phases' steps, layers and groups against the formula's forecast and planning
factors.
"""

from __future__ import annotations

import json
import os

import numpy as np

from capture_megatron.forecast.routing import QUANTILE, RunStatistics, max_deviate, measured_sigma

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(ROOT, "capture_megatron", "forecast", "moe_routing.json")
RESULTS = os.path.join(ROOT, "bench", "results", "moe_routing.json")
PHASES = 5
"""Training phases per run (equal numbers of steps)."""
BALANCED = 2
"""The last phases, whose statistics are shipped."""


def counts(run: dict) -> np.ndarray:
    """c[step, layer, sequence, expert] of the run's one rank."""
    (rank,) = run["ranks"]
    layers = [str(n) for n in rank["layers"]]
    return np.array([[s[n]["sequences"] for n in layers] for s in rank["steps"]], dtype=np.float64)


def phase_statistics(c: np.ndarray, topk: int) -> tuple[float, float]:
    """(spread s, over-dispersion rho) of c[step, layer, sequence, expert]."""
    steps, layers, seqs, experts = c.shape
    n = c.sum(axis=3, keepdims=True) / topk  # tokens per sequence
    mu = c.sum(axis=2, keepdims=True) / c.sum(axis=(2, 3), keepdims=True)  # step's shares
    expected = n * topk * mu
    binom = n * topk * mu * (1 - mu)
    rho = float(((c - expected) ** 2).sum() / binom.sum()) * seqs / (seqs - 1)
    dev = experts * mu[:, :, 0, :] - 1  # [step, layer, expert]
    tokens = n.sum(axis=2)[:, :, 0]  # tokens per step and layer
    noise = rho * (experts - 1) / (tokens * topk)
    s2 = np.clip(dev.var(axis=2) - noise, 0, None)  # [step, layer]
    return float(np.sqrt(s2.mean())), rho


def measured_factors(c: np.ndarray, ep: int, per_rank: int) -> np.ndarray:
    """The max-over-ranks factor of every (step, layer, EP group)."""
    steps, layers, seqs, experts = c.shape
    group = ep * per_rank
    g = seqs // group
    grouped = c[:, :, : g * group].reshape(steps, layers, g, group, experts).sum(axis=3)
    ranks = grouped.reshape(steps, layers, g, ep, experts // ep).sum(axis=4)
    return (ranks.max(axis=3) / ranks.mean(axis=3)).reshape(-1)


def _stats_of(name: str, run: dict, c: np.ndarray) -> tuple[RunStatistics, list[dict]]:
    shape = run["shape"]
    moe = shape["moe"]
    topk, experts = moe["moe_router_topk"], moe["num_experts"]
    bounds = np.linspace(0, c.shape[0], PHASES + 1).astype(int)
    phases = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        s, rho = phase_statistics(c[a:b], topk)
        loss = float(np.mean(run["losses"][a:b]))
        phases.append(
            {"steps": [int(a) + 1, int(b)], "spread": s, "overdispersion": rho, "loss": loss}
        )
    balancing = moe["moe_router_load_balancing_type"]
    coeff = moe["moe_aux_loss_coeff"]
    if balancing != "sinkhorn" and coeff <= 0:
        balancing = "none"
    stats = RunStatistics(
        name=name,
        num_experts=experts,
        topk=topk,
        balancing=balancing,
        coeff=coeff,
        spread=max(p["spread"] for p in phases[-BALANCED:]),
        overdispersion=max(p["overdispersion"] for p in phases[-BALANCED:]),
    )
    return stats, phases


def balanced_steps(c: np.ndarray) -> np.ndarray:
    """The steps of the balanced phases."""
    bounds = np.linspace(0, c.shape[0], PHASES + 1).astype(int)
    return c[bounds[PHASES - BALANCED] :]


def _check(stats: RunStatistics, c: np.ndarray, seq: int) -> list[dict]:
    """Measured vs formula at every EP size and sequences per rank the run's steps allow."""
    rows = []
    ep = 2
    while ep <= stats.num_experts and ep <= c.shape[2]:
        n = 1
        while ep * n <= c.shape[2]:
            got = measured_factors(c, ep, n)
            sigma = measured_sigma(stats, stats.num_experts, stats.topk, ep, float(ep * n * seq))
            mean, high = max_deviate(ep)
            rows.append(
                {
                    "run": stats.name,
                    "ep": ep,
                    "tokens": ep * n * seq,
                    "measured_mean": float(got.mean()),
                    "measured_p95": float(np.quantile(got, QUANTILE)),
                    "measured_max": float(got.max()),
                    "forecast": 1 + sigma * mean,
                    "planning": 1 + sigma * high,
                    "samples": int(got.size),
                }
            )
            n *= 2
        ep *= 2
    return rows


def analyse(runs: dict[str, dict], steps: int) -> None:
    """Write the shipped statistics and the benchmark results; print the check."""
    shipped, checks, progress = [], [], {}
    tokens = 0
    for name, run in runs.items():
        c = counts(run)
        stats, phases = _stats_of(name, run, c)
        shipped.append({**stats.__dict__, "phases": phases, "argv": " ".join(run["argv"])})
        progress[name] = phases
        checks += _check(stats, balanced_steps(c), run["shape"]["seq_length"])
        tokens += int(c[:, 0].sum() / stats.topk)
    first = steps - steps * BALANCED // PHASES + 1
    source = (
        f"measured on the CPU by bench/moe_routing.py: {len(runs)} runs of a 4-layer GPT "
        f"(h 128, megatron-core MoE layers) trained {steps} steps each on Python docstrings "
        f"(byte tokens), {tokens / 1e6:.1f}M tokens routed per layer in all; statistics of "
        f"steps {first}-{steps}, once the load balancing has evened out the first steps"
    )
    with open(SHIPPED) as f:  # the --at-init sections (initial, early) stay as they are
        kept = {k: v for k, v in json.load(f).items() if k not in ("source", "quantile", "runs")}
    data = {"source": source, "quantile": QUANTILE, "runs": shipped, **kept}
    with open(SHIPPED, "w") as f:
        json.dump(data, f, indent=1)
    with open(RESULTS, "w") as f:
        json.dump({"source": source, "runs": shipped, "checks": checks}, f, indent=1)
    for r in checks:
        print(
            f"{r['run']:18s} ep {r['ep']:3d} tokens {r['tokens']:6d}: measured mean "
            f"{r['measured_mean']:.3f} p95 {r['measured_p95']:.3f} | formula {r['forecast']:.3f} "
            f"/ {r['planning']:.3f}"
        )
    for s in shipped:
        print(f"{s['name']}: spread {s['spread']:.3f} overdispersion {s['overdispersion']:.2f}")


def analyse_at_init(runs: dict[str, dict], out: str) -> None:
    """Routing at initialisation (runs at a learning rate that leaves the router where it was
    initialised): per run and tokenizer, the spread, the over-dispersion, per layer the spread,
    and the formula's forecast factor for EP 8 of 8 experts at 4 sequences of 1,024 tokens a
    rank (Megatron-LM's EP 8 functional tests); written to `out`, not to the shipped statistics."""
    rows = []
    for name, run in runs.items():
        c = counts(run)
        topk = run["shape"]["moe"]["moe_router_topk"]
        experts = run["shape"]["moe"]["num_experts"]
        s, rho = phase_statistics(c, topk)
        layers = [phase_statistics(c[:, i : i + 1], topk)[0] for i in range(c.shape[1])]
        stats = RunStatistics(name, experts, topk, "none", 0.0, s, rho)
        sigma = measured_sigma(stats, experts, topk, 8, 8 * 4 * 1024.0) if experts >= 8 else 0.0
        factor = 1 + sigma * max_deviate(8)[0]
        rows.append(
            {"run": name, "tokenizer": run.get("tokenizer", "byte"), "steps": int(c.shape[0]),
             "spread": s, "overdispersion": rho, "layer_spread": layers, "ep8_forecast": factor}
        )  # fmt: skip
        print(
            f"{name}: spread {s:.3f} (layers {' '.join(f'{x:.2f}' for x in layers)}), "
            f"overdispersion {rho:.1f}, EP 8 forecast factor {factor:.2f}"
        )
    with open(out, "w") as f:
        json.dump({"runs": rows}, f, indent=1)


def ship_initial(runs: dict[str, dict], steps: int) -> None:
    """Write the runs' statistics (routers as initialised, GPT-2 BPE tokens) as the shipped
    file's `initial` runs, keeping its trained ones."""
    shipped = []
    for name, run in runs.items():
        c = counts(run)
        moe = run["shape"]["moe"]
        s, rho = phase_statistics(c, moe["moe_router_topk"])
        stats = RunStatistics(
            name, moe["num_experts"], moe["moe_router_topk"], "initial", 0.0, s, rho
        )
        shipped.append({**stats.__dict__, "argv": " ".join(run["argv"])})
    with open(SHIPPED) as f:
        data = json.load(f)
    data["initial"] = shipped
    data["initial_source"] = (
        f"measured on the CPU by bench/moe_routing.py --at-init: {len(runs)} runs of the same "
        f"4-layer GPT at learning rate 1e-9 (routers left as initialised), {steps} steps each on "
        "the same Python docstrings as GPT-2 BPE tokens; statistics of every step"
    )
    with open(SHIPPED, "w") as f:
        json.dump(data, f, indent=1)


def early_curve(run: dict, lr: float, warmup: int) -> list[dict]:
    """Per step of a run at the bench's own schedule (linear warm-up from 0 over `warmup`
    iterations to `lr`): the learning rate summed when the step ran (forecast.routing.lr_sum of
    the steps before it and its own) and the step's spread."""
    from capture_megatron.forecast.routing import lr_sum

    c = counts(run)
    topk = run["shape"]["moe"]["moe_router_topk"]
    return [
        {"step": k + 1, "lr_sum": lr_sum(lr, warmup, k + 1),
         "spread": phase_statistics(c[k : k + 1], topk)[0]}
        for k in range(c.shape[0])
    ]  # fmt: skip


def ship_early(curves: dict[str, list[dict]], trained_none: float) -> float:
    """Write the early curves (per regime: [lr_sum, spread / the first step's]) and the sum up to
    which a run counts as early -- where the curve without balancing first reaches
    `trained_none`, the trained routers' spread without balancing (interpolated; the curve's
    last sum if it never does) -- into the shipped file; returns that sum."""
    early = {k: [[r["lr_sum"], r["spread"] / rows[0]["spread"]] for r in rows]
             for k, rows in curves.items()}  # fmt: skip
    rows = curves["none"]
    limit = rows[-1]["lr_sum"]
    for a, b in zip(rows, rows[1:]):
        if b["spread"] >= trained_none > a["spread"]:
            share = (trained_none - a["spread"]) / (b["spread"] - a["spread"])
            limit = a["lr_sum"] + share * (b["lr_sum"] - a["lr_sum"])
            break
    with open(SHIPPED) as f:
        data = json.load(f)
    data["early"], data["initial_lr_sum"] = early, limit
    with open(SHIPPED, "w") as f:
        json.dump(data, f, indent=1)
    return limit
