"""argparse value types shared by the subcommands."""
import argparse


def _int_at_least(s, lo: int, what: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
    if v < lo:
        raise argparse.ArgumentTypeError(f"expected {what}, got {v}")
    return v


def positive_int(s):
    """``type=`` for a flag that takes a positive integer (a clear error otherwise)."""
    return _int_at_least(s, 1, "a positive integer")


def nonneg_int(s):
    """``type=`` for a flag that takes an integer >= 0 (a clear error otherwise)."""
    return _int_at_least(s, 0, "an integer >= 0")
