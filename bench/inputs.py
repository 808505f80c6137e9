"""Benchmark: how many inputs nobody here wrote `capture-megatron predict` and `plan` accept as
written, and why the others are refused.

The input sets (tests/data, sources in each folder's README):
- `megatron_lm_examples`: Megatron-LM core_v0.16.1's launch scripts and documented launch lines;
- `moe_modelzoo`: NVIDIA's Megatron MoE Model Zoo benchmarking configs;
- `megatron_bridge`: Megatron-Bridge v0.3.1's H100 pretraining performance recipes;
- `hf_configs`: published Hugging Face config.json files (`plan --hf-config`);
- `functional_tests`: Megatron-LM's functional tests (tests/data/megatron_lm_functional_tests.json;
  those with a world size; `predict` only: bench/conformance.py forecasts them), each value as
  Megatron-LM's launcher hands it to the training script (conformance.launched: its YAML's shell
  escapes removed, as xargs and eval remove them).
Every launch line runs through `predict` and through `plan` (GPUs of 80 GiB; the sizes it gives
are fixed, the rest searched).
Each command line runs in-process exactly as the console script runs it, in two stages:
1. `dry`: everything before the first profile -- parsing, the flag policy, the model, the
   parallel plan, the planner's checks -- with a memory source that stops the run when it is
   first asked for a memory model;
2. `forecast` (--forecast): the whole forecast, profiling on the spot (cached) for --device.
An input is accepted when it passes (a forecast, or with --forecast off, the dry stage); refused
when a CaptureError stops it (its first sentence is the reason); a traceback is any other
exception. A line refused because Megatron-LM itself would stop at it, with the change the refusal
names first (FIXES: --tp-comm-overlap at TP 1), runs again with that change: `fixed_outcome` is
the outcome then, and the summary counts both (`accepted_with_fix`). A line whose tokenizer cannot
be read here gets its model's --vocab-size (the only flag ever added; `vocab_added` says where), as
a user without the tokenizer file would.

    python bench/inputs.py [--forecast] [--sets megatron_lm_examples,...] [--device fake]
                           [--merge] [--out bench/results/inputs.json]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import shlex
import sys
import traceback
from collections import Counter
from dataclasses import dataclass
from typing import Any

from capture_megatron.rules.flags import TP_OVERLAP_FIX

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")
SETS = ("megatron_lm_examples", "moe_modelzoo", "megatron_bridge", "hf_configs", "functional_tests")
"""The input sets, in report order."""
EXAMPLE_GPUS = {
    "train_gpt3_175b_distributed": 128,
    "train_llama3_8b_h100_fp8": 8,
    "train_mixtral_8x7b_distributed": 32,
    "sbatch_mfsdp_deepseek_v3": 256,
    "sbatch_mfsdp_deepseek_v3_no_fsdp": 256,
    "docs_training_examples_llama": 8,
    "docs_training_examples_gpt3": 8,
    "docs_parallelism_guide_tp4_pp4_cp2": 64,
}
"""World sizes of the Megatron-LM example lines (tests/data/megatron_lm_examples/README.md)."""
TOKENIZER_VOCAB = {
    "/data/mixtral/tokenizer.model": 32000,
    "deepseek-ai/DeepSeek-V3": 129280,
    "unsloth/DeepSeek-V3": 129280,
    "deepseek-ai/DeepSeek-V2-Lite": 102400,
    "Qwen/Qwen3-30B-A3B": 151936,
    "Qwen/Qwen3-235B-A22B": 151936,
}
"""Vocabularies of the tokenizers the lines name that are not readable here (the models'
config.json vocab_size: tests/data/hf_configs and the models' Hub pages)."""
ZOO_VOCAB = {"Mixtral": 32000, "DeepSeek-V3": 129280, "DeepSeek-V2": 102400, "Qwen3": 151936}
"""The Model Zoo's tokenizer per model family (its placeholder tokenizer path for Mixtral)."""
UNREADABLE = (
    "HuggingFaceTokenizer",
    "Llama2Tokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
)
"""Tokenizer types whose vocabulary comes from a file (or a Hub download) this bench does not
have."""
HF_GPUS = 64
"""GPUs `plan --hf-config` plans each published config for (80 GiB each)."""
FIXES = {TP_OVERLAP_FIX: "--tp-comm-overlap"}
"""Changes a refusal names for a line Megatron-LM itself would stop at -> the flag (a switch) that
change leaves out."""


@dataclass(frozen=True)
class Item:
    """One input: a command line for `predict` (Megatron flags) or `plan` (an HF config)."""

    set: str
    """The input set."""
    name: str
    """The input's name in its set."""
    command: str
    """predict or plan."""
    argv: tuple[str, ...]
    """The command line, --gpus included (and --gpu-memory-gib for plan)."""
    vocab_added: bool = False
    """Whether --vocab-size was added (the tokenizer file is not readable here)."""


def args_file(path: str) -> list[str]:
    """The flags of a .args file (one flag per line, # comments), split as a shell would."""
    with open(path) as f:
        return [w for ln in f if ln.strip() and not ln.startswith("#") for w in shlex.split(ln)]


def _world(path: str) -> int:
    """The world size a generated .args file states in its header ('world size N')."""
    with open(path) as f:
        head = "".join(ln for ln in f if ln.startswith("#"))
    return int(head.split("world size ")[1].split()[0])


def _vocab(name: str, argv: list[str]) -> int | None:
    """The vocabulary to add when the line has no --vocab-size and names a tokenizer whose file
    is not readable here (None: nothing to add)."""
    if "--vocab-size" in argv:
        return None
    kind = argv[argv.index("--tokenizer-type") + 1] if "--tokenizer-type" in argv else ""
    if kind not in UNREADABLE:
        return None
    model = argv[argv.index("--tokenizer-model") + 1] if "--tokenizer-model" in argv else ""
    if os.path.exists(model):
        return None
    if model in TOKENIZER_VOCAB:
        return TOKENIZER_VOCAB[model]
    return next((v for k, v in ZOO_VOCAB.items() if name.startswith(k)), None)


def _line(set_: str, name: str, argv: list[str], gpus: int, plan: bool = True) -> list[Item]:
    """The line for `predict`, and (`plan`) for `plan` on GPUs of 80 GiB."""
    vocab = _vocab(name, argv)
    extra = ["--vocab-size", str(vocab)] if vocab else []
    full = (*argv, *extra, "--gpus", str(gpus), "--no-progress")
    items = [Item(set_, name, "predict", full, bool(vocab))]
    if plan:
        items.append(Item(set_, name, "plan", (*full, "--gpu-memory-gib", "80"), bool(vocab)))
    return items


def corpus(sets: tuple[str, ...] = SETS) -> list[Item]:
    """Every input of these sets."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))  # this file may be loaded by its path
    from conformance import launched

    items: list[Item] = []
    for set_ in sets:
        if set_ == "functional_tests":
            with open(os.path.join(DATA, "megatron_lm_functional_tests.json")) as f:
                cases = json.load(f)["cases"]
            for c in cases:
                if c["world_size"]:
                    cublas = c["env_vars"].get("CUBLAS_WORKSPACE_CONFIG")
                    extra = ["--cublas-workspace-config", cublas] if cublas else []
                    argv = [*map(launched, c["argv"]), *extra]
                    items += _line(set_, c["name"], argv, c["world_size"], plan=False)
            continue
        folder = os.path.join(DATA, set_)
        for entry in sorted(os.listdir(folder)):
            path, stem = os.path.join(folder, entry), entry.rsplit(".", 1)[0]
            if set_ == "hf_configs" and entry.endswith(".json"):
                argv = ("--hf-config", path, "--gpus", str(HF_GPUS), "--gpu-memory-gib", "80")
                items.append(Item(set_, stem, "plan", (*argv, "--no-progress")))
            elif entry.endswith(".args"):
                gpus = EXAMPLE_GPUS.get(stem) or _world(path)
                items += _line(set_, stem, args_file(path), gpus)
    return items


class Dry(Exception):
    """Raised by the dry memory source: the run got as far as its first profile."""


def _dry_source(needs: Any) -> Any:
    raise Dry()


def run(item: Item, forecast: bool, device: str = "") -> dict[str, Any]:
    """Run one input in-process: {'outcome': accepted / passed-dry / refused / traceback, ...};
    a refusal naming one of FIXES also runs the line with that change (`fixed_outcome`)."""
    row = run_once(item, forecast, device)
    fix = next((f for f in FIXES if f in row.get("reason", "")), None)
    if row["outcome"] != "refused" or fix is None:
        return row
    argv = tuple(a for a in item.argv if a != FIXES[fix])
    again = run_once(dataclasses.replace(item, argv=argv), forecast, device)
    return {**row, "fix": fix, "fixed_outcome": again["outcome"], "fixed": again}


def run_once(item: Item, forecast: bool, device: str = "") -> dict[str, Any]:
    """Run one input in-process, as written: {'outcome': accepted / passed-dry / refused /
    traceback, ...}."""
    from capture_megatron.api import forecast as run_forecast  # not `forecast`, the parameter
    from capture_megatron.api import read_request
    from capture_megatron.api.args import plan_parser, predict_parser
    from capture_megatron.api.request import cluster_of
    from capture_megatron.errors import CaptureError
    from capture_megatron.flags import parser as flags
    from capture_megatron.megatron import quiet

    quiet.install()  # as the console script does, before megatron-core is imported
    argv = [*item.argv, *(["--device", device] if device else [])]
    predict = item.command == "predict"
    row: dict[str, Any] = {
        "name": item.name,
        "command": item.command,
        "vocab_added": item.vocab_added,
    }
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            ns = flags.parse_flags((predict_parser if predict else plan_parser)(), argv)
            cluster = cluster_of(ns, need_memory=not predict)
            memory = None if forecast else _dry_source
            result = run_forecast(read_request(ns, cluster, predict), memory)
    except Dry:
        return {**row, "outcome": "passed-dry"}
    except CaptureError as err:
        return {**row, "outcome": "refused", "reason": str(err)}
    except Exception as err:  # noqa: BLE001 - a traceback is what this bench looks for
        frame = traceback.extract_tb(err.__traceback__)[-1]
        where = f"{os.path.relpath(frame.filename, ROOT)}:{frame.lineno}"
        return {
            **row,
            "outcome": "traceback",
            "reason": f"{type(err).__name__}: {err}",
            "where": where,
        }
    return {**row, "outcome": "accepted", "last_stage_peak": result.best.rank_peaks[-1]}


def reason_keys(text: str) -> list[str]:
    """A refusal's causes: each flag it refuses by name, else its first clause."""
    if "read but not modelled yet" in text:  # "--a, --b: this architecture feature is read ..."
        return [f.strip() for f in text.split(":")[0].split(",")]
    keys = []
    for lead in ("does not model yet:", "would not run this line:"):
        if lead in text:
            body = text.split(lead, 1)[1].split(". ")[0]
            keys += [seg.split()[0] for seg in body.split("; ") if seg.strip().startswith("--")]
    if keys:
        return list(dict.fromkeys(keys))
    if text.startswith("--hf-config") and "cannot build it" in text:
        return ["HF model megatron-core's GPT layer cannot build (by field)"]
    if text.startswith("--") and not text.startswith("--hf-config"):
        return [text.split(":")[0].split()[0]]  # "--optimizer muon: only Adam ..."
    return [text.split(" (")[0].split(": ")[-1][:100]]


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts per outcome and the refusal causes."""
    outcomes = Counter(r["outcome"] for r in rows)
    reasons = Counter(
        key for r in rows if r["outcome"] == "refused" for key in reason_keys(r["reason"])
    )
    passing = ("accepted", "passed-dry")
    fixed = sum(1 for r in rows if r["outcome"] in passing or r.get("fixed_outcome") in passing)
    return {
        "inputs": len(rows),
        "outcomes": dict(outcomes),
        "accepted_with_fix": fixed,
        "vocab_added": sum(r["vocab_added"] for r in rows),
        "refusal_causes": dict(reasons.most_common()),
    }


def main() -> None:
    """Run every input of the chosen sets and write the results (with --merge, the other sets
    already in --out are kept)."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--sets", default=",".join(SETS))
    ap.add_argument("--forecast", action="store_true", help="run the whole forecast (slow)")
    ap.add_argument("--device", default="", help="memory-model device for --forecast")
    ap.add_argument("--merge", action="store_true", help="keep the other sets already in --out")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "inputs.json"))
    args = ap.parse_args()
    out: dict[str, Any] = {"sets": {}}
    if args.merge and os.path.exists(args.out):
        with open(args.out) as f:
            out = json.load(f)
    for set_ in (s for s in args.sets.split(",") if s):
        rows = [run(item, args.forecast, args.device) for item in corpus((set_,))]
        stage = "forecast" if args.forecast else "dry"
        per = {c: summary([r for r in rows if r["command"] == c]) for c in ("predict", "plan")}
        per = {c: v for c, v in per.items() if v["inputs"]}
        out["sets"][set_] = {"stage": stage, "summary": per, "inputs": rows}
        print(
            f"{set_} ({stage}): " + str({c: v["outcomes"] for c, v in per.items()}), file=sys.stderr
        )
    out["sets"] = {k: out["sets"][k] for k in SETS if k in out["sets"]}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
