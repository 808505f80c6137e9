"""`python -m capture_megatron.cli`: the console script."""

from capture_megatron.cli import run

run()
