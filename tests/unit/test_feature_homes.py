"""The package's homes, read from its files (docs/ARCHITECTURE.md, "Homes"): FP8 is named in at
most eight package files (file names and content, any case: what `grep -ril fp8` finds), the rule
book is three modules, and every `*_problem(s)` function outside it is a listed exception (a check
of one option object's own values in its constructor, or not a support rule)."""

from __future__ import annotations

import ast
import os
import re

PACKAGE = os.path.join(os.path.dirname(__file__), "..", "..", "capture_megatron")

FP8_FILES = {
    "features/fp8.py": "its home: what each recipe keeps, tensor by tensor",
    "emulate/gpu/fp8.py": "its GPU kernel set emulation (Fp8Setting, a Precision)",
    "config/kernels.py": "its flags, fields of Kernels (the plan JSON's names)",
    "rules/modelled.py": "its rules",
    "megatron/gpu_spec.py": "the layer specs' precision",
    "config/ddp.py": "Megatron-LM's --exp-avg-dtype fp8",
    "megatron/training.py": "megatron-core's use_precision_aware_optimizer_no_fp8_or_ds_fp8",
    "emulate/cpu_compat.py": "Transformer Engine's FP8GlobalStateManager (patch 9)",
}
"""The package files allowed to name FP8, and why."""

RULE_BOOK = {"flags.py", "megatron.py", "modelled.py"}
"""The rule book's modules (besides its __init__ and the flag table rules/flags.json)."""

NOT_IN_THE_RULE_BOOK = {
    "config.model.tp_head_problems": "TP against heads: ModelShape's, the records' and the "
    "planner's candidates' own check, below the rule book",
    "config.ddp.plan_problems": "ParallelPlan's constructor checks its DdpOptions with its sizes",
    "features.optimizer_offload.offload_problems": "DdpOptions' constructor",
    "planner.space.virtual_stage_problem": "the searched space's virtual stages (a planner Space)",
    "forecast.layers.micro_batch_problem": "whether a fitted memory model covers a micro-batch",
    "fields.value_problems": "every dataclass field's value (positive, finite)",
    "train.data.indexed_problem": "a data file on disk",
    "train.checkpoint.verify.quick_problems": "a checkpoint on disk",
    "train.checkpoint.verify.hash_problems": "a checkpoint on disk",
}
"""Public `*_problem(s)` functions outside the rule book, and why they are not in it."""

PRIVATE_CHECKS = ("config.", "features.", "fields", "train.")
"""Where private `_*_problem(s)` helpers may be: constructors' checks of their own values, files."""


def _package_files() -> list[str]:
    out = []
    for root, _, files in os.walk(PACKAGE):
        out += [os.path.join(root, f) for f in files if f.endswith(".py")]
    return sorted(os.path.relpath(p, PACKAGE) for p in out)


def _naming_fp8() -> set[str]:
    found = set()
    for rel in _package_files():
        with open(os.path.join(PACKAGE, rel)) as f:
            text = f.read()
        if re.search("fp8", rel + "\n" + text, re.IGNORECASE):
            found.add(rel)
    return found


def test_fp8_is_named_in_at_most_eight_package_files():
    """`grep -ril fp8 capture_megatron --include=*.py`: only the listed files."""
    found = _naming_fp8()
    assert len(FP8_FILES) <= 8
    assert found <= set(FP8_FILES), f"FP8 named outside its homes: {sorted(found - set(FP8_FILES))}"
    assert "features/fp8.py" in found and "emulate/gpu/fp8.py" in found


def test_the_rule_book_is_three_modules():
    rules = {f for f in os.listdir(os.path.join(PACKAGE, "rules")) if f.endswith(".py")}
    assert rules - {"__init__.py"} == RULE_BOOK
    data = {f for f in os.listdir(os.path.join(PACKAGE, "rules")) if f.endswith(".json")}
    assert data == {"flags.json"}


def _problem_functions() -> list[tuple[str, str]]:
    """(module, function) of every `def *_problem` / `*_problems` in the package."""
    out = []
    for rel in _package_files():
        module = rel[:-3].replace(os.sep, ".")
        with open(os.path.join(PACKAGE, rel)) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and re.search(r"_problems?$", node.name):
                out.append((module, node.name))
    return out


def test_rule_functions_live_in_the_rule_book():
    """A `*_problem(s)` function outside rules/ is a constructor's private check of its own values
    (config/, features/, fields, train/) or a listed exception."""
    stray = []
    for module, name in _problem_functions():
        if module.startswith("rules."):
            continue
        if name.startswith("_") and module.startswith(PRIVATE_CHECKS):
            continue
        if f"{module}.{name}" not in NOT_IN_THE_RULE_BOOK:
            stray.append(f"{module}.{name}")
    assert not stray, f"rules outside the rule book (capture_megatron/rules/): {stray}"
    listed = {f"{m}.{n}" for m, n in _problem_functions()}
    assert set(NOT_IN_THE_RULE_BOOK) <= listed, set(NOT_IN_THE_RULE_BOOK) - listed


def test_the_finders_find():
    """The finders see what they look for: FP8's home and the rule book's functions."""
    assert "rules/modelled.py" in _naming_fp8()
    assert ("rules.modelled", "fp8_problem") in _problem_functions()
    assert ("rules.megatron", "fsdp_problems") in _problem_functions()
