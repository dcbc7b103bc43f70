"""Entry point of the `infinity` command.

Each subcommand lives in its own module ``infinity.cli.<name>`` exposing
``register(subparsers)`` which adds its parser and sets ``func`` (called with the
parsed args, returns an exit code). Modules are imported lazily so that
``infinity doctor`` works even when a heavy dependency is broken.
"""
import argparse
import importlib
import logging
import os
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


def _version():
    """The installed package's version (infinity/__init__.py's without importing torch)."""
    try:
        from importlib.metadata import version
        return version("infinity")
    except Exception:
        import re
        init = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "__init__.py")
        with open(init, encoding="utf-8") as f:
            m = re.search(r'^__version__ = "([^"]+)"', f.read(), re.M)
        return m.group(1) if m else "unknown"


def _stdout_closed():
    """The reader of stdout went away (``infinity estimate --json | head -1``): stop quietly.
    stdout is pointed at /dev/null so that the interpreter's final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return 141   # 128 + SIGPIPE, as a shell reports a command killed by it


def build_parser():
    p = argparse.ArgumentParser(prog="infinity",
                                description="Heterogeneous memory offload runtime for PyTorch.")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    p.add_argument("--version", action="version", version=f"infinity {_version()}",
                   help="print the version and exit")
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


class _CurrentStderr(logging.StreamHandler):
    """Writes each record to ``sys.stderr`` as it is then, not as it was at set-up (a caller
    that replaced and closed it meanwhile -- a test's capture, a redirect -- must not turn
    every later log line into a "--- Logging error ---")."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def setup_logging(verbosity):
    """Library logs go to stderr (stdout is reserved for results, e.g. --json)."""
    level = logging.INFO if verbosity <= 1 else logging.DEBUG
    h = _CurrentStderr()
    h.setFormatter(logging.Formatter("[infinity] %(levelname)s %(message)s"))
    root = logging.getLogger("infinity")
    root.handlers[:] = [h]
    root.setLevel(level)
    root.propagate = False


def main(argv=None):
    try:
        return _main(argv)
    except BrokenPipeError:
        return _stdout_closed()


def _main(argv):
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:       # --help/--version printed (or a usage error): flush here
        sys.stdout.flush()
        raise e
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    setup_logging(args.verbose)
    try:
        rc = int(args.func(args) or 0)
        sys.stdout.flush()         # a closed pipe surfaces here, not at interpreter exit
        return rc
    except BrokenPipeError:
        raise
    except CLIError as e:
        print(f"infinity {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"infinity {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # `python -m infinity.cli.main`: run the module the subcommands import (one CLIError class)
    from infinity.cli.main import main as _main
    sys.exit(_main())
