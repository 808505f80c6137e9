"""Shared pytest set-up: keep megatron's import-time warnings out of test output."""
import warnings

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
