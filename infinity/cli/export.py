"""`infinity export DIR OUT [--tag T]`: consolidated safetensors model from a checkpoint."""
import argparse
import sys

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _size(s):
    try:
        v = s.strip().upper()
        for suffix, mul in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1)):
            if v.endswith(suffix):
                return int(float(v[: -len(suffix)]) * mul)
        return int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {s!r} (e.g. 5GB, 500MB, 1000000)") from None


def register(subparsers):
    p = subparsers.add_parser(
        "export", help="write a consolidated safetensors model from a checkpoint",
        description="Write the model weights of checkpoint DIR/<tag> (default: DIR/latest) to "
                    "OUT/model.safetensors, or OUT/model-XXXXX-of-YYYYY.safetensors plus "
                    "model.safetensors.index.json when larger than --max-shard-size. Optimizer "
                    "states are not exported. Every checksum is verified first.")
    p.add_argument("dir", metavar="DIR", help="checkpoint directory (the one holding 'latest')")
    p.add_argument("out", metavar="OUT", help="output directory (created if missing)")
    p.add_argument("--tag", default=None, help="checkpoint tag (default: the one in DIR/latest)")
    p.add_argument("--max-shard-size", type=_size, default=5 * 10**9,
                   help="largest output file (default 5GB; sizes in 10^n bytes)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                   help="cast floating-point weights (default: as saved)")
    p.set_defaults(func=run)


def run(args):
    import torch

    from infinity.checkpoint import CheckpointError, export_model
    from infinity.cli.main import CLIError
    try:
        files = export_model(args.dir, args.out, args.tag, max_shard_bytes=args.max_shard_size,
                             dtype=getattr(torch, _DTYPES[args.dtype]) if args.dtype else None)
    except CheckpointError as e:
        raise CLIError(str(e)) from e
    for f in files:
        print(f, file=sys.stdout)
    return 0
