"""Every argument of Megatron-LM's pretrain_gpt.py, for commands that take a Megatron-LM command
line verbatim (`predict`, `plan`): the arguments capture-megatron's own option classes do not
declare are added to the parser from the table (hidden from --help) and, after parsing, each one
given is accepted and ignored, or refused with the reason (capture_megatron.rules.flags). Pure
Python (no torch).

One table per megatron-core series (TABLES): Megatron-LM core_v0.16.1's arguments
(megatron_args.json) and core_v0.19.0's (megatron_args-0.19.json), both extracted by
tests/data/extract_megatron_lm.py. A command line is read with the table of the installed
megatron-core (0.17 and 0.18, whose Megatron-LM no table was extracted for, with 0.19's: the
flags they added are in it).
"""

from __future__ import annotations

import argparse
import functools
import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

from capture_megatron.config import versions
from capture_megatron.errors import CaptureError
from capture_megatron.rules import flags as policy

PREFIX = "megatron_lm:"
"""Namespace attributes of the arguments added from the table start with this."""
TYPES = {"int": int, "float": float, "str": str}
"""Types the table names that values are parsed to (other types: kept as text)."""
TABLES = {versions.V0_16: "megatron_args.json", versions.V0_19: "megatron_args-0.19.json"}
"""Megatron-LM's arguments per megatron-core series (package data of capture_megatron.flags)."""


@dataclass(frozen=True)
class Argument:
    """One Megatron-LM argument as its parser declares it."""

    flags: tuple[str, ...]
    """Its spellings; the first names it."""
    kind: str
    """store, storetrue, storefalse or booleanoptional."""
    nargs: str | int | None
    """argparse's nargs."""
    type: str | None
    """The name of the type its values are parsed with."""
    default: Any
    """Megatron-LM's default."""
    choices: tuple[Any, ...] | None
    """Accepted values, if restricted."""

    def default_matches(self, value: Any) -> bool:
        """Whether a parsed value equals Megatron-LM's default."""
        if self.kind in ("storetrue", "storefalse", "booleanoptional"):
            return bool(value) == bool(self.default)
        return value == self.default or str(value) == str(self.default)


def table_series(series: versions.Series | None = None) -> versions.Series:
    """The series whose table reads a command line for megatron-core `series` (default: the
    installed one): the newest table at or below it, 0.17 and 0.18 reading 0.19's."""
    series = series or versions.current()
    return versions.V0_16 if series == versions.V0_16 else versions.V0_19


def arguments(series: versions.Series | None = None) -> tuple[Argument, ...]:
    """Every argument of pretrain_gpt.py for megatron-core `series` (default: the installed)."""
    return _arguments(table_series(series))


def all_flag_names() -> frozenset[str]:
    """Every spelling of every argument of any series' table."""
    return frozenset(f for s in TABLES for a in _arguments(s) for f in a.flags)


@functools.cache
def _arguments(series: versions.Series) -> tuple[Argument, ...]:
    text = resources.files("capture_megatron.flags").joinpath(TABLES[series]).read_text()
    rows = json.loads(text)["arguments"]
    return tuple(
        Argument(
            tuple(r["flags"]),
            r["kind"],
            r["nargs"],
            r["type"],
            r["default"],
            tuple(r["choices"]) if r["choices"] else None,
        )
        for r in rows
    )


def flag_names() -> frozenset[str]:
    """Every spelling of every argument."""
    return frozenset(f for a in arguments() for f in a.flags)


def add_megatron_lm_flags(parser: argparse.ArgumentParser) -> None:
    """Add every Megatron-LM argument the parser does not declare yet (default: not given)."""
    present = parser._option_string_actions
    group = parser.add_argument_group("every other Megatron-LM pretrain_gpt.py flag")
    for arg in arguments():
        known = [f for f in arg.flags if f in present]
        if known:  # declared by an option class: Megatron's other spellings become aliases
            action = present[known[0]]
            for alias in arg.flags:
                if alias not in present:
                    action.option_strings.append(alias)  # type: ignore[attr-defined]  # a list
                    present[alias] = action
            continue
        dest = PREFIX + arg.flags[0]
        common: dict[str, Any] = {
            "dest": dest,
            "default": argparse.SUPPRESS,
            "help": argparse.SUPPRESS,
        }
        if arg.kind in ("storetrue", "storefalse"):
            group.add_argument(*arg.flags, action="store_true", **common)
        elif arg.kind == "booleanoptional":
            group.add_argument(arg.flags[0], action="store_true", **common)
            group.add_argument(*arg.flags[1:], action="store_false", **common)
        else:
            kind = TYPES.get(arg.type or "str", str)
            choices = list(arg.choices) if arg.choices and kind is str else None
            group.add_argument(*arg.flags, type=kind, nargs=arg.nargs, choices=choices, **common)


