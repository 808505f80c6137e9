"""Benchmark: how long a user waits for `capture-megatron plan` and `capture-megatron profile`.

Cold: a fresh cache (nothing profiled; the compiled fake-CUDA shim, built once per machine in a few
seconds, is copied in). Warm: the same command again on that cache, as a user runs it: the answer
kept by the cold run is read back (capture_megatron.api.kept; "warm_read_back_same": its output, but
for the line saying so, is the cold run's). Warm searched: the same command once more with
CAPTURE_MEGATRON_KEEP_PLANS=0, every plan worked out again from the cached records (what a new
question on known records costs, e.g. another GPU count or batch). Each command runs as a user
types it, in a fresh process (imports included), default objective, fake-CUDA memory model; the
medians of --repeats runs are reported (this machine is shared: medians, one run each in turn).

    python bench/plan_times.py [--repeats 3] [--out bench/results/plan_times.json]
        [--cases llama2-70b:64,gpt3-175b:1024] [--issue53 llama3-70b,qwen3-30b-a3b,...]
        [--warm-cache DIR] [--from-nothing]

"probes" counts the probes a cold plan ran, "records" the records it kept (a record can serve
several probes: capture_megatron.profile.design.built_as).

--cases reruns only those presets (no profile times) and replaces their rows in --out, naming
the commit they were measured at ("rerun"); the other rows stay as they were.

--issue53 times issue 53's models (ISSUE53: Llama 3 70B on 64 GPUs, Qwen3-30B-A3B on 16,
Qwen3-235B-A22B on 256, DeepSeek-V3 on 1024; seq 4096, global batch 1024, 80 GiB, the HF configs
of tests/data/hf_configs) and replaces their rows of "issue53" in --out, with the commit and the
load average. Their cold runs start from the anchor records the package ships for them
(capture_megatron.profile.shipped), as a user's do; with --from-nothing only cold runs are timed,
with the shipped records left unread (everything profiled), kept beside the others in the row.
--warm-cache DIR times only warm searched runs on that cache (a cache profiled before, e.g. by an
earlier cold run; it is not changed by a warm searched plan of a model it holds).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from speed import LLAMA2_70B  # bench/speed.py: the same Llama-2-70B command line

from capture_megatron.api.kept import ENABLE
from capture_megatron.cache import cache_dir
from capture_megatron.emulate.fake_cuda import shim_path
from capture_megatron.profile.shipped import SWITCH

CASES = (
    ("gpt3-1.3b", 8),
    ("llama2-7b", 8),
    ("llama3-8b", 8),
    ("gpt3-13b", 16),
    ("llama2-70b", 64),
    ("llama3-70b", 64),
    ("gpt3-175b", 1024),
)
"""(preset, GPUs of 80 GiB) planned."""

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HF = os.path.join(ROOT, "tests", "data", "hf_configs")
ISSUE53_RUN = ("--seq-length", "4096", "--global-batch-size", "1024", "--gpu-memory-gib", "80")
ISSUE53 = {
    "llama3-70b": (("--preset", "llama3-70b"), 64),
    "qwen3-30b-a3b": (("--hf-config", os.path.join(HF, "Qwen3-30B-A3B.json")), 16),
    "qwen3-235b-a22b": (
        ("--hf-config", os.path.join(HF, "Qwen3-235B-A22B-Instruct-2507.json")),
        256,
    ),
    "deepseek-v3": (("--hf-config", os.path.join(HF, "DeepSeek-V3.json")), 1024),
}
"""Issue 53's models: (model flags, GPUs of 80 GiB), each at ISSUE53_RUN."""


READ_BACK = "  read back from "
"""How the line saying a plan was read back starts (capture_megatron.cli.render.print_plan)."""
FROM_NOTHING = False
"""Whether plans leave the shipped records unread (--from-nothing)."""


def _fresh_cache() -> str:
    shim_path()  # compiled once into the user's cache for this torch, then copied into each
    tmp = tempfile.mkdtemp(prefix="capture-bench-")
    shim = os.path.join(cache_dir(), "fake_cuda")
    if os.path.isdir(shim):
        shutil.copytree(shim, os.path.join(tmp, "fake_cuda"))
    return tmp


def _run(argv: list[str], cache: str, keep: bool = True) -> tuple[float, str]:
    """(wall seconds, standard output) of one capture-megatron command with its own cache
    (`keep`: answers kept and read back, as for a user; else CAPTURE_MEGATRON_KEEP_PLANS=0)."""
    env = {**os.environ, "CAPTURE_MEGATRON_CACHE": cache, ENABLE: "1" if keep else "0"}
    if FROM_NOTHING:  # the records shipped with the package left unread: everything profiled
        env[SWITCH] = "0"
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "capture_megatron.cli", *argv], capture_output=True, env=env
    )
    if done.returncode:
        raise SystemExit(f"{' '.join(argv)} failed: {done.stderr.decode()[-2000:]}")
    return time.perf_counter() - t0, done.stdout.decode()


def _timed(argv: list[str], cache: str, keep: bool = True) -> float:
    return _run(argv, cache, keep)[0]


def _answer(stdout: str) -> str:
    """A plan's output without the line saying it was read back."""
    return "\n".join(x for x in stdout.splitlines() if not x.startswith(READ_BACK))


def _probes_run(stdout: str) -> int:
    """The probes a cold plan ran, from its "profiling N probes" lines."""
    return sum(int(m) for m in re.findall(r"^profiling (\d+) probes", stdout, re.MULTILINE))


def _lines(path: str) -> int:
    with open(path) as f:
        return sum(1 for _ in f)


