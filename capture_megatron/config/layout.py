"""Megatron's pipeline splits: the --pipeline-model-parallel-layout grammar, parsed to transformer
layers per virtual stage, and the split --decoder-first/last-pipeline-num-layers give.

Grammar (megatron/core/transformer/pipeline_parallel_layer_layout.py): ``E`` embedding, ``t``
transformer (decoder) layer, ``m`` multi-token prediction layer, ``L`` loss (final norm + output
layer), ``|`` between virtual stages, ``(...)*n`` and ``x*n`` repeat (unrolled as megatron-core
unrolls them: one pass of each pattern, so no nesting), ``,`` is cosmetic. A layout
with k * pp stages means VPP k; virtual stage i sits on pipeline rank i % pp. E must open the first
stage and L close the last; the MTP layers (all of them) sit in the last stage, after its decoder
layers and before L (Megatron's standard placement; elsewhere is --mtp-standalone, not modelled).
Pure Python; no torch.
"""

from __future__ import annotations

import re

from capture_megatron.errors import CaptureError, require

_REPEATS = (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)")
"""megatron-core 0.16.1's two unrolling patterns (PipelineParallelLayerLayout.parse_str_to_list),
each applied once, in this order: a parenthesised group times n, then one character times n."""


def expand(layout: str) -> str:
    """The layout with repeats unrolled and commas dropped, exactly as megatron-core 0.16.1 unrolls
    it ('(tt|)*2L' -> 'tt|tt|L'; a space stays, and is then an invalid character, as there)."""
    text = layout.replace(",", "")
    for pattern in _REPEATS:
        text = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), text)
    return text


def _unescaped(layout: str) -> str:
    """The layout with shell backslash escapes removed (as a shell, xargs or eval removes them)."""
    previous = None
    while previous != layout:
        previous, layout = layout, re.sub(r"\\(.)", r"\1", layout)
    return layout


def parse_layout(
    layout: str, pp: int, num_layers: int | None = None, mtp_layers: int | None = None
) -> tuple[int, ...]:
    """Transformer layers per virtual stage of `layout` for pipeline size `pp`.

    Raises CaptureError naming the problem: characters outside E/t/m/L/|, a stage count not a
    multiple of pp, E not first or L not last (or repeated), a layer count != num_layers, or (with
    `mtp_layers` given) MTP layers other than `mtp_layers` of them at the end of the last stage.
    """
    if "\\" in layout:  # megatron-core would stop at the backslash: say what it should read
        raise CaptureError(
            f"--pipeline-model-parallel-layout {layout!r}: backslashes are not E, t, m, L or | "
            "(megatron-core stops at them too); the value still carries shell escapes, which a "
            "shell (or Megatron-LM's functional-test launcher, by xargs and eval) removes before "
            f"Megatron reads it: give it unescaped, {_unescaped(layout)!r}."
        )
    text = expand(layout)
    stages = text.split("|")
    problems = []
    bad = sorted(set(text) - set("EtmL|"))
    if bad:
        problems.append(f"characters {bad} are not E, t, m, L or |")
    if len(stages) % pp:
        problems.append(f"{len(stages)} stages is not a multiple of pipeline size {pp}")
    if text.count("E") != 1 or not stages[0].startswith("E"):
        problems.append("E (embedding) must appear once, at the start of the first stage")
    if text.count("L") != 1 or not stages[-1].endswith("L"):
        problems.append("L (loss/output layer) must appear once, at the end of the last stage")
    counts = tuple(s.count("t") for s in stages)
    if num_layers is not None and sum(counts) != num_layers:
        problems.append(
            f"it places {sum(counts)} transformer layers but --num-layers is {num_layers}"
        )
    if mtp_layers is not None:
        problems += _mtp_problems(stages, mtp_layers)
    if problems:
        raise CaptureError(
            f"--pipeline-model-parallel-layout {layout!r}: " + "; ".join(problems) + "."
        )
    return counts


