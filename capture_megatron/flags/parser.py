"""Megatron-LM's command-line flags, as far as capture-megatron supports them. Pure argparse; no
torch.

Flag names, meanings and defaults follow megatron/training/arguments.py (core_v0.16.1). Every flag
is declared once, on the dataclass field it sets (capture_megatron.fields): `add_fields`
builds an argparse group from a dataclass, `from_namespace` reads the parsed values back into it,
and fields.to_flags writes an object out as flags. On strict parsers (training), a flag that
Megatron-LM knows but capture-megatron does not implement is an error that names it -- never
silently ignored; so is a flag neither knows (with the closest spelling as a suggestion).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
import textwrap
import types
import typing
from typing import Any, NoReturn, TypeVar

from capture_megatron.config import (
    BuildOptions,
    CheckpointOptions,
    DataOptions,
    DdpOptions,
    Kernels,
    ModelShape,
    OptimOptions,
    ParallelFlags,
    RunOptions,
)
from capture_megatron.errors import CaptureError, require
from capture_megatron.features.activation_offload import ActivationOffload
from capture_megatron.features.cuda_graphs import CudaGraphs
from capture_megatron.features.fsdp import Fsdp
from capture_megatron.features.mla import LatentAttention
from capture_megatron.features.moe import Experts
from capture_megatron.features.optimizers import Optimizer
from capture_megatron.fields import Flag, field_docs, flagged_fields, value_problems
from capture_megatron.flags.megatron_lm import flag_names

T = TypeVar("T")


def summary(doc: str | None) -> str:
    """A command's description for --help: the first paragraph of its module docstring, whole
    (argparse re-wraps it)."""
    return " ".join((doc or "").strip().split("\n\n")[0].split())


MEGATRON_GROUP = "Megatron flags"
"""The generated groups of Megatron-LM's flags have this in their title; --help hides them (the
long tail of accepted flags) and --help-all shows them."""
HELP_ALL = "--help-all"
"""The flag that shows every group."""


class _HelpAll(argparse.Action):
    """--help-all: the whole help, every Megatron-LM flag group included, then exit."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any):
        kwargs.update(default=argparse.SUPPRESS, nargs=0)
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        """Print the help with every group and exit 0."""
        if isinstance(parser, HelpParser):
            parser.show_all = True
        parser.print_help()
        parser.exit()


