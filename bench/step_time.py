"""Calibrate the step-time model on published H100 step times, and report how well it holds out.

Fits the free constants of capture_megatron.steptime (constants.FITTED) to the development set
(bench/data/step_times_h100_dev.json: NVIDIA's DGX Cloud benchmarking recipes for GPT-3 175B and
Llama 3.1 8B / 70B / 405B, Megatron-LM's 7B *_memory_speed functional tests;
bench/data/step_times_h100_moe_dev.json: DeepSeek-V3 on 512 and 1024 GPUs), each row with the
settings its own recipe config used (bench/data/step_time_recipes.json). Least squares on the log
of estimated / measured, every model weighing the same. Reports each row in sample, the
leave-one-model-out and leave-one-family-out errors (the constants fitted without the model or
family, then its rows estimated; holding out DeepSeek-V3 leaves the MoE constant at its prior),
and whether the model orders every pair of rows with the same model and GPU count but a different
configuration as the measurements do. Held out, never read here: every other model NVIDIA or
Megatron-LM publish step times for (the held-out MoE measurements included).

Writes bench/results/step_time.json and the constants with their provenance into the package
(capture_megatron/steptime/constants.json).

    python bench/step_time.py
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import math
import os
import statistics

import numpy as np
from scipy.optimize import least_squares
from step_time_rows import DEV, MOE_DEV, RECIPES, Row, rows

from capture_megatron.steptime.breakdown import breakdown
from capture_megatron.steptime.constants import CONSTANTS_FILE, FITTED, Constants
from capture_megatron.steptime.model import CostModel, step_time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOUNDS = {
    "gemm_efficiency": (0.3, 1.0),
    "attention_efficiency": (0.15, 1.0),
    "elementwise_passes": (1.0, 80.0),
    "tp_overlap_exposed": (0.01, 1.0),
    "dp_overlap_exposed": (0.01, 1.0),
    "chunk_overhead": (1e-5, 0.02),
    "all_to_all_efficiency": (0.1, 1.0),
}
"""Physically meaningful ranges of the fitted constants."""
PRIOR_WEIGHT = 0.05
"""How much the priors weigh against the rows (a 1-sigma departure costs what a 5% error of one
whole model family costs)."""
PRIOR_WIDTH = {
    "gemm_efficiency": 0.1,
    "attention_efficiency": 0.3,
    "elementwise_passes": 0.5,
    "tp_overlap_exposed": 1.0,
    "dp_overlap_exposed": 1.0,
    "chunk_overhead": 1.0,
    "all_to_all_efficiency": 0.5,
}
"""Width (in log units) of each constant's prior around its default in Constants (the value from
first principles, docs/STEP_TIME.md): the fit is a maximum a posteriori estimate, so that a few
model families cannot trade one constant against another far from physics (e.g. GEMMs at 100% of
peak paid for by slow attention)."""


def estimate(row: Row, k: Constants) -> float:
    """The model's seconds per step for a row."""
    return step_time(row.shape, row.plan, CostModel(settings=row.settings, constants=k)).seconds


def fit(data: list[Row], start: Constants = Constants()) -> Constants:
    """The constants that minimise the squared log error, each model family weighing the same."""
    counts = {m: sum(r.model == m for r in data) for m in {r.model for r in data}}
    weights = np.array([1 / math.sqrt(counts[r.model]) for r in data])

    def constants(x: np.ndarray) -> Constants:
        return dataclasses.replace(start, **dict(zip(FITTED, map(float, x))))

    prior = np.array([getattr(Constants(), n) for n in FITTED])
    width = np.array([PRIOR_WIDTH[n] for n in FITTED])

    def residuals(x: np.ndarray) -> np.ndarray:
        k = constants(x)
        fit = weights * np.array([math.log(estimate(r, k) / r.measured) for r in data])
        return np.concatenate([fit, PRIOR_WEIGHT * np.log(x / prior) / width])

    x0 = np.array([getattr(start, n) for n in FITTED])
    lo, hi = zip(*(BOUNDS[n] for n in FITTED))
    found = least_squares(residuals, x0, bounds=(lo, hi), x_scale="jac")
    return constants(found.x)


def errors(data: list[Row], k: Constants) -> list[float]:
    """(estimated - measured) / measured per row."""
    return [estimate(r, k) / r.measured - 1 for r in data]


def leave_one_out(data: list[Row], key: str) -> dict[str, list[float]]:
    """Per model (`key` "model") or family ("family"): the errors of its rows under constants
    fitted without it."""
    out = {}
    for name in sorted({getattr(r, key) for r in data}):
        rest = [r for r in data if getattr(r, key) != name]
        held = [r for r in data if getattr(r, key) == name]
        out[name] = errors(held, fit(rest))
    return out


def pairs(data: list[Row], k: Constants) -> list[dict]:
    """Every pair of rows with the same model and GPU count but a different configuration, and
    whether the model orders them as measured."""
    out = []
    for i, a in enumerate(data):
        for b in data[i + 1 :]:
            same = a.model == b.model and a.plan.world_size == b.plan.world_size
            if not same or (a.plan, a.settings) == (b.plan, b.settings):
                continue
            ea, eb = estimate(a, k), estimate(b, k)
            out.append(
                {
                    "rows": [a.id, b.id],
                    "measured": [a.measured, b.measured],
                    "estimated": [ea, eb],
                    "agrees": (ea < eb) == (a.measured < b.measured),
                }
            )
    return out


