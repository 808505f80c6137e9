"""The command line's output on a fixed set of inputs, kept as golden text (issue 54: a
restructure changes no output). Each case runs the console script's `main` in-process exactly as a
user's command would run, except that profiling is replaced by the synthetic memory source
(tests/unit/synthetic_memory.py), so nothing is profiled and every case takes well under a second:
what is compared is everything the command prints and writes around the memory model -- parsing,
the flag policy, refusals, the search, the table, the reasons, the plan JSON.

The inputs: every launch line of tests/data (Megatron-LM's example lines, the MoE Model Zoo
configs, Megatron-Bridge's H100 recipes, Megatron-LM's functional tests with a world size) through
`predict`, the .args lines and published HF configs through `plan`, and the small synthetic model
planned under each objective and memory size.

Regenerate the golden file after an intended change of output (and read its diff):
    .venv/bin/python tests/unit/cli_golden.py --write
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import re
import signal
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
DATA = os.path.join(ROOT, "tests", "data")
GOLDEN = os.path.join(DATA, "cli_golden.jsonl.gz")
"""The golden outputs: one JSON line per case (name, argv, exit code, stdout, stderr, --json)."""

sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "bench"))


@dataclass(frozen=True)
class Case:
    """One command line."""

    name: str
    """Unique: the input set, the input's name and the command."""
    argv: tuple[str, ...]
    """The console script's arguments (the command first)."""


def _small_cases() -> list[Case]:
    from synthetic_memory import SMALL_ARGS

    cases = []
    for objective in ("throughput", "min-peak", "min-gpus"):
        for gib in ("3", "6", "40"):
            argv = ("plan", *SMALL_ARGS, "--global-batch-size", "32", "--gpus", "8")
            argv += ("--gpu-memory-gib", gib, "--context-gib", "0", "--objective", objective)
            cases.append(Case(f"small/plan/{objective}/{gib}", argv))
    fixed = ("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4")
    for extra in ((), ("--recompute-granularity", "selective"), ("--use-distributed-optimizer",)):
        argv = ("predict", *SMALL_ARGS, *fixed, "--global-batch-size", "32", "--gpus", "8")
        cases.append(Case(f"small/predict/{'-'.join(extra) or 'default'}", (*argv, *extra)))
    return cases


SLOW = frozenset(
    """
    megatron_lm_examples/sbatch_mfsdp_deepseek_v3_no_fsdp/plan hf_configs/DeepSeek-V3/plan
    hf_configs/Llama-3.1-70B-Instruct/plan hf_configs/Qwen2-57B-A14B/plan
    hf_configs/Qwen3-235B-A22B-Instruct-2507/plan
    """.split()
)
"""Cases left out: each searches for 10-100 s on the synthetic memory model (the others take
under 5 s, most under 1 s)."""


def cases() -> list[Case]:
    """Every case, in a fixed order."""
    import inputs

    out = _small_cases()
    for item in inputs.corpus():
        if f"{item.set}/{item.name}/{item.command}" in SLOW:
            continue
        argv = (item.command, *item.argv)
        out.append(Case(f"{item.set}/{item.name}/{item.command}", argv))
    return out


def _synthetic(*args: Any, **kwargs: Any) -> Any:
    from synthetic_memory import synthetic_source

    return synthetic_source


_TMP = re.compile(r"/tmp/[^\s'\"]*golden[^\s'\"/]*")


def _clean(text: str) -> str:
    """Output with the temporary directory and the checkout's path (which differ between runs and
    clones) named TMP and ROOT."""
    return _TMP.sub("TMP", text).replace(ROOT, "ROOT")


def run(case: Case) -> dict[str, Any]:
    """Run one case in-process: its exit code, what it printed, and the --json it wrote."""
    from capture_megatron import cli, profile

    out, err = io.StringIO(), io.StringIO()
    saved = profile.memory_source, signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)
    profile.memory_source = _synthetic  # type: ignore[assignment]
    try:
        with tempfile.TemporaryDirectory(prefix="golden") as tmp:
            path = os.path.join(tmp, "out.json")
            argv = [*case.argv, "--no-progress", "--json", path]
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    code = cli.main(argv)
                except Exception as exc:  # noqa: BLE001 - a traceback is an output too
                    code, _ = -1, print(f"traceback: {type(exc).__name__}: {exc}", file=sys.stderr)
            written = None
            if os.path.exists(path):
                with open(path) as f:
                    written = json.load(f)
    finally:
        profile.memory_source = saved[0]  # type: ignore[assignment]
        signal.signal(signal.SIGTERM, saved[1])
        signal.signal(signal.SIGHUP, saved[2])
    return {
        "name": case.name,
        "argv": [a.replace(ROOT, "ROOT") for a in case.argv],
        "code": code,
        "stdout": _clean(out.getvalue()),
        "stderr": _clean(err.getvalue()),
        "json": written,
    }


def golden() -> Iterator[dict[str, Any]]:
    """The golden outputs, in case order."""
    with gzip.open(GOLDEN, "rt") as f:
        for line in f:
            yield json.loads(line)


def write() -> None:
    """Run every case and write the golden file."""
    rows = [run(c) for c in cases()]
    with gzip.GzipFile(GOLDEN, "wb", mtime=0) as raw, io.TextIOWrapper(raw) as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")
    codes: dict[int, int] = {}
    for row in rows:
        codes[row["code"]] = codes.get(row["code"], 0) + 1
    print(f"wrote {len(rows)} cases to {GOLDEN}; exit codes {codes}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(__doc__)
    write()
