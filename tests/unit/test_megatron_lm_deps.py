"""What a Megatron-LM checkout needs before `capture-megatron megatron-lm` launches it: every module
its pretrain_gpt.py imports unconditionally (read through the checkout's own modules, or found by
running its imports once) that is not installed is named in one paragraph with the pip command,
exit 2 -- never a torchrun traceback per rank. The checkouts here are small directories written by
the test (this is the error path; tests/dist/test_megatron_lm_checkout.py runs a real one)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from capture_megatron.errors import CaptureError
from capture_megatron.megatron_lm import deps as lm_deps

CHECKOUT_ENV = "CAPTURE_MEGATRON_TEST_MEGATRON_LM"
"""A Megatron-LM core_v0.16.x checkout to test against (tests skip without one)."""
MODEL = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
    "--max-position-embeddings 64 --micro-batch-size 1 --global-batch-size 4 --mock-data"
).split()


def _write(root, files: dict[str, str]) -> str:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(root)


def _checkout(tmp_path) -> str:
    """pretrain_gpt.py importing megatron.training, whose tokenizer module needs a missing
    module; imports that are optional (try), conditional (if) or lazy (in a function) are not
    needed to start."""
    return _write(
        tmp_path,
        {
            "pretrain_gpt.py": (
                "import os\nimport capture_absent_regex\nfrom megatron.training import tokenizer\n"
                "try:\n    import capture_absent_optional\nexcept ImportError:\n    pass\n"
                "if os.environ.get('X'):\n    import capture_absent_conditional\n"
                "def main():\n    import capture_absent_lazy\n"
            ),
            "megatron/training/__init__.py": "from .tokenizer import build\n",
            "megatron/training/tokenizer.py": "import json\nfrom . import bert\nbuild = 1\n",
            "megatron/training/bert.py": "import capture_absent_six\n",
        },
    )


def test_required_modules_follow_the_checkouts_own_imports(tmp_path):
    found = lm_deps.required_modules(_checkout(tmp_path))
    assert found == {
        "os": "pretrain_gpt.py",
        "capture_absent_regex": "pretrain_gpt.py",
        "json": "megatron/training/tokenizer.py",
        "capture_absent_six": "megatron/training/bert.py",
    }


def test_megatron_lm_names_every_missing_module_and_the_pip_command(tmp_path):
    checkout = _checkout(tmp_path / "lm")
    done = subprocess.run(
        [sys.executable, "-m", "capture_megatron.cli", "megatron-lm", "--megatron-lm", checkout]
        + ["--nproc-per-node", "2", "--dry-run", *MODEL],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, CAPTURE_MEGATRON_CACHE=str(tmp_path / "cache")),
    )
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Traceback" not in done.stderr and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("capture-megatron megatron-lm: error: "), lines
    assert (
        "capture_absent_regex (needed by pretrain_gpt.py); "
        "capture_absent_six (needed by megatron/training/bert.py)"
    ) in lines[0]
    assert f"`{sys.executable} -m pip install capture_absent_regex capture_absent_six`" in lines[0]
    assert "optional" not in lines[0] and "conditional" not in lines[0] and "lazy" not in lines[0]


def test_running_the_imports_finds_what_reading_them_cannot(tmp_path):
    checkout = _write(
        tmp_path,
        {"pretrain_gpt.py": "import importlib\nimportlib.import_module('capture_absent_dyn')\n"},
    )
    assert lm_deps.missing_modules(checkout, run_probe=False) == {}
    assert lm_deps.missing_modules(checkout) == {"capture_absent_dyn": "pretrain_gpt.py"}
    with pytest.raises(CaptureError, match="pip install capture_absent_dyn"):
        lm_deps.check(checkout)


def test_a_real_checkout_needs_more_than_megatron_core_declares():
    checkout = os.environ.get(CHECKOUT_ENV, "")
    if not os.path.isfile(os.path.join(checkout, "pretrain_gpt.py")):
        pytest.skip(f"set {CHECKOUT_ENV} to a Megatron-LM core_v0.16.x checkout to run this")
    found = lm_deps.required_modules(checkout)
    # core_v0.16.1: tokenizers (six, regex), initialize.py's batch-invariant kernels (triton),
    # megatron/rl imported by training.py (pydantic)
    assert {"six", "regex", "triton", "pydantic"} <= set(found), found
    assert found["triton"] == "megatron/core/transformer/custom_layers/batch_invariant_kernels.py"


def test_planner_only_flags_are_not_passed_to_megatron_lm():
    """--objective, --json, --reserve-fraction steer the plan; Megatron-LM would refuse them."""
    from capture_megatron.cli.megatron_lm import strip_planned

    user = ["--num-layers", "4", "--objective", "min-peak", "--json=p.json", "--reserve-fraction"]
    user += ["0.05", "--seq-length", "8", "--micro-batch-size", "2", "--sequence-parallel"]
    assert strip_planned(user) == ["--num-layers", "4", "--seq-length", "8"]


def test_a_model_the_run_would_not_see_is_refused():
    """A preset or HF config would shape the plan but not Megatron-LM's model: refused."""
    from capture_megatron.cli.megatron_lm import megatron_args_for

    with pytest.raises(CaptureError, match="--preset: the megatron-lm wrapper runs your"):
        megatron_args_for(["--preset", "gpt3-1.3b"], 8, 80.0, "fake-cuda", progress=False)
