"""Benchmark: `capture-megatron predict` on Megatron-LM's own functional tests.

The cases (core_v0.16.1, 8 x H100; tests/data/megatron_lm_functional_tests.json): each case's
MODEL_ARGS verbatim, the last pipeline stage's predicted peak against its measured
mem-max-allocated-bytes.

Cases whose names contain "resume" are the held-out set (nothing is tuned on them); the others are
the development set. Cases without a stated world size are skipped; refused cases are listed with
the reason. Dropless mixture-of-experts cases are predicted at the default routing forecast
(measured routing statistics), with the worst-case bound beside them.

    python bench/conformance.py [--device fake] [--models gpt] [--cases NAME,...]
                                [--sets development,held_out]
                                [--out bench/results/conformance.json] [--merge]

With --merge, the cases run replace those of the same name in --out and the rest are kept (to
re-run one model family, or the --cases named); the summary is recomputed over all of them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from importlib.metadata import version
from typing import Any

from tqdm import tqdm

import capture_megatron
from capture_megatron.errors import CaptureError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "tests", "data", "megatron_lm_functional_tests.json")


def cases(models: tuple[str, ...], corpus: str = CORPUS) -> list[dict[str, Any]]:
    """The corpus's cases of these model families."""
    with open(corpus) as f:
        return [c for c in json.load(f)["cases"] if c["model"] in models]


def dropless(case: dict[str, Any]) -> bool:
    """Whether the case routes tokens to experts without a capacity (token counts vary)."""
    argv = case["argv"]
    return "--num-experts" in argv and "--moe-expert-capacity-factor" not in argv


def launched(value: str) -> str:
    """A MODEL_ARGS value as Megatron-LM's launcher hands it to the training script: core_v0.16.1
    tests/functional_tests/shell_test_utils/_run_training.sh trims each value with `xargs`
    (which removes one level of backslash escapes) and builds the argument array with `eval`
    (a second level), so the YAML's `Et*3\\\\|\\\\(tt\\\\|\\\\)*6mL` reaches Megatron as
    `Et*3|(tt|)*6mL`."""
    for _ in range(2):
        value = re.sub(r"\\(.)", r"\1", value)
    return value


def _predict(case: dict[str, Any], device: str, extra: list[str]):
    """The last stage's predicted peak and the result, or the CaptureError's text."""
    argv = [*map(launched, case["argv"]), *extra]
    argv += ["--gpus", str(case["world_size"]), "--no-progress"]
    cublas = case["env_vars"].get("CUBLAS_WORKSPACE_CONFIG")
    argv += ["--cublas-workspace-config", cublas] if cublas else []
    argv += ["--device", device] if device else []
    try:
        result = capture_megatron.predict(argv)
    except CaptureError as err:
        return str(err)
    return result


def predict_case(case: dict[str, Any], device: str) -> dict[str, Any]:
    """Predict one case verbatim; its last stage's predicted and measured peak (or why refused).
    Dropless MoE cases are predicted at the default routing forecast (measured routing
    statistics, capture_megatron.forecast.routing), with the worst-case bound (every token of an
    expert's ranks routed to it) and the factors beside them."""
    row = {
        "name": case["name"],
        "held_out": "resume" in case["name"],
        "world_size": case["world_size"],
        "measured": case["measured"]["max_allocated_bytes"],
    }
    if not case["world_size"]:
        return {**row, "skipped": "no world size in the H100 recipe"}
    result = _predict(case, device, [])
    if isinstance(result, str):
        return {**row, "refused": result}
    predicted = result.best.rank_peaks[-1]
    row = {
        **row,
        "predicted": predicted,
        "error": (predicted - row["measured"]) / row["measured"],
        "layout": result.best.plan.layout,
        "kernels": result.to_plain()["kernels"],
    }
    if result.routing is not None:
        r = result.routing
        row.update(
            routing="forecast",
            factor=r.factors.forecast,
            planning_factor=r.factors.planning,
            bound_factor=r.factors.bound,
            routing_source=r.factors.source,
            planning=r.planning_peaks[-1],
            bound=r.bound_peaks[-1],
        )
    return row


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Worst and median |error| of the predicted cases, per set."""
    out = {}
    for name, held in (("development", False), ("held_out", True)):
        errs = [abs(r["error"]) for r in rows if "error" in r and r["held_out"] == held]
        out[name] = {
            "cases": len(errs),
            "max_abs_error": max(errs, default=None),
            "median_abs_error": statistics.median(errs) if errs else None,
            "refused": sum(1 for r in rows if "refused" in r and r["held_out"] == held),
        }
    return out


def merged(path: str, device: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`path`'s cases with these rows in place of those of the same name, in corpus order."""
    with open(path) as f:
        old = json.load(f)
    if old["device"] != device:
        sys.exit(f"--merge: {path} was predicted for device {old['device']!r}, not {device!r}")
    new = {r["name"]: r for r in rows}
    kept = [new.pop(r["name"], r) for r in old["cases"]]
    return kept + list(new.values())


def main() -> None:
    """Predict every case and write the results."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--device", default="", help="memory model device (default: the planner's)")
    ap.add_argument("--models", default="gpt", help="comma-separated: gpt, moe, mixtral")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results/conformance.json"))
    ap.add_argument("--merge", action="store_true", help="keep --out's other cases")
    ap.add_argument("--cases", default="", help="comma-separated case names: only these")
    ap.add_argument(
        "--corpus",
        default=CORPUS,
        help="the cases (default core_v0.16.1's; megatron_lm_functional_tests-0.19.json: "
        "core_v0.19.0's, forecast on megatron-core 0.19.x)",
    )
    ap.add_argument(
        "--sets",
        default="development,held_out",
        help="comma-separated: development, held_out (the 'resume' cases: run once, at the end)",
    )
    ns = ap.parse_args()
    sets = set(ns.sets.split(","))
    chosen = [
        c
        for c in cases(tuple(ns.models.split(",")), ns.corpus)
        if ("held_out" if "resume" in c["name"] else "development") in sets
    ]
    if ns.cases:
        chosen = [c for c in chosen if c["name"] in ns.cases.split(",")]
    rows = [predict_case(c, ns.device) for c in tqdm(chosen)]
    if ns.merge:
        rows = merged(ns.out, ns.device or "default", rows)
    with open(ns.corpus) as f:
        source = json.load(f)["source"]
    result = {
        "device": ns.device or "default",
        "source": source,
        "megatron_core": version("megatron-core"),
        "summary": summary(rows),
        "cases": rows,
    }
    with open(ns.out, "w") as f:
        json.dump(result, f, indent=1)
    for r in rows:
        why = r.get("refused") or r.get("skipped") or ""
        tail = f"{100 * r['error']:+7.1f}%" if "error" in r else why[:110]
        print(f"{r['name'][:64]:64s} {tail}", file=sys.stdout)
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