def plan_times(name: str, gpus: int, repeats: int, argv: list[str] | None = None) -> dict:
    """Median cold and warm wall times of one preset's default plan (or of `argv`)."""
    argv = argv or ["plan", "--preset", name, "--gpus", str(gpus), "--gpu-memory-gib", "80"]
    cold, warm, search, same, probes, records = [], [], [], True, 0, 0
    for _ in range(repeats):
        cache = _fresh_cache()
        try:
            seconds, stdout = _run([*argv, "--no-progress"], cache)
            cold.append(seconds)
            seconds, again = _run([*argv, "--no-progress"], cache)
            warm.append(seconds)
            search.append(_timed([*argv, "--no-progress"], cache, keep=False))
            same = same and READ_BACK in again and _answer(again) == _answer(stdout)
            probes = _probes_run(stdout)
            records = sum(
                _lines(p) - 1 for p in glob.glob(os.path.join(cache, "fake-cuda-*.jsonl"))
            )
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    return {
        "preset": name,
        "gpus": gpus,
        "cold_s": statistics.median(cold),
        "warm_s": statistics.median(warm),
        "warm_searched_s": statistics.median(search),
        "warm_read_back_same": same,
        "probes": probes,
        "records": records,
        "cold_runs_s": cold,
        "warm_runs_s": warm,
        "warm_searched_runs_s": search,
    }


def profile_time(repeats: int, design: bool) -> float:
    """Median wall time of `capture-megatron profile` of Llama-2-70B (fake CUDA, fresh cache)."""
    times = []
    for _ in range(repeats):
        cache = _fresh_cache()
        try:
            out = os.path.join(cache, "records.jsonl")
            argv = ["profile", *LLAMA2_70B, "--device", "fake-cuda", "--no-progress", "--out", out]
            times.append(_timed(argv + ([] if design else ["--no-design"]), cache))
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    return statistics.median(times)


def rerun(ns: argparse.Namespace) -> None:
    """Rerun the --cases presets and replace their rows in --out (see the module docstring)."""
    load_start = os.getloadavg()[1]
    with open(ns.out) as f:
        out = json.load(f)
    cases = [(c.split(":")[0], int(c.split(":")[1])) for c in ns.cases.split(",")]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    for name, gpus in cases:
        row = plan_times(name, gpus, ns.repeats)
        row["rerun"] = commit.stdout.strip()
        out["plans"] = [
            row if (p["preset"], p["gpus"]) == (name, gpus) else p for p in out["plans"]
        ]
        print(json.dumps(row))
    out["rerun_load_average_5min"] = [load_start, os.getloadavg()[1]]
    with open(ns.out, "w") as f:
        json.dump(out, f, indent=1)


def _issue53_argv(name: str) -> tuple[list[str], int]:
    flags, gpus = ISSUE53[name]
    return ["plan", *flags, *ISSUE53_RUN, "--gpus", str(gpus)], gpus


def issue53(ns: argparse.Namespace) -> None:
    """Time issue 53's --issue53 models (cold and warm, or warm only on --warm-cache) and replace
    their rows of "issue53" in --out."""
    load_start = os.getloadavg()[1]
    with open(ns.out) as f:
        out = json.load(f)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    rows = {r["model"]: r for r in out.get("issue53", [])}
    for name in ns.issue53.split(","):
        argv, gpus = _issue53_argv(name)
        if ns.warm_cache:  # worked out again each time (nothing read back)
            argv = [*argv, "--no-progress"]
            warm = [_timed(argv, ns.warm_cache, False) for _ in range(ns.repeats)]
            row = {**rows.get(name, {}), "warm_searched_s": statistics.median(warm)}
            row["warm_searched_runs_s"] = warm
        elif FROM_NOTHING:  # the cold runs only, kept beside those with the shipped records
            got = plan_times(name, gpus, ns.repeats, argv)
            row = {**rows.get(name, {}), "cold_from_nothing_s": got["cold_s"]}
            row |= {"cold_from_nothing_runs_s": got["cold_runs_s"], "probes": got["probes"]}
        else:  # "probes" stays the run's from nothing; these runs' own are cold_probes
            got = plan_times(name, gpus, ns.repeats, argv)
            got["cold_probes"] = got.pop("probes")
            row = {**rows.get(name, {}), **got}
            row.pop("preset")
        row |= {"model": name, "gpus": gpus, "commit": commit.stdout.strip()}
        row["load_average_5min"] = [load_start, os.getloadavg()[1]]
        rows[name] = row
        print(json.dumps(row), flush=True)
    out["issue53"] = [rows[n] for n in ISSUE53 if n in rows]
    with open(ns.out, "w") as f:
        json.dump(out, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/results/plan_times.json")
    ap.add_argument("--cases", default="", help="preset:gpus,... to rerun (rows replaced)")
    ap.add_argument("--issue53", default="", help=f"models of {', '.join(ISSUE53)} to time")
    ap.add_argument("--warm-cache", default="", help="--issue53: warm runs only, on this cache")
    ap.add_argument(
        "--from-nothing",
        action="store_true",
        help="--issue53: cold runs without the shipped anchor records (CAPTURE_MEGATRON_SHIPPED=0)",
    )
    ns = ap.parse_args()
    global FROM_NOTHING
    FROM_NOTHING = ns.from_nothing
    load_start = os.getloadavg()[1]
    if ns.issue53:
        issue53(ns)
        return
    if ns.cases:
        rerun(ns)
        return
    out = {
        "workers": os.cpu_count(),
        "plans": [plan_times(name, gpus, ns.repeats) for name, gpus in CASES],
        "profile_llama2_70b_s": profile_time(ns.repeats, design=True),
        "profile_llama2_70b_no_design_s": profile_time(ns.repeats, design=False),
    }
    # the machine is shared: the 5-minute load average at the start and end says how busy it was
    out["load_average_5min"] = [load_start, os.getloadavg()[1]]
    with open(ns.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
