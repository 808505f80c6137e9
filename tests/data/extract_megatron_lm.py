"""Extract what capture-megatron needs from a Megatron-LM checkout at tag core_v0.16.1 (or, with
--tag core_v0.19.0, the 0.19 series' files, run in an environment holding megatron-core 0.19.x).

    git clone https://github.com/NVIDIA/Megatron-LM && git -C Megatron-LM checkout core_v0.16.1
    pip install six regex          # Megatron-LM's training package needs them to import
    python tests/data/extract_megatron_lm.py Megatron-LM
    git -C Megatron-LM checkout core_v0.19.0   # with megatron-core 0.19.2 (make setup312)
    .venv312/bin/python tests/data/extract_megatron_lm.py Megatron-LM --tag core_v0.19.0

core_v0.19.0 is the 0.19 series' tag (megatron-core 0.19.2's megatron/core equals it in every file
that builds, trains or checkpoints a GPT). Writes, for core_v0.16.1 (other tags: the same files
with the series in their names, megatron_args-0.19.json and megatron_lm_functional_tests-0.19.json)
- capture_megatron/flags/megatron_args.json: every argument pretrain_gpt.py accepts, read from
  Megatron-LM's own parser (megatron/training/arguments.py add_megatron_arguments, the flags its
  ArgumentGroupFactory generates from config dataclasses included): spellings, kind, nargs, type,
  default, choices.
- tests/data/megatron_lm_functional_tests.json: per GPT / MoE / Mixtral functional test case that
  logs memory on 8 x H100 (tests/functional_tests/test_cases/<model>/<case>): its MODEL_ARGS turned
  into a command line the way tests/functional_tests/shell_test_utils/_run_training.sh does, its
  ENV_VARS, the world size from tests/test_utils/recipes/h100/<model>.yaml, and the measured
  mem-max-allocated-bytes (max over the logged iterations) and mem-allocated-bytes (after the
  optimizer step) of the last pipeline rank, which is the rank that logs them.

Megatron-LM is (c) NVIDIA CORPORATION, BSD-3-Clause / Apache-2.0 (its LICENSE); these files copy
command lines and measured values from it, with the source path of each case.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import types
import warnings
from typing import Any

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
TAG = "core_v0.16.1"
MODELS = ("gpt", "moe", "mixtral")


def megatron_parser(checkout: pathlib.Path) -> argparse.ArgumentParser:
    """Megatron-LM's pretrain_gpt.py parser, built without importing megatron.training's package
    init (which needs triton / Transformer Engine)."""
    warnings.simplefilter("ignore")
    import megatron
    import megatron.core  # noqa: F401 - the installed megatron-core provides megatron.core

    pkg = types.ModuleType("megatron.training")
    pkg.__path__ = [str(checkout / "megatron" / "training")]  # type: ignore[attr-defined]
    sys.modules["megatron.training"] = pkg
    megatron.training = pkg  # type: ignore[attr-defined]
    sys.path.append(
        str(checkout)
    )  # megatron.legacy from the checkout; megatron.core stays the wheel's
    import megatron.training.global_vars as global_vars

    for name in dir(global_vars):
        if name.startswith(("get_", "set_")):
            setattr(pkg, name, getattr(global_vars, name))
    from megatron.training.arguments import add_megatron_arguments

    return add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return str(getattr(value, "name", value))


def argument_table(parser: argparse.ArgumentParser) -> list[dict[str, Any]]:
    """One row per argument: flags, dest, kind, nargs, type, default, choices."""
    rows = []
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        kind = type(action).__name__.strip("_").replace("Action", "").lower()
        rows.append(
            {
                "flags": list(action.option_strings),
                "dest": action.dest,
                "kind": kind,
                "nargs": action.nargs if isinstance(action.nargs, str | int) else None,
                "type": getattr(action.type, "__name__", None) if action.type else None,
                "default": _plain(action.default),
                "choices": [_plain(c) for c in action.choices] if action.choices else None,
            }
        )
    return rows


def command_line(model_args: dict[str, Any]) -> list[str]:
    """MODEL_ARGS as _run_training.sh passes them: `true` is the bare flag, an empty value is
    dropped, a [list] is its items, anything else is the flag and its value."""
    merged = dict(model_args)
    base = merged.pop("<<", {})  # a YAML merge key (anchors), as yq's explode() resolves it
    merged = {**base, **merged}
    argv: list[str] = []
    for key, value in merged.items():
        value = value.strip()
        if value == "true":
            argv.append(key)
        elif value == "":
            continue
        elif value.startswith("[") and value.endswith("]"):
            argv += [key, *value[1:-1].replace(",", " ").split()]
        else:
            argv += [key, value]
    return argv


def _git(checkout: pathlib.Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(checkout), *args], capture_output=True, text=True, check=True
    ).stdout


def _world_sizes(checkout: pathlib.Path, model: str) -> dict[str, int]:
    path = checkout / "tests/test_utils/recipes/h100" / f"{model}.yaml"
    if not path.exists():
        return {}
    recipe = yaml.safe_load(path.read_text())
    default = recipe["spec"].get("nodes", 1) * recipe["spec"].get("gpus", 8)
    sizes = {}
    for product in recipe.get("products", []):
        world = product.get("nodes", recipe["spec"].get("nodes", 1)) * product.get(
            "gpus", recipe["spec"].get("gpus", 8)
        )
        for case in product["test_case"]:
            sizes[case] = world if world else default
    return sizes


def _measured(golden: dict[str, Any]) -> dict[str, int] | None:
    if not isinstance(golden.get("mem-max-allocated-bytes"), dict):
        return None  # absent, or a single number (inference cases, not training)
    peak = golden["mem-max-allocated-bytes"]["values"]
    static = golden.get("mem-allocated-bytes", {}).get("values", {})
    finite = [v for v in peak.values() if isinstance(v, int | float) and v == v]
    after = [v for v in static.values() if isinstance(v, int | float) and v == v]
    if not finite:
        return None
    return {
        "max_allocated_bytes": int(max(finite)),
        "allocated_bytes": int(max(after)) if after else 0,
        "iterations": len(finite),
    }


def cases(checkout: pathlib.Path, tag: str = TAG) -> list[dict[str, Any]]:
    """Every functional test case with an H100 memory measurement."""
    out = []
    for model in MODELS:
        sizes = _world_sizes(checkout, model)
        base = checkout / "tests/functional_tests/test_cases" / model
        for case_dir in sorted(p for p in base.iterdir() if p.is_dir()):
            golden_path = case_dir / "golden_values_dev_dgx_h100.json"
            config_path = case_dir / "model_config.yaml"
            if not golden_path.exists() or not config_path.exists():
                continue
            measured = _measured(json.loads(golden_path.read_text()))
            config = yaml.load(config_path.read_text(), Loader=yaml.BaseLoader)  # scalars as text
            if measured is None or "MODEL_ARGS" not in config:
                continue
            out.append(
                {
                    "name": case_dir.name,
                    "model": model,
                    "source": f"NVIDIA/Megatron-LM@{tag}:{case_dir.relative_to(checkout)}",
                    "world_size": sizes.get(case_dir.name),
                    "env_vars": config.get("ENV_VARS", {}),
                    "argv": command_line(config["MODEL_ARGS"]),
                    "second_run_argv": command_line(config["MODEL_ARGS_2"])
                    if "MODEL_ARGS_2" in config
                    else None,
                    "measured": measured,
                }
            )
    return out


def suffix(tag: str) -> str:
    """The file-name suffix of a tag's series: '' for core_v0.16.1, '-0.19' for core_v0.19.0."""
    if tag == TAG:
        return ""
    major, minor = tag.removeprefix("core_v").split(".")[:2]
    return f"-{major}.{minor}"


