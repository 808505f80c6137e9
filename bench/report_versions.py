"""bench/report.py's section on megatron-core 0.19: conformance against Megatron-LM core_v0.19.0's
functional tests forecast on megatron-core 0.19.2 (bench/results/conformance-0.19.json, written by
bench/conformance.py --corpus tests/data/megatron_lm_functional_tests-0.19.json on the second CI
leg's environment), and the drift against the 0.16.1 forecasts of the same cases
(bench/results/conformance.json)."""

from __future__ import annotations

import statistics

from report_results import read_result

GIB = 2**30


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.2f}%"


def _abs_pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.2f}%"


def _row(r: dict, old: dict | None) -> str:
    """One case: 0.19's measured and forecast, 0.16.1's, and the drift between them."""
    gpus = r.get("world_size") or "-"
    measured = f"{r['measured'] / GIB:.3f}"
    if "error" not in r:
        why = (r.get("refused") or r.get("skipped") or "").replace("|", "/")[:160]
        return f"| {r['name']} | {gpus} | {measured} | - | - | - | - | - | {why} |"
    then = "-"
    forecast_drift = measured_drift = None
    if old is not None and "error" in old:
        then = f"{100 * old['error']:+.2f}%"
        forecast_drift = (r["predicted"] - old["predicted"]) / old["predicted"]
    if old is not None:
        measured_drift = (r["measured"] - old["measured"]) / old["measured"]
    return (
        f"| {r['name']} | {gpus} | {measured} | {r['predicted'] / GIB:.3f} | "
        f"{100 * r['error']:+.2f}% | {then} | {_pct(measured_drift)} | {_pct(forecast_drift)} | "
        f"`{r['layout'].replace('|', '/')}` |"
    )


def drift(new: dict, old: dict) -> dict:
    """Over the cases both versions forecast: how often and how much the golden values and the
    forecasts moved between core_v0.16.1 and core_v0.19.0 / megatron-core 0.19.2."""
    before = {r["name"]: r for r in old["cases"]}
    both = [(r, before.get(r["name"], {})) for r in new["cases"] if "error" in r]
    both = [(r, o) for r, o in both if "error" in o]
    moved = [(r, o) for r, o in both if r["measured"] != o["measured"]]
    return {
        "cases": len(both),
        "golden_changed": len(moved),
        "median_abs_error_0_16": statistics.median([abs(o["error"]) for _, o in both] or [0]),
        "median_abs_error_0_19": statistics.median([abs(r["error"]) for r, _ in both] or [0]),
        "median_abs_forecast_drift": statistics.median(
            [abs(r["predicted"] - o["predicted"]) / o["predicted"] for r, o in both] or [0]
        ),
        "median_abs_golden_drift": statistics.median(
            [abs(r["measured"] - o["measured"]) / o["measured"] for r, o in moved] or [0]
        ),
    }


def versions_section(root: str) -> str:
    """The section, or '' when the 0.19 conformance has not run."""
    new = read_result(root, "conformance-0.19")
    if new is None:
        return ""
    old = read_result(root, "conformance") or {"cases": []}
    before = {r["name"]: r for r in old["cases"]}
    out = [
        "",
        "## Conformance on megatron-core 0.19.2: Megatron-LM core_v0.19.0's functional tests",
        "",
        "`bench/conformance.py --corpus tests/data/megatron_lm_functional_tests-0.19.json` in the "
        "second CI leg's environment (Python 3.12, torch 2.13.0, megatron-core "
        f"{new.get('megatron_core', '0.19.2')}; the GPU kernel set on fake CUDA): each case of "
        f"{new.get('source', 'core_v0.19.0')}'s functional tests that logs memory on 8 x H100, "
        "its MODEL_ARGS verbatim, predicted for the megatron-core installed, against the "
        "`mem-max-allocated-bytes` of its own golden values. Beside each: the same case's error "
        "at core_v0.16.1 on megatron-core 0.16.1 (the section above), how much its golden value "
        "moved between the tags, and how much the forecast moved (drift).",
        "",
    ]
    for name in ("development", "held_out"):
        s = new["summary"][name]
        out.append(
            f"- {name.replace('_', '-')}: {s['cases']} predicted, worst |error| "
            f"{_abs_pct(s['max_abs_error'])}, median {_abs_pct(s['median_abs_error'])}; "
            f"{s['refused']} refused."
        )
    d = drift(new, old)
    out += [
        f"- Drift over the {d['cases']} cases forecast on both versions: the golden value changed "
        f"in {d['golden_changed']} (median |change| {_abs_pct(d['median_abs_golden_drift'])}); "
        f"the forecast moved by a median {_abs_pct(d['median_abs_forecast_drift'])}; median "
        f"|error| {_abs_pct(d['median_abs_error_0_16'])} on 0.16.1, "
        f"{_abs_pct(d['median_abs_error_0_19'])} on 0.19.2.",
        "",
        "| case | GPUs | measured GiB (0.19) | predicted GiB (0.19.2) | error | error on 0.16.1 | "
        "golden drift | forecast drift | layout / why refused |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    out += [_row(r, before.get(r["name"])) for r in new["cases"]]
    return "\n".join(out) + "\n"