class HelpParser(argparse.ArgumentParser):
    """ArgumentParser whose --help opens with one runnable example and the essential options, then
    the command's own groups; the generated Megatron-LM flag groups (MEGATRON_GROUP in the title)
    are counted, not listed, unless --help-all is given. Parsing is argparse's, unchanged."""

    def __init__(
        self, *args: Any, example: str = "", essential: tuple[str, ...] = (), **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.example = example
        """One command line after the program name, shown first (it parses with this parser)."""
        self.essential = essential
        """Flags listed first, in this order (those the parser does not declare are skipped)."""
        self.show_all = False
        """Whether the help lists the Megatron-LM flag groups too (--help-all)."""
        if self.add_help:  # advertised by the help's count of the flags it adds, if any
            self.add_argument(HELP_ALL, action=_HelpAll, help=argparse.SUPPRESS)

    def _sections(self) -> list[tuple[str, list[argparse.Action]]]:
        """(title, actions) of the help's option sections: the essential options, then each
        group's others (the Megatron-LM groups only with show_all)."""
        named = {o: a for a in self._actions for o in a.option_strings}
        first = list(dict.fromkeys(named[n] for n in self.essential if n in named))
        out = [("essential options", first)] if first else []
        for group in self._action_groups:
            title = group.title or ""
            if MEGATRON_GROUP in title and not self.show_all:
                continue
            rest = [a for a in group._group_actions if a not in first]
            out.append((title, rest))
        return out

    def hidden_count(self) -> int:
        """How many flags the Megatron-LM groups hold that --help does not list."""
        return sum(
            1
            for group in self._action_groups
            if MEGATRON_GROUP in (group.title or "")
            for a in group._group_actions
            if a.help != argparse.SUPPRESS and a.option_strings[0] not in self.essential
        )

    def _example_lines(self) -> list[str]:
        """The example command line in lines of at most ~84 characters, a flag kept with its
        value."""
        glued = re.sub(r"(?<=\S) (?!-)", "\0", f"{self.prog} {self.example}")
        lines = textwrap.wrap(glued, 84, break_long_words=False, break_on_hyphens=False)
        return [line.replace("\0", " ") for line in lines]

    def format_help(self) -> str:
        """Usage, description, example, essential options, the command's groups, the count of
        Megatron-LM flags --help-all adds, epilog."""
        head = self._get_formatter()
        head.add_usage(self.usage, self._actions, self._mutually_exclusive_groups)
        head.add_text(self.description)
        text = head.format_help()
        if self.example:
            text += "\nexample:\n  " + " \\\n      ".join(self._example_lines()) + "\n"
        body = self._get_formatter()
        for title, actions in self._sections():
            body.start_section(title)
            body.add_arguments(actions)
            body.end_section()
        hidden = 0 if self.show_all else self.hidden_count()
        if hidden:
            body.add_text(f"{hidden} more Megatron-LM flags: {HELP_ALL}")
        body.add_text(self.epilog)
        return text + "\n" + body.format_help()


class FlagParser(HelpParser):
    """HelpParser whose errors are one-paragraph CaptureErrors (exit 2, no usage dump). Like
    Megatron-LM's parser it takes no abbreviations: `--num-layer` is a typo with a suggestion,
    not a prefix of one of several flags."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        """argparse's error hook: raise instead of printing usage and exiting."""
        raise CaptureError(message)


def _base_type(hint: Any) -> Any:
    """int for `int | None`, the hint itself otherwise."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return hint


def _argument(
    field: dataclasses.Field, spec: Flag, hint: Any, doc: str, unset: bool, default: Any
) -> dict[str, Any]:
    """add_argument keyword arguments for one field."""
    kind = _base_type(hint)
    text = " ".join(x for x in (doc, spec.note) if x)
    shown = default not in (None, "", False, (), dataclasses.MISSING) and kind is not bool
    if not unset and shown:
        text += f" (default: {default})"
    kwargs: dict[str, Any] = {"dest": field.name, "help": text.replace("%", "%%") or None}
    if kind is bool:
        kwargs["action"] = "store_false" if spec.negate else "store_true"
        kwargs["default"] = None if unset else default
    elif typing.get_origin(kind) is tuple and spec.sep:
        item = typing.get_args(kind)[0]
        kwargs.update(type=_joined(item, spec.sep), default=None if unset else default)
    elif typing.get_origin(kind) is tuple:
        kwargs.update(
            nargs="+", type=typing.get_args(kind)[0], default=None if unset else list(default)
        )
    else:
        kwargs.update(type=kind, default=None if unset else default)
    if spec.choices:
        kwargs["choices"] = list(spec.choices)
    if default is dataclasses.MISSING:
        kwargs.update(required=not unset, default=None)
    return kwargs


def _joined(item: type, sep: str) -> Any:
    """An argparse type: one word of values joined by `sep` ("4096,0" or "(4096,0)") -> tuple."""

    def parse(text: str) -> tuple:
        return tuple(item(x) for x in text.strip().strip("()").split(sep))

    parse.__name__ = f"'{sep}'-separated {item.__name__}s"
    return parse


def add_fields(
    parser: argparse.ArgumentParser,
    cls: type,
    title: str = "",
    *,
    unset: bool = False,
    defaults: dict[str, Any] | None = None,
    only: tuple[str, ...] = (),
) -> None:
    """An argument group with one flag per flag field of dataclass `cls` (help: the field's
    docstring). With `unset` every default is None, so `given` can tell what was typed; `only`
    limits the group to those fields. Flags the parser already has keep their first declaration."""
    present = set(parser._option_string_actions)
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    doc = (cls.__doc__ or "").strip().splitlines()[0]
    group = parser.add_argument_group(title or doc.rstrip("."))
    for field, spec in flagged_fields(cls):
        if spec.name in present or (only and field.name not in only):
            continue
        default = (defaults or {}).get(field.name, field.default)
        group.add_argument(
            spec.name,
            *(a for a in spec.aliases if a not in present),
            **_argument(field, spec, hints[field.name], docs.get(field.name, ""), unset, default),
        )


def given(cls: type, ns: argparse.Namespace) -> dict[str, Any]:
    """The flag fields of `cls` given on the command line (parsed with unset=True), by field
    name."""
    out: dict[str, Any] = {}
    for field, _ in flagged_fields(cls):
        value = getattr(ns, field.name, None)
        if value is not None:
            out[field.name] = tuple(value) if isinstance(value, list) else value
    return out


def from_namespace(cls: type[T], ns: argparse.Namespace, **extra: Any) -> T:
    """An instance of dataclass `cls` from parsed flags (fields not given keep their defaults);
    a CaptureError naming every flag whose number is not finite, negative, not an integer, or 0
    where Megatron needs at least 1 (fields.value_problems)."""
    obj = cls(**given(cls, ns), **extra)
    require(value_problems(obj), "flags")
    return obj


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """Model architecture flags (ModelShape), plus Megatron's switches for GQA and precision."""
    add_fields(p, ModelShape, "model (Megatron flags)", unset=True)
    add_fields(p, Experts, "mixture of experts (Megatron flags)", unset=True)
    add_fields(p, LatentAttention, "multi-latent attention (Megatron flags)", unset=True)
    g = p.add_argument_group("model switches (Megatron flags)")
    g.add_argument("--group-query-attention", action="store_true", help="Use --num-query-groups.")
    g.add_argument("--bf16", action="store_true", help="Train in bfloat16 (mixed precision).")
    g.add_argument("--fp16", action="store_true", help="Train in float16 (mixed precision).")


def add_kernel_flags(p: argparse.ArgumentParser, training: bool = False) -> None:
    """Layer implementation and fused kernels (Kernels). Megatron-LM's defaults, except that
    training here defaults to --transformer-impl auto (TE when importable on CUDA, else local)."""
    defaults = {"transformer_impl": "auto"} if training else None
    add_fields(p, Kernels, "kernels (Megatron flags)", defaults=defaults)


def add_parallel_flags(p: argparse.ArgumentParser) -> None:
    """Parallel sizes, batch and memory savers (ParallelFlags); unset values are None."""
    add_fields(p, ParallelFlags, "parallelism and batch (Megatron flags)", unset=True)
    add_fields(p, DdpOptions, "gradient buffers and optimizer state (Megatron flags)")
    add_fields(p, ActivationOffload, "fine-grained activation offloading (Megatron flags)")
    add_fields(p, CudaGraphs, "CUDA graphs (Megatron flags)")
    add_fields(p, Optimizer, "optimizer kind (Megatron flags)")
    add_fields(p, Fsdp, "Megatron-FSDP (Megatron flags)")


def ddp_options(ns: argparse.Namespace) -> DdpOptions:
    """DdpOptions from parsed flags, with its fine-grained activation offloading and CUDA graph
    settings, its optimizer and Megatron-FSDP."""
    return from_namespace(
        DdpOptions,
        ns,
        activation_offload=from_namespace(ActivationOffload, ns),
        cuda_graphs=from_namespace(CudaGraphs, ns),
        optimizer=from_namespace(Optimizer, ns),
        fsdp=from_namespace(Fsdp, ns),
    )


def add_training_flags(p: argparse.ArgumentParser, **defaults: Any) -> None:
    """Optimizer, schedule, loop length, logging and initialisation (OptimOptions, RunOptions,
    BuildOptions)."""
    add_fields(p, OptimOptions, "optimizer (Megatron flags)", defaults=defaults)
    add_fields(p, RunOptions, "training run (Megatron flags)", defaults=defaults)
    add_fields(p, BuildOptions, "model build (Megatron flags)", defaults=defaults)


def add_data_flags(p: argparse.ArgumentParser) -> None:
    """Data source and tokenizer (DataOptions)."""
    add_fields(p, DataOptions, "data (Megatron flags)")


def add_checkpoint_flags(p: argparse.ArgumentParser) -> None:
    """dist_checkpointing save/resume (CheckpointOptions)."""
    add_fields(p, CheckpointOptions, "checkpoints (Megatron flags; format torch_dist)")


def parse_flags(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse `argv`; every leftover flag is named in one CaptureError (unsupported vs unknown)."""
    ns, rest = parser.parse_known_args(argv)
    if not rest:
        return ns
    known = flag_names()
    ours = [a for action in parser._actions for a in action.option_strings]
    candidates = sorted(set(ours) | known)
    unsupported, unknown = [], []
    for token in rest:
        name = token.split("=", 1)[0]
        if not name.startswith("-"):
            unknown.append(f"stray value {token!r}")
        elif name in known:
            unsupported.append(name)
        else:
            close = difflib.get_close_matches(name, candidates, n=1)
            unknown.append(name + (f" (did you mean {close[0]}?)" if close else ""))
    parts = []
    if unsupported:
        parts.append(
            "Megatron-LM flags not supported by capture-megatron: " + ", ".join(unsupported)
        )
    if unknown:
        parts.append("unknown arguments: " + ", ".join(unknown))
    raise CaptureError("; ".join(parts) + ". See --help for the supported flags.")