def given(ns: argparse.Namespace) -> dict[str, Any]:
    """The Megatron-LM-only arguments given on the command line: first spelling -> value."""
    return {k[len(PREFIX) :]: v for k, v in vars(ns).items() if k.startswith(PREFIX)}


def check(ns: argparse.Namespace) -> tuple[str, ...]:
    """The given Megatron-LM-only flags that are ignored; CaptureError naming every given flag
    that changes memory in a way not modelled (unless it is at Megatron-LM's default), and every
    one Megatron-LM itself would stop at on this line (policy.RULES)."""
    table = {a.flags[0]: a for a in arguments()}
    lm = given(ns)
    line = policy.LineContext(
        rope=getattr(ns, "position_embedding_type", None) == "rope",
        offload_modules=tuple(getattr(ns, "offload_modules", None) or ()),
        transformer_impl=getattr(ns, "transformer_impl", "transformer_engine"),
        cpu_offloading_layers=lm.get("--cpu-offloading-num-layers") or 0,
        num_layers=getattr(ns, "num_layers", None) or 0,
        pp=getattr(ns, "pipeline_model_parallel_size", None) or 1,
        recompute=_recompute(ns),
    )
    ignored: list[str] = []
    refused: list[str] = []
    invalid: list[str] = []
    if getattr(ns, "fine_grained_activation_offloading", False):  # declared (ActivationOffload)
        stop = policy.conditional_verdict("--fine-grained-activation-offloading", True, line)
        invalid += [f"--fine-grained-activation-offloading ({stop[1]})"] if stop else []
    else:  # read only with it (every megatron-core call site tests it first)
        ignored += _read_only_with_offloading(ns)
    ignored += _read_only_with_fsdp(ns)
    for name, value in given(ns).items():
        arg = table[name]
        if arg.kind == "storefalse":  # given means set to False, i.e. off the default
            value = False
        shown = name if isinstance(value, bool) else f"{name} {_text(value)}"
        reason = policy.unmodelled_reason(*arg.flags)
        verdict = policy.conditional_verdict(name, value, line)
        if verdict is not None:
            (refused if verdict[0] == "refused" else invalid).append(f"{shown} ({verdict[1]})")
        elif reason is not None and not arg.default_matches(value):
            refused.append(f"{shown} ({reason})")
        else:
            ignored.append(name)
    if refused or invalid:
        raise CaptureError(_refusal(refused, invalid))
    return tuple(sorted(ignored))


def _recompute(ns: argparse.Namespace) -> str | None:
    """--recompute-granularity as given (--recompute-activations: selective)."""
    if getattr(ns, "recompute_activations", None):
        return "selective"
    return getattr(ns, "recompute_granularity", None)


def _read_only_with_offloading(ns: argparse.Namespace) -> list[str]:
    """--offload-modules and --min-offloaded-tensor-size when given without
    --fine-grained-activation-offloading (at a value other than the default): they change
    nothing, so they are listed as ignored."""
    out = ["--offload-modules"] if getattr(ns, "offload_modules", None) else []
    size = getattr(ns, "min_offloaded_tensor_size", 1024 * 1024)
    return out + (["--min-offloaded-tensor-size"] if size != 1024 * 1024 else [])


FSDP_KNOBS = {
    "data_parallel_sharding_strategy": "no_shard",
    "outer_dp_sharding_strategy": "no_shard",
    "fsdp_double_buffer": False,
    "suggested_communication_unit_size": None,
    "nccl_ub": False,
}
"""Megatron-FSDP's settings (capture_megatron.features.fsdp.Fsdp) and their defaults: without
--use-megatron-fsdp megatron-core's DDP reads none of them but --use-nccl-ub, which gives its
buffers the same bytes from an NCCL-registered pool."""


def _read_only_with_fsdp(ns: argparse.Namespace) -> list[str]:
    """Megatron-FSDP's settings given without --use-megatron-fsdp: they change nothing, so they
    are listed as ignored."""
    if getattr(ns, "use_megatron_fsdp", False):
        return []
    given = [k for k, v in FSDP_KNOBS.items() if getattr(ns, k, v) != v]
    names = {"nccl_ub": "use_nccl_ub"}
    return ["--" + names.get(k, k).replace("_", "-") for k in given]


def _refusal(refused: list[str], invalid: list[str]) -> str:
    """One paragraph naming the refused flags, then those Megatron-LM stops at."""
    parts = []
    if refused:
        parts.append(
            "these flags change memory in a way capture-megatron does not model yet: "
            + "; ".join(refused)
            + ". Leave them out to predict the run without them."
        )
    if invalid:
        parts.append("Megatron-LM would not run this line: " + "; ".join(invalid) + ".")
    return " ".join(parts)


def _text(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)
