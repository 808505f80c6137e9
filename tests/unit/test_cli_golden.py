"""Issue 54: the command line's output on a fixed set of inputs is byte-identical to the golden
file (tests/unit/cli_golden.py: every launch line and HF config of tests/data through predict and
plan, and a small model under each objective, on the synthetic memory model). A change of output
that is meant regenerates the golden file (`python tests/unit/cli_golden.py --write`) and shows in
its diff."""

from __future__ import annotations

import pytest
from cli_golden import cases, golden, run

pytestmark = pytest.mark.slow


def test_the_golden_file_has_every_case():
    assert [row["name"] for row in golden()] == [case.name for case in cases()]


@pytest.mark.parametrize("group", range(4))
def test_output_is_byte_identical(group):
    """A quarter of the cases per test, so that pytest-xdist spreads them over its workers."""
    expected = {row["name"]: row for row in golden()}
    for i, case in enumerate(cases()):
        if i % 4 == group:
            assert run(case) == expected[case.name], case.name
