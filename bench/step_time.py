"""Calibrate the step-time model on published H100 step times, and report how well it holds out.

Fits the free constants of capture_megatron.steptime.parts (calibration.FITTED) to the development
set (bench/data/step_times_h100_dev.json: NVIDIA's DGX Cloud benchmarking recipes for GPT-3 175B and
Llama 3.1 8B / 70B / 405B, Megatron-LM's 7B *_memory_speed functional tests), each row with the
settings its own recipe config used (bench/data/step_time_recipes.json). Least squares on the log
of estimated / measured, every model family weighing the same. Reports each row in sample, the
leave-one-model-out error (the constants fitted without the family, then that family estimated),
and whether the model orders every pair of rows with the same model and GPU count but a different
configuration as the measurements do. Held out, never read here: every other model family NVIDIA or
Megatron-LM publish step times for.

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
from step_time_rows import DEV, RECIPES, Row, rows

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


def leave_one_model_out(data: list[Row]) -> dict[str, list[float]]:
    """Per model family: the errors of its rows under constants fitted without it."""
    out = {}
    for model in sorted({r.model for r in data}):
        rest = [r for r in data if r.model != model]
        held = [r for r in data if r.model == model]
        out[model] = errors(held, fit(rest))
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


def row_table(data: list[Row], k: Constants, held: dict[str, list[float]]) -> list[dict]:
    """Each row: measured, estimated, in-sample and held-out error, its breakdown."""
    lomo = {
        r.id: e for m, errs in held.items() for r, e in zip([x for x in data if x.model == m], errs)
    }
    out = []
    for r in data:
        st = step_time(r.shape, r.plan, CostModel(settings=r.settings, constants=k))
        p = r.plan
        out.append(
            {
                "id": r.id, "model": r.model, "gpus": p.world_size,
                "config": f"TP{p.tp} PP{p.pp} VP{p.vpp} CP{p.cp} DP{p.dp} mbs{p.micro_batch_size} "
                f"gbs{p.global_batch_size}",
                "measured_s": r.measured, "estimated_s": st.seconds,
                "error": st.seconds / r.measured - 1, "lomo_error": lomo[r.id],
                "bubble_s": st.bubble, "data_parallel_s": st.data_parallel,
                "mfu": st.mfu, "tokens_per_s_per_gpu": st.tokens_per_s_per_gpu,
                "src": r.src, "recipe": r.recipe,
            }
        )  # fmt: skip
    return out


def main() -> None:
    """Fit, evaluate, write the results and the package constants."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results/step_time.json"))
    args = ap.parse_args()
    data = rows()
    k = fit(data)
    inside = [abs(e) for e in errors(data, k)]
    held = leave_one_model_out(data)
    lomo = [abs(e) for errs in held.values() for e in errs]
    ordered = pairs(data, k)
    summary = {
        "rows": len(data),
        "in_sample_median_abs_error": statistics.median(inside),
        "in_sample_max_abs_error": max(inside),
        "lomo_median_abs_error": statistics.median(lomo),
        "lomo_max_abs_error": max(lomo),
        "lomo_median_by_model": {m: statistics.median(abs(e) for e in v) for m, v in held.items()},
        "pairs": len(ordered),
        "pairs_agreeing": sum(p["agrees"] for p in ordered),
    }
    when = datetime.date.today().isoformat()
    provenance = (
        f"bench/step_time.py on {when}: {len(data)} H100 BF16 rows of "
        f"bench/data/step_times_h100_dev.json (sha256 {_sha(DEV)}), settings from "
        f"bench/data/step_time_recipes.json (sha256 {_sha(RECIPES)}); in-sample median |error| "
        f"{summary['in_sample_median_abs_error']:.1%}, "
        f"worst {summary['in_sample_max_abs_error']:.1%}; "
        f"leave-one-model-out median {summary['lomo_median_abs_error']:.1%}"
    )
    k = dataclasses.replace(k, provenance=provenance)
    result = {
        "about": __doc__.splitlines()[0],
        "constants": dataclasses.asdict(k),
        "fitted": list(FITTED),
        "summary": summary,
        "rows": row_table(data, k, held),
        "pairs": ordered,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    package = os.path.join(ROOT, "capture_megatron/plan", CONSTANTS_FILE)
    with open(package, "w") as f:
        json.dump({"constants": dataclasses.asdict(k), "fitted": list(FITTED)}, f, indent=1)
        f.write("\n")
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out} and {package}")


if __name__ == "__main__":
    main()
