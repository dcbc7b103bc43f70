"""Entry point of the `infinity` command.

Each subcommand lives in its own module ``infinity.cli.<name>`` exposing
``register(subparsers)`` which adds its parser and sets ``func`` (called with the
parsed args, returns an exit code). Modules are imported lazily so that
``infinity doctor`` works even when a heavy dependency is broken.
"""
import argparse
import importlib
import logging
import sys

# (command name, module)
COMMANDS = [
    ("finetune", "infinity.cli.finetune"),
    ("estimate", "infinity.cli.estimate"),
    ("bench-io", "infinity.cli.bench_io"),
    ("bench-adam", "infinity.cli.bench_adam"),
    ("doctor", "infinity.cli.doctor"),
    ("export", "infinity.cli.export"),
]


class CLIError(Exception):
    """A user-facing error: printed without a traceback, exit code 2."""


def build_parser():
    p = argparse.ArgumentParser(prog="infinity",
                                description="Heterogeneous memory offload runtime for PyTorch.")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, modname in COMMANDS:
        try:
            mod = importlib.import_module(modname)
        except ModuleNotFoundError as e:
            if e.name == modname:
                continue  # command not built into this version
            raise
        mod.register(sub)
    return p


def setup_logging(verbosity):
    """Library logs go to stderr (stdout is reserved for results, e.g. --json)."""
    level = logging.INFO if verbosity <= 1 else logging.DEBUG
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter("[infinity] %(levelname)s %(message)s"))
    root = logging.getLogger("infinity")
    root.handlers[:] = [h]
    root.setLevel(level)
    root.propagate = False


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    setup_logging(args.verbose)
    try:
        return int(args.func(args) or 0)
    except CLIError as e:
        print(f"infinity {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"infinity {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