def _sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def _by_row(data: list[Row], held: dict[str, list[float]], key: str) -> dict[str, float]:
    """The held-out error of each row id."""
    return {
        r.id: e
        for name, errs in held.items()
        for r, e in zip([x for x in data if getattr(x, key) == name], errs)
    }


def row_table(
    data: list[Row], k: Constants, held: dict[str, list[float]], family: dict[str, list[float]]
) -> list[dict]:
    """Each row: measured, estimated, in-sample and held-out errors, its breakdown."""
    lomo, lofo = _by_row(data, held, "model"), _by_row(data, family, "family")
    out = []
    for r in data:
        st = step_time(r.shape, r.plan, CostModel(settings=r.settings, constants=k))
        p = r.plan
        out.append(
            {
                "id": r.id, "model": r.model, "family": r.family, "moe": r.moe,
                "gpus": p.world_size,
                "config": f"TP{p.tp} PP{p.pp} VP{p.vpp} CP{p.cp} "
                + (f"EP{p.ep} " if p.ep > 1 else "")
                + f"DP{p.dp} mbs{p.micro_batch_size} gbs{p.global_batch_size}",
                "measured_s": r.measured, "estimated_s": st.seconds,
                "error": st.seconds / r.measured - 1, "lomo_error": lomo[r.id],
                "lofo_error": lofo[r.id], "breakdown": breakdown(st).as_dict(),
                "bubble_s": st.bubble, "data_parallel_s": st.data_parallel,
                "mfu": st.mfu, "tokens_per_s_per_gpu": st.tokens_per_s_per_gpu,
                "src": r.src, "recipe": r.recipe,
            }
        )  # fmt: skip
    return out


def _median(values: list[float]) -> float:
    """The median |error| (0 for none)."""
    return statistics.median(abs(e) for e in values) if values else 0.0


def summarize(
    data: list[Row],
    k: Constants,
    held: dict[str, list[float]],
    family: dict[str, list[float]],
    ordered: list[dict],
) -> dict:
    """In-sample and held-out errors, dense and MoE apart, and the pairs ordered as measured."""
    inside = errors(data, k)
    moe = {r.id for r in data if r.moe}
    lomo, lofo = _by_row(data, held, "model"), _by_row(data, family, "family")

    def part(values: dict[str, float] | list[float], is_moe: bool) -> list[float]:
        ids = [r.id for r in data if (r.id in moe) == is_moe]
        return (
            [values[i] for i in ids]
            if isinstance(values, dict)
            else [e for r, e in zip(data, values) if (r.id in moe) == is_moe]
        )

    dense_in, moe_in = part(inside, False), part(inside, True)
    return {
        "rows": len(data),
        "moe_rows": len(moe),
        "in_sample_median_abs_error": _median(dense_in),
        "in_sample_max_abs_error": max(abs(e) for e in dense_in),
        "moe_in_sample_errors": moe_in,
        "lomo_median_abs_error": _median(part(lomo, False)),
        "lomo_max_abs_error": max(abs(e) for e in part(lomo, False)),
        "lomo_median_by_model": {m: _median(v) for m, v in held.items()},
        "lofo_median_abs_error": _median(part(lofo, False)),
        "lofo_max_abs_error": max(abs(e) for e in part(lofo, False)),
        "moe_lofo_errors": part(lofo, True),
        "lofo_median_by_family": {f: _median(v) for f, v in family.items()},
        "pairs": len(ordered),
        "pairs_agreeing": sum(p["agrees"] for p in ordered),
    }


def main() -> None:
    """Fit, evaluate, write the results and the package constants."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results/step_time.json"))
    args = ap.parse_args()
    data = rows()
    k = fit(data)
    held = leave_one_out(data, "model")
    family = leave_one_out(data, "family")
    ordered = pairs(data, k)
    summary = summarize(data, k, held, family, ordered)
    when = datetime.date.today().isoformat()
    moe_errors = ", ".join(f"{e:+.1%}" for e in summary["moe_in_sample_errors"])
    provenance = (
        f"bench/step_time.py on {when}: {len(data)} H100 BF16 rows of "
        f"bench/data/step_times_h100_dev.json (sha256 {_sha(DEV)}) and "
        f"bench/data/step_times_h100_moe_dev.json (sha256 {_sha(MOE_DEV)}), settings from "
        f"bench/data/step_time_recipes.json (sha256 {_sha(RECIPES)}); dense in-sample median "
        f"|error| {summary['in_sample_median_abs_error']:.1%}, "
        f"worst {summary['in_sample_max_abs_error']:.1%}; "
        f"leave-one-model-out median {summary['lomo_median_abs_error']:.1%}; "
        f"DeepSeek-V3 {moe_errors}"
    )
    k = dataclasses.replace(k, provenance=provenance)
    result = {
        "about": __doc__.splitlines()[0],
        "constants": dataclasses.asdict(k),
        "fitted": list(FITTED),
        "summary": summary,
        "rows": row_table(data, k, held, family),
        "pairs": ordered,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    package = os.path.join(ROOT, "capture_megatron/steptime", CONSTANTS_FILE)
    with open(package, "w") as f:
        json.dump({"constants": dataclasses.asdict(k), "fitted": list(FITTED)}, f, indent=1)
        f.write("\n")
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out} and {package}")


if __name__ == "__main__":
    main()