def _mtp_problems(stages: list[str], mtp_layers: int) -> list[str]:
    """Why the layout's MTP layers ('m') are not `mtp_layers` of them at the end of the last stage,
    before L (empty: they are)."""
    placed = sum(s.count("m") for s in stages)
    if placed != mtp_layers:
        return [
            f"it places {placed} multi-token prediction layers (m) but --mtp-num-layers is "
            f"{mtp_layers} (Megatron requires them to match)"
        ]
    last = stages[-1].removesuffix("L")
    if placed and (stages[-1].count("m") != placed or not last.endswith("m" * placed)):
        return [
            "its multi-token prediction layers (m) must all sit at the end of the last stage, "
            "after its transformer layers and before L (MTP on another stage is Megatron's "
            "--mtp-standalone, which is not modelled)"
        ]
    return []


def format_layout(layers_per_stage: tuple[int, ...], mtp_layers: int = 0) -> str:
    """Megatron's layout string for transformer layers per virtual stage (E first, L last), the
    `mtp_layers` multi-token prediction layers just before L."""
    stages = ["t" * n for n in layers_per_stage]
    stages[0] = "E" + stages[0]
    stages[-1] = stages[-1] + "m" * mtp_layers + "L"
    return "|".join(stages)


def first_last_split(
    num_layers: int, pp: int, vpp: int, first: int | None, last: int | None
) -> tuple[int, ...]:
    """Megatron's split for --decoder-first/last-pipeline-num-layers: the middle stages are even.

    With VPP, the first (last) pipeline stage's layers are divided evenly over its virtual stages,
    as megatron's TransformerConfig requires.
    """
    ends = [n for n in (first, last) if n is not None]
    middle_stages = pp - len(ends)
    rest = num_layers - sum(ends)
    problems = []
    if any(n <= 0 for n in ends):
        problems.append(f"first/last stage layers {ends} must be larger than 0 (Megatron's rule)")
    elif rest < 0:
        problems.append(f"first/last stage layers {ends} exceed --num-layers {num_layers}")
    elif middle_stages == 0 and rest:
        problems.append(f"{rest} layers left over with no middle stage")
    elif middle_stages and rest % (middle_stages * vpp):
        problems.append(
            f"the remaining {rest} layers do not split evenly over {middle_stages} middle stages"
            + (f" x {vpp} virtual stages" if vpp > 1 else "")
        )
    for n in ends:
        if n % vpp:
            problems.append(f"{n} first/last-stage layers not divisible by {vpp} virtual stages")
    require(problems, "first/last pipeline stage split")
    per_middle = rest // (middle_stages * vpp) if middle_stages else 0
    per_rank = [per_middle] * pp
    if first is not None:
        per_rank[0] = first // vpp
    if last is not None:
        per_rank[-1] = last // vpp
    return tuple(per_rank[i % pp] for i in range(pp * vpp))


def accounted_split(
    num_layers: int, pp: int, vpp: int, embedding: bool, loss: bool
) -> tuple[int, ...]:
    """Megatron's even split when --account-for-embedding/loss-in-pipeline-split count the
    embedding / the loss as one more layer each: (num_layers + those) / (pp * vpp) per virtual
    stage, minus the embedding on the first virtual stage and the loss on the last
    (megatron/core/transformer/transformer_block.py get_num_layers_to_build)."""
    total = num_layers + int(embedding) + int(loss)
    if total % (pp * vpp):
        require(
            [
                f"--num-layers {num_layers} plus the accounted embedding/loss ({total}) does not "
                f"split evenly over {pp} pipeline stages"
                + (f" x {vpp} virtual stages" if vpp > 1 else "")
            ],
            "pipeline split",
        )
    layers = [total // (pp * vpp)] * (pp * vpp)
    layers[0] -= int(embedding)
    layers[-1] -= int(loss)
    if min(layers) < 0:
        require(["a stage would hold fewer than zero layers"], "pipeline split")
    return tuple(layers)