def main() -> None:
    """Write both files from the checkout given on the command line."""
    ap = argparse.ArgumentParser(description="extract flags and golden values from Megatron-LM")
    ap.add_argument("checkout", help="a Megatron-LM checkout at --tag")
    ap.add_argument("--tag", default=TAG, help=f"its tag (default {TAG})")
    ns = ap.parse_args()
    checkout, tag, tail = pathlib.Path(ns.checkout).resolve(), ns.tag, suffix(ns.tag)
    if (checkout / ".git").exists():
        head = _git(checkout, "describe", "--tags", "--exact-match").strip()
        if head != tag:
            sys.exit(f"{checkout} is at {head!r}; check out {tag}")
    table = argument_table(megatron_parser(checkout))
    (ROOT / f"capture_megatron/flags/megatron_args{tail}.json").write_text(
        json.dumps(
            {
                "source": f"NVIDIA/Megatron-LM@{tag}:megatron/training/arguments.py",
                "arguments": table,
            },
            indent=0,
        )
        + "\n"
    )
    found = cases(checkout, tag)
    (ROOT / f"tests/data/megatron_lm_functional_tests{tail}.json").write_text(
        json.dumps(
            {
                "source": f"NVIDIA/Megatron-LM@{tag}",
                "license": "see Megatron-LM's LICENSE",
                "cases": found,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"{len(table)} arguments; {len(found)} cases with memory values")


if __name__ == "__main__":
    main()
