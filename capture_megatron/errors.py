"""User-facing errors: one paragraph naming the offending values, exit code 2, no traceback."""

from __future__ import annotations


class CaptureError(ValueError):
    """Bad input from the user (flags, shapes, files). The CLI prints the message and exits 2."""

    exit_code = 2


def require(problems: list[str], what: str) -> None:
    """Raise one CaptureError listing every problem found while validating `what`."""
    if problems:
        raise CaptureError(f"invalid {what}: " + "; ".join(problems) + ".")


class Stopped(BaseException):
    """A stop signal (SIGTERM, SIGHUP) turned into an exception, so that `finally` blocks remove
    temporary directories and stop worker processes before the command exits 128 + signum."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
