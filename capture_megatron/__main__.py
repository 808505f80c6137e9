"""`python -m capture_megatron`: the console script (`capture-megatron`)."""

from capture_megatron.cli import run

run()
