"""docs/MEGATRON_FLAGS.md is what bench/flags_doc.py renders from the code (megatron_args.json, the
option classes' flags, capture_megatron.rules.flags): regenerate it with
`python bench/flags_doc.py` when a flag's classification changes."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _generator():
    path = os.path.join(ROOT, "bench", "flags_doc.py")
    spec = importlib.util.spec_from_file_location("flags_doc", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_megatron_flags_doc_is_up_to_date():
    assert _generator().main(["--check"]) == 0, (
        "docs/MEGATRON_FLAGS.md is out of date: run python bench/flags_doc.py"
    )


def test_every_megatron_argument_is_on_the_page_once():
    gen = _generator()
    ours = set(gen.declared_parser()._option_string_actions)
    modelled, refused, ignored = gen.classify(ours)
    total = len(modelled) + sum(len(v) for v in refused.values()) + len(ignored)
    assert total == len(gen.megatron_lm.arguments(gen.SERIES))
    text = gen.render()
    for arg in gen.megatron_lm.arguments(gen.SERIES):
        assert f"`{arg.flags[0]}`" in text, arg.flags[0]


def test_the_generator_imports_no_torch():
    code = (
        "import runpy, sys; runpy.run_path(sys.argv[1]); "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    path = os.path.join(ROOT, "bench", "flags_doc.py")
    done = subprocess.run([sys.executable, "-c", code, path], cwd=ROOT, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
