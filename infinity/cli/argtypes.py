"""argparse value types shared by the subcommands."""
import argparse


def positive_int(s):
    """``type=`` for a flag that takes a positive integer (a clear error otherwise)."""
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v
